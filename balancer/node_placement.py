"""Node-aware expert placement: keep experts that serve the same tokens on the same node, at a balance no
worse than a target (EPLB's global policy minus a tolerance, see balancer/eplb.py).

Cross-node dispatch is what a token costs in rows to remote nodes (balancer/locality.py). Two things lower
it: experts often chosen together (recorded co-activation, or the model's expert groups under DeepSeek's
group-limited routing) sharing a node, and hot experts with a replica on every node, whose tokens then
never leave their node (the node-local rule); an expert with replicas on only some nodes still sends the
other nodes' tokens away, to any of them. So:
  1. replica counts: the redundant slots go, EPLB's way (most load per replica first), in whole node
     sets: an expert gets N replicas, then N more, never 2..N-1; left-over slots add single replicas to
     experts that already have N. Candidates keep a share of the redundant slots for partial replicas
     by EPLB's plain rule (which balances better on steep loads), down to the balanced global plan's counts;
  2. nodes: an expert with c >= N replicas has c // N on every node (the rest one each on distinct nodes),
     one with c < N has them on c distinct nodes. The single replicas are placed group by group onto the
     node with most affinity under a node load cap that the balance target implies; then, while a node
     is above the cap, the swap of two of them between it and another node that loses the least affinity;
  3. GPUs: each node's replicas packed onto its GPUs (LPT, then swaps).
Each layer keeps the first candidate (most node sets, then the loosest cap) that reaches the balance
target under the node-local rule, or else the best balanced of them and the global plan.

Shape legend: L layers, E experts, R slots, G GPUs, N nodes, P = R // N slots per node, B = L * N rows.
"""

import torch

from moe_serve.balancer.locality import node_counts, node_local_balancedness, replica_loads
from moe_serve.balancer.packing import align, improve, lpt, per_gpu_cap

_NODE_SET_SHARES = (1.0, 0.75, 0.5, 0.25)  # of the redundant slots given in whole node sets, tried in turn
_CAP_MARGINS = (0.0, 0.01, 0.03)  # node load cap: mean node load / (target + margin), tried in turn


