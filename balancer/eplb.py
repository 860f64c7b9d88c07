"""Expert-parallel load balancing: which logical expert each physical slot holds, layer by layer.

`rebalance_experts` keeps the signature and output meaning of DeepSeek's EPLB, so plans from either can be
swapped. On one node (or with balance alone in view) one policy serves every deployment (EPLB's hierarchical
policy packs whole expert groups onto nodes first, which caps balance on skewed loads):
  1. candidates: several choices of which experts get the R - E redundant replicas (EPLB's rule, and
     variants that keep some back as small filler), each packed by LPT: heaviest replica first onto the
     least-loaded GPU with a free slot, preferring GPUs that lack the expert. One candidate is exactly
     EPLB's global policy. Each layer keeps its best candidate;
  2. local search on the most-loaded GPU: swap slots with other GPUs, or switch a slot to another expert
     (changing replica counts), while that lowers it.
With `previous` (the phy2log in service) a layer keeps its placement if that is within `tolerance`
balancedness of the fresh plan; otherwise it takes whichever repair of the previous placement reaches
that with the fewest slots reloaded (see _replan_from). With several nodes, that plan's replica counts feed
the node-aware planner (balancer/node_placement.py), which trades balance above a target for locality.

Shape legend (see balancer/placement.py): L layers, E logical experts, R physical slots, G GPUs,
S = R // G slots per GPU, N redundant replicas or items, K candidates, B = K * L rows, n layers in work,
C swap partner slots. All functions are pure, on CPU tensors, vectorised over layers.
"""

import contextlib

import torch

from moe_serve.balancer.locality import group_affinity, node_local_balancedness, split_affinity
from moe_serve.balancer.node_placement import align_nodes, plan_node_aware
from moe_serve.balancer.packing import align, improve, lpt, per_gpu_cap
from moe_serve.balancer.placement import balancedness, build_log2phy, gpu_loads, replica_counts

_MOVE_BUDGET = 0.25  # of a layer's slots; a repair reloading more settles for EPLB's balance
_PARTIAL_SHARES = (0.875, 0.75, 0.625, 0.5, 0.25)  # shares of redundant replicas placed by EPLB's rule


