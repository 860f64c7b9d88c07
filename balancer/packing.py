"""Packing replicas onto GPUs and the local search that improves a packing: the building blocks of the
planners in balancer/eplb.py (global) and balancer/node_placement.py (node by node).

Shape legend (see balancer/placement.py): L layers (or rows), E logical experts, R slots, G GPUs,
S = R // G slots per GPU, N items, n rows still searching, C swap partner slots. Pure functions on CPU tensors.
"""

import torch

from moe_serve.balancer.placement import replica_counts

_MIN_GAIN = 1e-9  # a move must lower the hot GPU's load by this fraction
_PARTNER_GPUS = 16  # with a target, swap partners are slots on this many least-loaded GPUs


def per_gpu_cap(counts_LE: torch.Tensor, num_gpus: int) -> torch.Tensor:
    """Most replicas of one expert a GPU should hold: 1 unless the expert has more replicas than GPUs."""
    return (counts_LE + num_gpus - 1) // num_gpus


def lpt(expert_BN: torch.Tensor, load_BN: torch.Tensor, cap_BN: torch.Tensor, penalty_B1: torch.Tensor,
         num_logical: int, num_gpus: int) -> torch.Tensor:
    """phy2log_BR: items (replicas, heaviest first) in order onto the least-loaded GPU with a free slot; a GPU
    holding cap_BN replicas of the item's expert costs penalty_B1 more."""
    num_rows, num_slots = expert_BN.shape
    slots_per_gpu = num_slots // num_gpus
    rows_B = torch.arange(num_rows)
    one_B = torch.ones(num_rows, dtype=torch.int16)
    gpu_load_BG = torch.zeros(num_rows, num_gpus, dtype=torch.float32)
    filled_BG = torch.zeros(num_rows, num_gpus, dtype=torch.int64)
    full_BG = torch.zeros(num_rows, num_gpus, dtype=torch.bool)
    held_BEG = torch.zeros(num_rows, num_logical, num_gpus, dtype=torch.int16)  # replicas of e on GPU g
    phy2log_BR = torch.empty(num_rows, num_slots, dtype=torch.int64)
    for k in range(num_slots):
        expert_B = expert_BN[:, k]
        score_BG = gpu_load_BG + penalty_B1 * (held_BEG[rows_B, expert_B] >= cap_BN[:, k:k + 1])
        gpu_B = score_BG.masked_fill_(full_BG, float("inf")).argmin(1)
        filled_B = filled_BG[rows_B, gpu_B]
        phy2log_BR[rows_B, gpu_B * slots_per_gpu + filled_B] = expert_B
        gpu_load_BG.index_put_((rows_B, gpu_B), load_BN[:, k], accumulate=True)
        filled_BG[rows_B, gpu_B] = filled_B + 1
        full_BG[rows_B, gpu_B] = filled_B + 1 == slots_per_gpu
        held_BEG.index_put_((rows_B, expert_B, gpu_B), one_B, accumulate=True)
    return phy2log_BR