def plan_node_aware(weight_LE: torch.Tensor, counts_LE: torch.Tensor, affinity_LEE: torch.Tensor, num_groups: int,
                    num_nodes: int, num_gpus: int, target_L: torch.Tensor, fallback_LR: torch.Tensor) -> torch.Tensor:
    """phy2log_LR with high-affinity experts on common nodes, each layer's node-local balancedness >= target_L
    where a candidate reaches it (else the best balanced of the candidates and fallback_LR, the global plan).
    counts_LE: the global plan's replica counts."""
    num_layers, num_logical = weight_LE.shape
    num_slots = fallback_LR.shape[1]
    plan_LR = fallback_LR.clone()
    best_L = node_local_balancedness(weight_LE, fallback_LR, num_gpus, num_nodes)  # where no plan reaches the target
    todo = torch.arange(num_layers)
    gpu_mean_L = weight_LE.double().sum(1) / num_gpus
    candidates = [node_set_counts(weight_LE, num_slots, num_nodes, share) for share in _NODE_SET_SHARES]
    for cand_LE in candidates + [counts_LE]:
        # a replica heavier than a GPU may carry at the target makes the target unreachable: skip those layers
        feasible_L = (weight_LE.double() / cand_LE).amax(1) <= gpu_mean_L / target_L.clamp(min=1e-9)
        for margin in _CAP_MARGINS:
            rows = todo[feasible_L[todo]]
            if len(rows) == 0:
                break
            count_TEN = torch.stack([_node_counts_layer(weight_LE[l], cand_LE[l], affinity_LEE[l], num_groups,
                                                        num_nodes, num_slots // num_nodes, float(target_L[l]) + margin)
                                     for l in rows.tolist()])
            trial_TR = _pack_nodes(weight_LE[rows], count_TEN, num_gpus)
            balance_T = node_local_balancedness(weight_LE[rows], trial_TR, num_gpus, num_nodes)
            ok_T = balance_T >= target_L[rows]
            better_T = ok_T | (balance_T > best_L[rows])
            plan_LR[rows[better_T]] = trial_TR[better_T]
            best_L[rows[better_T]] = balance_T[better_T]
            todo = todo[~torch.isin(todo, rows[ok_T])]
    return plan_LR


def node_set_counts(weight_LE: torch.Tensor, num_slots: int, num_nodes: int, share: float) -> torch.Tensor:
    """counts_LE (step 1): `share` of the redundant slots in whole node sets, the rest one replica at a time,
    each time to the expert with the most load per replica."""
    num_layers, num_logical = weight_LE.shape
    weight_LE = weight_LE.double()
    counts_LE = torch.ones(num_layers, num_logical, dtype=torch.int64)
    left_L = torch.full((num_layers,), num_slots - num_logical, dtype=torch.int64)
    in_sets = int(share * (num_slots - num_logical))
    layers_L = torch.arange(num_layers)
    while True:  # node sets: N - 1 more slots for an expert with one replica, N for one with N or more
        cost_LE = torch.where(counts_LE == 1, num_nodes - 1, num_nodes)
        spent_L = num_slots - num_logical - left_L
        fits_LE = cost_LE <= (in_sets - spent_L).unsqueeze(1)
        if not fits_LE.any():
            break
        pick_L = (weight_LE / counts_LE).masked_fill(~fits_LE, -1.0).argmax(1)
        go_L = fits_LE.any(1)
        cost_L = cost_LE[layers_L, pick_L]
        counts_LE[layers_L[go_L], pick_L[go_L]] += cost_L[go_L]
        left_L -= torch.where(go_L, cost_L, 0)
    while (left_L > 0).any():  # the rest one at a time (to experts with a node set first, if any)
        full_LE = counts_LE >= num_nodes
        prefer_L1 = full_LE.any(1, keepdim=True) & torch.tensor(share >= 1.0)
        score_LE = (weight_LE / counts_LE).masked_fill(prefer_L1 & ~full_LE, -1.0)
        pick_L = score_LE.argmax(1)
        go_L = left_L > 0
        counts_LE[layers_L[go_L], pick_L[go_L]] += 1
        left_L -= go_L.long()
    return counts_LE


def _node_counts_layer(weight_E: torch.Tensor, counts_E: torch.Tensor, affinity_EE: torch.Tensor, num_groups: int,
                       num_nodes: int, slots_per_node: int, target: float) -> torch.Tensor:
    """count_EN for one layer: how many replicas of each expert each node holds (step 2)."""
    num_logical = weight_E.shape[0]
    weight_E = weight_E.double()
    counts_E = counts_E.long()
    count_EN = (counts_E // num_nodes).unsqueeze(1).repeat(1, num_nodes)
    free_N = slots_per_node - count_EN.sum(0)
    # node load of one of the replicas placed one by one (c < N: w / c; the rest of c >= N moves none)
    item_load_E = torch.where(counts_E < num_nodes, weight_E / counts_E.clamp(min=1), 0.0)
    load_N = torch.full((num_nodes,), float((weight_E * (counts_E >= num_nodes)).sum() / num_nodes),
                        dtype=torch.float64)
    cap = float(weight_E.sum()) / num_nodes / target
    affinity_EE = affinity_EE.double()
    near_EN = affinity_EE @ (count_EN > 0).double()  # affinity of e to what each node holds
    group_E = torch.arange(num_logical) // max(1, num_logical // max(1, num_groups))
    group_load = torch.zeros(int(group_E.max()) + 1, dtype=torch.float64).index_add_(0, group_E, weight_E)
    experts = torch.repeat_interleave(torch.arange(num_logical), counts_E % num_nodes)
    experts = experts[item_load_E[experts].argsort(descending=True, stable=True)]
    experts = experts[group_load[group_E[experts]].argsort(descending=True, stable=True)]  # group by group
    for e in experts.tolist():
        item = float(item_load_E[e])
        open_N = (free_N > 0) & (count_EN[e] == 0)
        if not open_N.any():
            open_N = free_N > 0
        fits_N = open_N & (load_N + item <= cap)
        if fits_N.any():  # most affinity; ties to the least loaded
            score_N = (near_EN[e] - load_N * 1e-12).masked_fill(~fits_N, -float("inf"))
        else:
            score_N = (-load_N).masked_fill(~open_N, -float("inf"))
        n = int(score_N.argmax())
        if count_EN[e, n] == 0:
            near_EN[:, n] += affinity_EE[:, e]
        count_EN[e, n] += 1
        free_N[n] -= 1
        load_N[n] += item
    _repair(count_EN, item_load_E, load_N, near_EN, affinity_EE, cap)
    return count_EN


def _repair(count_EN: torch.Tensor, item_load_E: torch.Tensor, load_N: torch.Tensor, near_EN: torch.Tensor,
            affinity_EE: torch.Tensor, cap: float) -> None:
    """In place: while the busiest node is above `cap`, swap one of its replicas with one of another node,
    choosing among swaps that bring both below cap the one losing the least affinity (else the one leaving
    the lower max). Experts with a replica on every node never move (they carry no node load)."""
    num_nodes = count_EN.shape[1]
    for _ in range(4 * count_EN.shape[0]):
        hot = int(load_N.argmax())
        if load_N[hot] <= cap:
            return
        movable_E = (count_EN > 0).sum(1) < num_nodes
        a_A = ((count_EN[:, hot] > 0) & movable_E & (item_load_E > 0)).nonzero().flatten()
        b_e, b_n = ((count_EN > 0) & movable_E.unsqueeze(1)).nonzero(as_tuple=True)
        keep = b_n != hot
        b_e, b_n = b_e[keep], b_n[keep]
        if len(a_A) == 0 or len(b_e) == 0:
            return
        d_AB = item_load_E[a_A].unsqueeze(1) - item_load_E[b_e].unsqueeze(0)
        new_max_AB = torch.maximum(load_N[hot] - d_AB, load_N[b_n].unsqueeze(0) + d_AB)
        valid_AB = (d_AB > 0) & (new_max_AB < load_N[hot] * (1 - 1e-9))
        valid_AB &= count_EN[a_A][:, b_n] == 0  # a's expert not yet on b's node
        valid_AB &= (count_EN[b_e, hot] == 0).unsqueeze(0)  # b's expert not yet on the hot node
        valid_AB &= a_A.unsqueeze(1) != b_e.unsqueeze(0)
        if not valid_AB.any():
            return
        ab_AB = affinity_EE[a_A][:, b_e]  # a leaves its partners on hot for b's node; b the reverse
        loss_AB = (near_EN[a_A, hot].unsqueeze(1) - near_EN[a_A][:, b_n] - ab_AB
                   + near_EN[b_e, b_n].unsqueeze(0) - near_EN[b_e, hot].unsqueeze(0) - ab_AB)
        reach_AB = valid_AB & (new_max_AB <= cap)
        if reach_AB.any():
            key_AB = loss_AB.masked_fill(~reach_AB, float("inf"))
        else:
            key_AB = new_max_AB.masked_fill(~valid_AB, float("inf"))
        i, k = divmod(int(key_AB.argmin()), len(b_e))
        ea, eb, j = int(a_A[i]), int(b_e[k]), int(b_n[k])
        for e, src, dst in ((ea, hot, j), (eb, j, hot)):
            count_EN[e, src] -= 1
            count_EN[e, dst] += 1
            if count_EN[e, src] == 0:
                near_EN[:, src] -= affinity_EE[:, e]
            if count_EN[e, dst] == 1:
                near_EN[:, dst] += affinity_EE[:, e]
        d = float(d_AB[i, k])
        load_N[hot] -= d
        load_N[j] += d


def _pack_nodes(weight_TE: torch.Tensor, count_TEN: torch.Tensor, num_gpus: int) -> torch.Tensor:
    """phy2log_TR (step 3): each node's replicas packed onto its GPUs (LPT, then swaps), nodes in order."""
    num_rows, num_logical, num_nodes = count_TEN.shape
    per_TEN = replica_loads(weight_TE, count_TEN)
    count_BE = count_TEN.permute(0, 2, 1).reshape(-1, num_logical)  # rows B = (layer, node)
    load_BE = per_TEN.permute(0, 2, 1).reshape(-1, num_logical)
    slots_per_node = int(count_BE[0].sum())
    expert_BP = torch.stack([torch.repeat_interleave(torch.arange(num_logical), c) for c in count_BE])
    load_BP = load_BE.gather(1, expert_BP)
    order_BP = load_BP.argsort(dim=1, descending=True, stable=True)
    expert_BP, load_BP = expert_BP.gather(1, order_BP), load_BP.gather(1, order_BP)
    gpus_per_node = num_gpus // num_nodes
    cap_BP = per_gpu_cap(count_BE, gpus_per_node).gather(1, expert_BP)
    penalty_B1 = 2 * load_BP.sum(1, keepdim=True).float() + 1
    packed_BP = lpt(expert_BP, load_BP.float(), cap_BP, penalty_B1, num_logical, gpus_per_node)
    share_BE = load_BE * count_BE  # the node's share of each expert: improve splits it over the replicas
    packed_BP = improve(packed_BP, share_BE, gpus_per_node, recounts=False)
    packed_BP = improve(packed_BP, share_BE, gpus_per_node, allow_doubles=True, recounts=False)
    return packed_BP.view(num_rows, num_nodes * slots_per_node)


def align_nodes(plan_LR: torch.Tensor, prev_LR: torch.Tensor, num_nodes: int, num_gpus: int, num_logical: int
                ) -> torch.Tensor:
    """plan_LR with its nodes renumbered, then each node's GPUs and slots, to agree with prev_LR where they can
    (greedy by experts shared). Balance and locality are unchanged: a node keeps its GPUs, a GPU its experts."""
    num_layers, num_slots = plan_LR.shape
    per_node = num_slots // num_nodes
    plan_LNP, prev_LNP = plan_LR.view(num_layers, num_nodes, per_node), prev_LR.view(num_layers, num_nodes, per_node)

    def held(x_LNP):
        return torch.zeros(num_layers, num_nodes, num_logical).scatter_add_(2, x_LNP, torch.ones(x_LNP.shape))

    overlap_LNN = torch.bmm(held(plan_LNP), held(prev_LNP).transpose(1, 2))
    layers_L = torch.arange(num_layers)
    target_LN = torch.empty(num_layers, num_nodes, dtype=torch.int64)
    for _ in range(num_nodes):
        flat_L = overlap_LNN.flatten(1).argmax(1)
        src_L, dst_L = flat_L // num_nodes, flat_L % num_nodes
        target_LN[layers_L, src_L] = dst_L
        overlap_LNN[layers_L, src_L, :] = -1.0
        overlap_LNN[layers_L, :, dst_L] = -1.0
        overlap_LNN[layers_L, src_L, dst_L] = -2.0
    moved_LNP = torch.empty_like(plan_LNP).scatter_(1, target_LN.unsqueeze(2).expand(-1, -1, per_node), plan_LNP)
    rows_BP = align(moved_LNP.reshape(-1, per_node), prev_LNP.reshape(-1, per_node), num_gpus // num_nodes,
                     num_logical)
    return rows_BP.view(num_layers, num_slots)