def rebalance_experts(weight: torch.Tensor, num_replicas: int, num_groups: int, num_nodes: int, num_gpus: int,
                      *, previous: torch.Tensor | None = None, tolerance: float = 0.01,
                      coactivation: torch.Tensor | None = None, topk: int = 8, topk_group: int | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Plan the placement of experts on `num_replicas` slots over `num_gpus` GPUs on `num_nodes` nodes.

    weight:     [L, E] load of each logical expert (e.g. tokens routed to it in the last window)
    num_groups: the model's expert groups (E // num_groups consecutive experts each); with more than one
                node and no `coactivation`, experts of a group count as often chosen together
    num_nodes:  above 1, the plan keeps experts chosen together on one node and spreads replicas over
                nodes (balancer/node_placement.py) at a balancedness no worse than EPLB's global policy
                minus `tolerance`, measured under the node-local rule (balancer/locality.py)
    previous:   [L, R] the phy2log in service; its experts stay in their slots unless moving them buys
                balance (or, across nodes, locality)
    tolerance:  with `previous`, a layer moves no more slots once its balancedness is within this of
                a fresh plan's
    coactivation: [L, E, E] tokens that chose both experts (balancer.locality.coactivation), optional
    topk, topk_group: how the model routes (experts per token; groups a token may use, default half of them),
                for the cross-node estimate that picks among node-aware candidates

    Returns phy2log [L, R] (slot p is on GPU p // (R // num_gpus), GPU g on node g // (num_gpus // num_nodes)),
    log2phy [L, E, X] padded with -1, logcnt [L, E].
    """
    weight_LE = _check_args(weight, num_replicas, num_groups, num_nodes, num_gpus, previous)
    prev_LR = None if previous is None else previous.detach().long().cpu()
    with _one_thread():  # many small ops: extra threads only add overhead (and stall on a busy host)
        packed_KLR, top_KL = _pack_candidates(weight_LE, num_replicas, num_gpus, prev_LR)
        fresh_LR = _search(packed_KLR[top_KL.argmin(0), torch.arange(len(weight_LE))], weight_LE, num_gpus)
        if num_nodes > 1:
            phy2log_LR = _plan_nodes(weight_LE, fresh_LR, top_KL, num_groups, num_nodes, num_gpus, prev_LR,
                                     tolerance, coactivation, topk, topk_group)
        elif prev_LR is None:
            phy2log_LR = fresh_LR
        else:
            phy2log_LR = _replan_from(prev_LR, weight_LE, fresh_LR, packed_KLR, top_KL, num_gpus, tolerance)
    log2phy_LEX, logcnt_LE = build_log2phy(phy2log_LR, weight_LE.shape[1])
    return phy2log_LR, log2phy_LEX, logcnt_LE


def _plan_nodes(weight_LE, fresh_LR, top_KL, num_groups, num_nodes, num_gpus, prev_LR, tolerance, coactivation,
                topk, topk_group):
    """The node-aware plan (fresh, or from prev_LR: a layer keeps its placement while that meets the balance
    target and splits no more affinity than the fresh plan plus `tolerance` of it)."""
    num_layers, num_logical = weight_LE.shape
    if coactivation is not None:
        if coactivation.shape != (num_layers, num_logical, num_logical):
            raise ValueError(f"coactivation must be [{num_layers}, {num_logical}, {num_logical}], "
                             f"got {tuple(coactivation.shape)}")
        affinity_LEE = coactivation.detach().cpu().double()
    else:
        affinity_LEE = group_affinity(weight_LE, num_groups)
    eplb_global_L = weight_LE.sum(1) / num_gpus / top_KL[min(1, len(top_KL) - 1)].clamp(min=1e-300)
    target_L = torch.where(weight_LE.sum(1) > 0, eplb_global_L - tolerance, 0.0)
    plan_LR = plan_node_aware(weight_LE, replica_counts(fresh_LR, num_logical), affinity_LEE, num_groups, num_nodes,
                              num_gpus, target_L, fresh_LR, topk, topk_group)
    if prev_LR is None:
        return plan_LR
    keep_L = node_local_balancedness(weight_LE, prev_LR, num_gpus, num_nodes) >= target_L
    split_prev_L = split_affinity(prev_LR, affinity_LEE, num_gpus, num_nodes)
    split_plan_L = split_affinity(plan_LR, affinity_LEE, num_gpus, num_nodes)
    keep_L &= split_prev_L <= split_plan_L * (1 + tolerance) + 1e-12
    aligned_LR = align_nodes(plan_LR, prev_LR, num_nodes, num_gpus, num_logical)
    return torch.where(keep_L.unsqueeze(1), prev_LR, aligned_LR)


@contextlib.contextmanager
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _check_args(weight, num_replicas, num_groups, num_nodes, num_gpus, previous) -> torch.Tensor:
    if weight.dim() != 2:
        raise ValueError(f"weight must be [layers, experts], got shape {tuple(weight.shape)}")
    num_layers, num_logical = weight.shape
    if num_replicas < num_logical:
        raise ValueError(f"{num_replicas} slots cannot hold {num_logical} experts: need num_replicas >= experts")
    if num_gpus <= 0 or num_replicas % num_gpus:
        raise ValueError(f"num_gpus {num_gpus} does not divide {num_replicas} slots")
    if num_nodes <= 0 or num_gpus % num_nodes:
        raise ValueError(f"num_nodes {num_nodes} does not divide {num_gpus} GPUs")
    if num_groups <= 0:
        raise ValueError(f"num_groups must be positive, got {num_groups}")
    weight_LE = weight.detach().cpu().double()
    if not torch.isfinite(weight_LE).all() or (weight_LE < 0).any():
        raise ValueError("weight must be finite and non-negative (a load per expert)")
    if previous is not None:
        if previous.shape != (num_layers, num_replicas):
            raise ValueError(f"previous must be the current phy2log [{num_layers}, {num_replicas}], "
                             f"got {tuple(previous.shape)}")
        if ((previous < 0) | (previous >= num_logical)).any():
            raise ValueError(f"previous holds ids outside [0, {num_logical}); pass the current phy2log")
        if (replica_counts(previous.long().cpu(), num_logical) == 0).any():
            raise ValueError("previous leaves some expert without a slot; pass a valid phy2log (or None)")
    return weight_LE


def _pack_candidates(weight_LE: torch.Tensor, num_replicas: int, num_gpus: int, prev_LR: torch.Tensor | None
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed_KLR, top_KL): each candidate choice of redundant replicas packed by LPT, and its max GPU load.

    Candidate 1 is exactly EPLB's global policy, so the best per layer is at least as balanced as that.
    With prev_LR, one more candidate keeps the previous replica counts.
    """
    num_layers, num_logical = weight_LE.shape
    extra_KLN, avoid_K = _redundant_candidates(weight_LE, num_replicas)
    if prev_LR is not None and num_replicas > num_logical:
        prev_extra_LN = _replica_list(replica_counts(prev_LR, num_logical) - 1)
        extra_KLN = torch.cat([extra_KLN, prev_extra_LN.unsqueeze(0)])
        avoid_K = torch.cat([avoid_K, torch.tensor([True])])
    num_cand = extra_KLN.shape[0]
    weight_BE = weight_LE.repeat(num_cand, 1)  # B = K * L rows, candidate-major
    plans_BR = _pack(weight_BE, extra_KLN.flatten(0, 1), num_gpus, avoid_K.repeat_interleave(num_layers))
    top_KL = gpu_loads(weight_BE, plans_BR, num_gpus).amax(1).view(num_cand, num_layers)
    return plans_BR.view(num_cand, num_layers, num_replicas), top_KL


def _redundant_candidates(weight_LE: torch.Tensor, num_replicas: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(extra_KLN, avoid_doubles_K): K candidate lists of the N = R - E redundant replicas' experts.

    EPLB's rule (each extra replica to the expert with the most load per replica) minimises the largest
    replica, but on skewed loads it can make more mid-sized replicas than there are GPUs, and two of
    them on one GPU cap the balance. So candidates give only a share f of the redundant replicas by that
    rule and the rest to the lightest experts (small items that fill gaps). Candidates 0 and 1 use f = 1;
    candidate 1 packs like EPLB (no preference for spreading an expert's replicas over GPUs).
    """
    num_layers, num_logical = weight_LE.shape
    num_extra = num_replicas - num_logical
    if num_extra == 0:
        return torch.empty(1, num_layers, 0, dtype=torch.int64), torch.tensor([True])
    greedy_LN = _greedy_replicas(weight_LE, num_extra)
    lightest_LN = weight_LE.argsort(dim=1, stable=True).repeat(1, -(-num_extra // num_logical))[:, :num_extra]
    shares = (1.0, 1.0) + _PARTIAL_SHARES
    extra_KLN = torch.stack([torch.cat([greedy_LN[:, :round(f * num_extra)],
                                        lightest_LN[:, :num_extra - round(f * num_extra)]], dim=1) for f in shares])
    avoid_K = torch.ones(len(shares), dtype=torch.bool)
    avoid_K[1] = False
    return extra_KLN, avoid_K


def _greedy_replicas(weight_LE: torch.Tensor, num_extra: int) -> torch.Tensor:
    """extra_LN: EPLB's picks, in order: each extra replica to the expert with the most load per replica.

    Computed in float32 like EPLB so that ties break the same way.
    """
    num_layers, num_logical = weight_LE.shape
    weight_f32_LE = weight_LE.float()
    counts_LE = torch.ones(num_layers, num_logical, dtype=torch.int64)
    layers_L = torch.arange(num_layers)
    picks_LN = torch.empty(num_layers, num_extra, dtype=torch.int64)
    for k in range(num_extra):
        picks_LN[:, k] = (weight_f32_LE / counts_LE).max(dim=-1).indices
        counts_LE[layers_L, picks_LN[:, k]] += 1
    return picks_LN


def _pack(weight_BE: torch.Tensor, extra_BN: torch.Tensor, num_gpus: int, avoid_doubles_B: torch.Tensor
          ) -> torch.Tensor:
    """phy2log_BR: replicas heaviest first onto the least-loaded GPU with a free slot (LPT), per row.

    Replicas are experts 0..E-1 then extra_BN, ordered by load per replica (stable), in float32: with
    EPLB's picks and no avoidance this is exactly EPLB's global packing. Where avoid_doubles_B, a GPU
    already holding its cap of the expert is taken only if no other GPU has a free slot.
    """
    num_rows, num_logical = weight_BE.shape
    expert_BN = torch.cat([torch.arange(num_logical).expand(num_rows, -1), extra_BN], dim=1)
    counts_BE = replica_counts(expert_BN, num_logical)
    load_BN = (weight_BE.float() / counts_BE).gather(1, expert_BN)
    order_BN = load_BN.argsort(dim=1, descending=True, stable=True)
    expert_BN, load_BN = expert_BN.gather(1, order_BN), load_BN.gather(1, order_BN)
    cap_BN = per_gpu_cap(counts_BE, num_gpus).gather(1, expert_BN)
    # Above any load, so a capped GPU is taken only if every free GPU is capped; 0 where not avoiding.
    above_B1 = (2 * weight_BE.sum(1, keepdim=True).float() + 1).clamp(max=1e38)
    penalty_B1 = torch.where(avoid_doubles_B.unsqueeze(1), above_B1, 0.0)
    return lpt(expert_BN, load_BN, cap_BN, penalty_B1, num_logical, num_gpus)


def _replica_list(counts_LE: torch.Tensor) -> torch.Tensor:
    """expert_LN: each expert id repeated counts[e] times, per layer (every layer has the same total N)."""
    num_layers, num_logical = counts_LE.shape
    flat = torch.repeat_interleave(torch.arange(num_logical).repeat(num_layers), counts_LE.flatten())
    return flat.view(num_layers, -1)


def _replan_from(prev_LR: torch.Tensor, weight_LE: torch.Tensor, fresh_LR: torch.Tensor, packed_KLR: torch.Tensor,
                 top_KL: torch.Tensor, num_gpus: int, tolerance: float) -> torch.Tensor:
    """phy2log_LR close to prev_LR, each layer aiming at balancedness within `tolerance` of fresh_LR's.

    A layer whose previous plan reaches that target keeps it. Otherwise it takes the cheapest (fewest
    slots changed) of these repairs that reaches it:
    1. the previous plan after local search (stopping at the target, preferring moves that reload less);
    2. the previous plan turned to the replica counts of the packed candidate nearest the previous
       counts among those within `tolerance` of the best packing, then local search;
    3. the same with the fresh plan's replica counts;
    4. the fresh plan, its GPUs and slots matched to the previous plan's to keep what overlap it has
       (it reaches the target by definition).
    If that reloads more than _MOVE_BUDGET of the layer's slots, the layer settles for the balancedness
    of EPLB's global policy (packed candidate 1) when that is lower and cheaper to reach.
    """
    num_layers, num_slots = prev_LR.shape
    num_logical = weight_LE.shape[1]
    target_L = balancedness(weight_LE, fresh_LR, num_gpus) - tolerance
    plan_LR = prev_LR.clone()
    todo = (balancedness(weight_LE, prev_LR, num_gpus) < target_L).nonzero().flatten()  # the T layers to repair
    if len(todo) == 0:
        return plan_LR
    counts_KLE = torch.stack([replica_counts(packed_LR, num_logical) for packed_LR in packed_KLR])
    distance_KL = (counts_KLE - replica_counts(prev_LR, num_logical)).abs().sum(2).double()
    near_L = distance_KL.masked_fill(top_KL > top_KL.amin(0) * (1 + tolerance), float("inf")).argmin(0)
    prev_TR, weight_TE, target_T = prev_LR[todo], weight_LE[todo], target_L[todo]
    starts_KTR = torch.stack([prev_TR, _recount(prev_TR, weight_TE, counts_KLE[near_L[todo], todo], num_gpus),
                              _recount(prev_TR, weight_TE, replica_counts(fresh_LR[todo], num_logical), num_gpus)])
    aligned_TR = align(fresh_LR[todo], prev_TR, num_gpus, num_logical)
    # The lower target (EPLB's global balance) is searched in the same batch, for the U layers it is lower.
    eplb_L = weight_LE.sum(1) / num_gpus / top_KL[min(1, len(top_KL) - 1)].clamp(min=1e-300)
    floor_T = torch.minimum(target_T, eplb_L[todo])
    lower_U = (floor_T < target_T).nonzero().flatten()
    layer_of = torch.cat([torch.arange(len(todo)), lower_U])
    searched_KXR = _search_starts(torch.cat([starts_KTR, starts_KTR[:, lower_U]], dim=1), weight_TE[layer_of],
                                  prev_TR[layer_of], torch.cat([target_T, floor_T[lower_U]]), num_gpus)
    repaired_TR, cost_T = _cheapest(searched_KXR[:, :len(todo)], aligned_TR, weight_TE, prev_TR, target_T, num_gpus)
    settled_UR, settled_cost_U = _cheapest(searched_KXR[:, len(todo):], aligned_TR[lower_U], weight_TE[lower_U],
                                           prev_TR[lower_U], floor_T[lower_U], num_gpus)
    settle_U = (cost_T[lower_U] > _MOVE_BUDGET * num_slots) & (settled_cost_U < cost_T[lower_U])
    repaired_TR[lower_U[settle_U]] = settled_UR[settle_U]
    plan_LR[todo] = repaired_TR
    return plan_LR


def _search_starts(starts_KXR: torch.Tensor, weight_XE: torch.Tensor, prev_XR: torch.Tensor, target_X: torch.Tensor,
                   num_gpus: int) -> torch.Tensor:
    """searched_KXR: local search from each start toward target_X, preferring moves that differ less from
    prev_XR. A start equal to an earlier one of its row would search to the same plan, so it is skipped
    and left as it is."""
    num_starts, num_rows, _ = starts_KXR.shape
    run_KX = torch.ones(num_starts, num_rows, dtype=torch.bool)
    for k in range(1, num_starts):
        run_KX[k] = ~(starts_KXR[:k] == starts_KXR[k]).all(2).any(0)
    row_of = run_KX.nonzero(as_tuple=True)[1]
    searched_KXR = starts_KXR.clone()
    searched_KXR[run_KX] = _search(starts_KXR[run_KX], weight_XE[row_of], num_gpus, target_X[row_of], prev_XR[row_of])
    return searched_KXR


def _cheapest(plans_KXR: torch.Tensor, fallback_XR: torch.Tensor, weight_XE: torch.Tensor, prev_XR: torch.Tensor,
              target_X: torch.Tensor, num_gpus: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(plan_XR, cost_X): per row, the plan reaching target_X with the fewest slots differing from prev_XR;
    fallback_XR (assumed to reach the target) where none does."""
    plans_KXR = torch.cat([plans_KXR, fallback_XR.unsqueeze(0)])
    num_plans, num_rows, num_slots = plans_KXR.shape
    balance_KX = balancedness(weight_XE.repeat(num_plans, 1), plans_KXR.flatten(0, 1), num_gpus).view(num_plans, -1)
    reach_KX = balance_KX >= target_X
    reach_KX[-1] = True
    cost_KX = (plans_KXR != prev_XR).sum(2).masked_fill(~reach_KX, num_slots + 1)
    cost_X, best_X = cost_KX.min(0)
    return plans_KXR[best_X, torch.arange(num_rows)], cost_X


def _search(phy2log_LR: torch.Tensor, weight_LE: torch.Tensor, num_gpus: int, target_L: torch.Tensor | None = None,
            reference_LR: torch.Tensor | None = None) -> torch.Tensor:
    """improve keeping each expert's replicas on distinct GPUs, then allowing doubles where that helps."""
    phy2log_LR = improve(phy2log_LR, weight_LE, num_gpus, target_L, reference_LR=reference_LR)
    return improve(phy2log_LR, weight_LE, num_gpus, target_L, allow_doubles=True, reference_LR=reference_LR)


def _recount(prev_LR: torch.Tensor, weight_LE: torch.Tensor, counts_LE: torch.Tensor, num_gpus: int) -> torch.Tensor:
    """The previous plan turned to the new replica counts, touching only the slots whose count changed.

    An expert with surplus replicas gives up those on the GPUs busiest under the new load; the freed
    slots take the new replicas, heaviest first onto the least-loaded GPU with a freed slot.
    """
    num_layers, num_slots = prev_LR.shape
    num_logical = weight_LE.shape[1]
    slots_per_gpu = num_slots // num_gpus
    prev_counts_LE = replica_counts(prev_LR, num_logical)
    surplus_LE = (prev_counts_LE - counts_LE).clamp(min=0)
    deficit_LE = (counts_LE - prev_counts_LE).clamp(min=0)
    gpu_of_R = torch.arange(num_slots) // slots_per_gpu
    # Rank each slot among its expert's slots, busiest GPU first; free the first `surplus` of them.
    gpu_load_LR = gpu_loads(weight_LE, prev_LR, num_gpus)[:, gpu_of_R]
    by_load_LR = gpu_load_LR.argsort(dim=1, descending=True, stable=True)
    order_LR = by_load_LR.gather(1, prev_LR.gather(1, by_load_LR).argsort(dim=1, stable=True))
    expert_sorted_LR = prev_LR.gather(1, order_LR)
    run_start_LE = prev_counts_LE.cumsum(1) - prev_counts_LE
    rank_LR = torch.arange(num_slots) - run_start_LE.gather(1, expert_sorted_LR)
    free_LR = torch.zeros(num_layers, num_slots, dtype=torch.bool)
    free_LR.scatter_(1, order_LR, rank_LR < surplus_LE.gather(1, expert_sorted_LR))

    plan_LR = prev_LR.clone()
    num_new = int(deficit_LE.sum(1).max())
    if num_new == 0:
        return plan_LR
    # New replicas per layer, heaviest first, padded with expert -1.
    per_replica_LE = weight_LE / counts_LE
    new_expert_LN = torch.full((num_layers, num_new), -1, dtype=torch.int64)
    new_load_LN = torch.full((num_layers, num_new), -1.0, dtype=torch.float64)
    for layer in range(num_layers):  # ragged lists; L is small
        experts = torch.repeat_interleave(torch.arange(num_logical), deficit_LE[layer])
        loads = per_replica_LE[layer, experts]
        order = loads.argsort(descending=True, stable=True)
        new_expert_LN[layer, :len(experts)] = experts[order]
        new_load_LN[layer, :len(experts)] = loads[order]

    kept_load_LR = per_replica_LE.gather(1, prev_LR).masked_fill(free_LR, 0.0)
    gpu_load_LG = kept_load_LR.view(num_layers, num_gpus, slots_per_gpu).sum(2)
    free_LGS = free_LR.view(num_layers, num_gpus, slots_per_gpu).clone()
    held_LGE = torch.zeros(num_layers, num_gpus, num_logical, dtype=torch.int16)
    held_LGE.scatter_add_(2, prev_LR.view(num_layers, num_gpus, slots_per_gpu), (~free_LGS).short())
    cap_LE = per_gpu_cap(counts_LE, num_gpus)
    penalty_L1 = weight_LE.sum(1, keepdim=True) + 1.0
    layers_L = torch.arange(num_layers)
    for k in range(num_new):
        expert_L = new_expert_LN[:, k]
        lay = layers_L[expert_L >= 0]
        expert = expert_L[lay]
        held_G = held_LGE[lay, :, expert] >= cap_LE[lay, expert].unsqueeze(1)
        score = gpu_load_LG[lay] + penalty_L1[lay] * held_G
        gpu = score.masked_fill(~free_LGS[lay].any(2), float("inf")).argmin(1)
        slot = free_LGS[lay, gpu].long().argmax(1)  # first freed slot on that GPU
        plan_LR[lay, gpu * slots_per_gpu + slot] = expert
        free_LGS[lay, gpu, slot] = False
        gpu_load_LG[lay, gpu] += new_load_LN[lay, k]
        held_LGE[lay, gpu, expert] += 1
    return plan_LR