def improve(phy2log_LR: torch.Tensor, weight_LE: torch.Tensor, num_gpus: int, target_L: torch.Tensor | None = None,
             allow_doubles: bool = False, reference_LR: torch.Tensor | None = None, recounts: bool = True
             ) -> torch.Tensor:
    """Local search on the most-loaded ("hot") GPU of each layer; returns a new phy2log_LR.

    Two moves; each step takes, per layer, the one that leaves the GPUs it changes least loaded, and
    only if they all end below the hot GPU's old load (so the sorted GPU loads fall and the search ends):
      swap:    a slot of the hot GPU trades experts with a lighter slot elsewhere (reloads 2 slots);
      recount: a slot of the hot GPU holding a replicated expert A switches to the expert B whose extra
               replica is lightest; A's other replicas grow, B's shrink (reloads 1 slot).
    A layer stops when no move helps, or once its balancedness reaches target_L (with `previous`, where
    moves cost reloads: swap partners then come from the least-loaded GPUs only). With reference_LR (the
    plan in service), a step prefers, among moves that bring the GPUs they change down to the target's
    max load, the one adding the fewest slots that differ from the reference. Unless allow_doubles, no
    move gives a GPU more replicas of an expert than its cap. Without `recounts` only swaps run (replica
    counts stay; weight_LE may then be 0 for experts a row does not hold).
    """
    out_LR = phy2log_LR.clone()
    num_layers, num_slots = out_LR.shape
    num_logical = weight_LE.shape[1]
    slots_per_gpu = num_slots // num_gpus
    if num_gpus == 1:
        return out_LR
    num_partners = num_gpus if target_L is None else min(num_gpus, _PARTNER_GPUS)
    own_S = torch.arange(slots_per_gpu)
    inf = float("inf")
    # State of the n layers still searching; a layer with no helpful move is done for good and leaves.
    rows_N, phy2log_NR, weight_NE = torch.arange(num_layers), out_LR.clone(), weight_LE
    counts_NE = replica_counts(phy2log_NR, num_logical)
    held_NGE = torch.zeros(num_layers, num_gpus, num_logical, dtype=torch.int16)
    held_NGE.scatter_add_(2, phy2log_NR.view(num_layers, num_gpus, slots_per_gpu),
                          torch.ones(num_layers, num_gpus, slots_per_gpu, dtype=torch.int16))
    active_N = torch.ones(num_layers, dtype=torch.bool)
    target_N = target_L
    ref_NR = reference_LR if target_L is not None else None
    while len(rows_N):
        n = len(rows_N)
        rows = torch.arange(n)
        slot_load_NR = (weight_NE / counts_NE).gather(1, phy2log_NR)
        gpu_load_NG = slot_load_NR.view(n, num_gpus, slots_per_gpu).sum(2)
        top_N, hot_N = gpu_load_NG.max(1)
        want_N = active_N & (top_N > 0)
        if target_N is not None:
            want_N &= gpu_load_NG.mean(1) < target_N * top_N
        pos_NS = hot_N.unsqueeze(1) * slots_per_gpu + own_S
        expert_a_NS = phy2log_NR.gather(1, pos_NS)
        load_a_NS = slot_load_NR.gather(1, pos_NS)
        held_a_NSG = held_NGE.gather(2, expert_a_NS.unsqueeze(1).expand(-1, num_gpus, -1)).transpose(1, 2)
        held_hot_NE = held_NGE[rows, hot_N]
        hot_NS1 = hot_N.view(-1, 1, 1).expand(-1, slots_per_gpu, 1)

        # Swap slot a (hot GPU) with slot b on one of the partner GPUs j (C candidate slots):
        # load d = a - b moves from the hot GPU to j.
        partner_NM = gpu_load_NG.topk(num_partners, dim=1, largest=False).indices
        slot_b_NC = (partner_NM.unsqueeze(2) * slots_per_gpu + own_S).flatten(1)
        gpu_b_NC = slot_b_NC // slots_per_gpu
        expert_b_NC = phy2log_NR.gather(1, slot_b_NC)
        delta_NSC = load_a_NS.unsqueeze(2) - slot_load_NR.gather(1, slot_b_NC).unsqueeze(1)
        swap_NSC = torch.maximum(top_N.view(-1, 1, 1) - delta_NSC,
                                 gpu_load_NG.gather(1, gpu_b_NC).unsqueeze(1) + delta_NSC)
        bad_NSC = (delta_NSC <= 0) | (gpu_b_NC == hot_N.unsqueeze(1)).unsqueeze(1)
        if not allow_doubles:  # b's expert must have room on the hot GPU, a's expert on GPU j
            cap_NE = per_gpu_cap(counts_NE, num_gpus)
            full_b_NC = held_hot_NE.gather(1, expert_b_NC) >= cap_NE.gather(1, expert_b_NC)
            full_a_NSG = held_a_NSG >= cap_NE.gather(1, expert_a_NS).unsqueeze(2)
            bad_NSC |= full_a_NSG.gather(2, gpu_b_NC.unsqueeze(1).expand(-1, slots_per_gpu, -1))
            bad_NSC |= full_b_NC.unsqueeze(1)
        swap_NSC = swap_NSC.masked_fill(bad_NSC, inf)

        # Recount slot a from expert A to B, the expert whose next replica is lightest and fits on the hot GPU.
        next_NE = weight_NE / (counts_NE + 1)
        if not allow_doubles:
            next_NE = next_NE.masked_fill(held_hot_NE >= per_gpu_cap(counts_NE + 1, num_gpus), inf)
        next2_N2, b2_N2 = next_NE.topk(min(2, num_logical), dim=1, largest=False)
        second_NS = (b2_N2[:, :1] == expert_a_NS) & (num_logical > 1)
        b_NS = torch.where(second_NS, b2_N2[:, -1:], b2_N2[:, :1])
        b_load_NS = torch.where(second_NS, next2_N2[:, -1:], next2_N2[:, :1])
        count_a_NS = counts_NE.gather(1, expert_a_NS)
        grow_NS = weight_NE.gather(1, expert_a_NS) / (count_a_NS - 1).clamp(min=1) - load_a_NS
        others_NSG = torch.where(held_a_NSG > 0, gpu_load_NG.unsqueeze(1) + grow_NS.unsqueeze(2) * held_a_NSG, -inf)
        others_NSG.scatter_(2, hot_NS1, -inf)
        held_a_hot_NS = held_a_NSG.gather(2, hot_NS1).squeeze(2)
        hot_after_NS = top_N.unsqueeze(1) - load_a_NS + b_load_NS + grow_NS * (held_a_hot_NS - 1)
        recount_NS = torch.maximum(hot_after_NS, others_NSG.amax(2)).masked_fill(count_a_NS < (2 if recounts else 1 << 62), inf)

        # Choose: the lowest max load over the changed GPUs; with a reference, fewest new reloads first.
        swap_key_NSC, recount_key_NS = swap_NSC, recount_NS
        if ref_NR is not None:
            ref_a_NS, ref_b_NC = ref_NR.gather(1, pos_NS), ref_NR.gather(1, slot_b_NC)
            was_a_NS = (expert_a_NS != ref_a_NS).long()
            swap_cost_NSC = ((expert_b_NC.unsqueeze(1) != ref_a_NS.unsqueeze(2)).long()
                             + (expert_a_NS.unsqueeze(2) != ref_b_NC.unsqueeze(1)).long()
                             - was_a_NS.unsqueeze(2) - (expert_b_NC != ref_b_NC).long().unsqueeze(1))
            limit_N1 = (gpu_load_NG.mean(1) / target_N).unsqueeze(1)
            swap_key_NSC = move_key(swap_NSC, swap_cost_NSC, limit_N1.unsqueeze(2), top_N.view(-1, 1, 1))
            recount_key_NS = move_key(recount_NS, (b_NS != ref_a_NS).long() - was_a_NS, limit_N1, top_N.view(-1, 1))
        swap_key_N, swap_at_N = swap_key_NSC.flatten(1).min(1)
        recount_key_N, recount_at_N = recount_key_NS.min(1)
        use_swap_N = swap_key_N <= recount_key_N
        best_N = torch.where(use_swap_N, swap_NSC.flatten(1).gather(1, swap_at_N.unsqueeze(1)).squeeze(1),
                             recount_NS.gather(1, recount_at_N.unsqueeze(1)).squeeze(1))
        do_N = want_N & (best_N < top_N * (1 - _MIN_GAIN))
        swap, recount = do_N & use_swap_N, do_N & ~use_swap_N
        if swap.any():
            row, at = rows[swap], swap_at_N[swap]
            pa = pos_NS[row, at // slot_b_NC.shape[1]]
            pb = slot_b_NC[row, at % slot_b_NC.shape[1]]
            ea, eb = phy2log_NR[row, pa], phy2log_NR[row, pb]
            hot, gj = hot_N[row], pb // slots_per_gpu
            phy2log_NR[row, pa], phy2log_NR[row, pb] = eb, ea
            held_NGE[row, hot, ea] -= 1
            held_NGE[row, hot, eb] += 1
            held_NGE[row, gj, eb] -= 1
            held_NGE[row, gj, ea] += 1
        if recount.any():
            row, at = rows[recount], recount_at_N[recount]
            pa, ea, eb = pos_NS[row, at], expert_a_NS[row, at], b_NS[row, at]
            phy2log_NR[row, pa] = eb
            held_NGE[row, hot_N[row], ea] -= 1
            held_NGE[row, hot_N[row], eb] += 1
            counts_NE[row, ea] -= 1
            counts_NE[row, eb] += 1
        active_N = do_N
        if active_N.sum() < 0.75 * n:  # write back finished layers, keep the rest (not every step: copies)
            out_LR[rows_N[~active_N]] = phy2log_NR[~active_N]
            rows_N, phy2log_NR, weight_NE = rows_N[active_N], phy2log_NR[active_N], weight_NE[active_N]
            counts_NE, held_NGE = counts_NE[active_N], held_NGE[active_N]
            target_N = None if target_N is None else target_N[active_N]
            ref_NR = None if ref_NR is None else ref_NR[active_N]
            active_N = active_N[active_N]
    return out_LR


def move_key(max_load: torch.Tensor, cost: torch.Tensor, limit: torch.Tensor, top: torch.Tensor) -> torch.Tensor:
    """Sort key for moves: those reaching `limit` first, by reload cost (-2..2), then by max load."""
    return max_load / top + torch.where(max_load <= limit, 2.0 * (cost + 2), 20.0)


def match_blocks(plan_LBS: torch.Tensor, prev_LBS: torch.Tensor, num_logical: int) -> torch.Tensor:
    """plan_LBS with its blocks (GPUs, or nodes) renumbered to match prev_LBS's: greedily, the pair of blocks
    sharing the most experts first. Each block keeps its experts, in its order."""
    num_layers, num_blocks, size = plan_LBS.shape

    def held(x_LBS):
        return torch.zeros(num_layers, num_blocks, num_logical).scatter_add_(2, x_LBS, torch.ones(x_LBS.shape))

    overlap_LBB = torch.bmm(held(plan_LBS), held(prev_LBS).transpose(1, 2))  # [L, plan block, prev block]
    layers_L = torch.arange(num_layers)
    target_of_LB = torch.empty(num_layers, num_blocks, dtype=torch.int64)
    for _ in range(num_blocks):
        flat_L = overlap_LBB.flatten(1).argmax(1)
        src_L, dst_L = flat_L // num_blocks, flat_L % num_blocks
        target_of_LB[layers_L, src_L] = dst_L
        overlap_LBB[layers_L, src_L, :] = -1.0
        overlap_LBB[layers_L, :, dst_L] = -1.0
        overlap_LBB[layers_L, src_L, dst_L] = -2.0  # below -1: never picked again
    return torch.empty_like(plan_LBS).scatter_(1, target_of_LB.unsqueeze(2).expand(-1, -1, size), plan_LBS)


def align(plan_LR: torch.Tensor, prev_LR: torch.Tensor, num_gpus: int, num_logical: int) -> torch.Tensor:
    """plan_LR with its GPUs renumbered and each GPU's slots reordered to agree with prev_LR where it can.

    GPUs are matched greedily by how many experts they share; within a matched GPU, an expert both plans
    hold stays in its previous slot. Balance is unchanged (a GPU keeps its set of experts).
    """
    num_layers, num_slots = plan_LR.shape
    slots_per_gpu = num_slots // num_gpus
    plan_LGS = plan_LR.view(num_layers, num_gpus, slots_per_gpu)
    prev_LGS = prev_LR.view(num_layers, num_gpus, slots_per_gpu)
    moved_LGS = match_blocks(plan_LGS, prev_LGS, num_logical)
    # Within each GPU: previous slot s keeps its expert if the new set has it; the rest fill in order.
    out_LGS = torch.full_like(moved_LGS, -1)
    unused_LGS = torch.ones_like(moved_LGS, dtype=torch.bool)
    for s in range(slots_per_gpu):
        match_LGS = unused_LGS & (moved_LGS == prev_LGS[:, :, s:s + 1])
        has_LG = match_LGS.any(2)
        first_LG = match_LGS.long().argmax(2, keepdim=True)
        out_LGS[:, :, s] = torch.where(has_LG, moved_LGS.gather(2, first_LG).squeeze(2), -1)
        unused_LGS.scatter_(2, first_LG, ~has_LG.unsqueeze(2) & unused_LGS.gather(2, first_LG))
    # Leftover experts, in order, into the still-empty slots (both lists have the same length per GPU).
    rest_LGS = moved_LGS.masked_fill(~unused_LGS, -1)
    rest_order = (~unused_LGS).long().argsort(dim=2, stable=True)
    empty_order = (out_LGS != -1).long().argsort(dim=2, stable=True)
    out_LGS.scatter_(2, empty_order, torch.where(out_LGS.gather(2, empty_order) == -1,
                                                 rest_LGS.gather(2, rest_order), out_LGS.gather(2, empty_order)))
    return out_LGS.view(num_layers, num_slots)
