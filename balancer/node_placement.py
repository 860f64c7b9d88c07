"""Node-aware expert placement: keep experts that serve the same tokens on the same node, at a balance no
worse than a target (EPLB's global policy minus a tolerance, see balancer/eplb.py).

Cross-node dispatch is what a token costs in rows to remote nodes (balancer/locality.py). Two things lower
it: experts often chosen together (recorded co-activation, or the model's expert groups under DeepSeek's
group-limited routing) sharing a node, and hot experts with a replica on every node, whose tokens then
never leave their node (the node-local rule); an expert with replicas on only some nodes still sends the
other nodes' tokens away, to its home node (the node with most of its replicas) or, where it has none, to
any of them. So:
  1. replica counts: the redundant slots go, EPLB's way (to the expert whose busiest replica carries the
     most load), in whole node sets for hot experts: N replicas, then N more; left-over slots add single
     replicas to experts that already have N. Lighter experts take partial replicas (2..N-1 on distinct
     nodes: a finer grain for balance, but the tokens of the other nodes leave theirs). Candidates lower
     the load that makes an expert "hot" from 0 (all node sets) to never, then the global plan's counts;
  2. nodes: an expert with c >= N replicas has c // N on every node (the rest one each on distinct nodes),
     one with c < N has them on c distinct nodes. The single replicas are placed group by group onto the
     node with most affinity under a node load cap that the balance target implies; then, while a node
     is above the cap, the swap of two of them between it and another node that loses the least affinity;
  3. GPUs: each node's replicas packed onto its GPUs (LPT, then swaps, then also moves of a node's spare
     replica to another expert on that node: a hot expert with one node gets a second replica there).
Candidates: the grouped layout (balancer/grouped_layout.py: whole groups on nodes, replicas within a node,
as EPLB's hierarchical policy; the anchor), the same with groups used together on one node, and, where the
anchor misses the target (by up to _COPY_NEAR), the anchor with copies of replicas across nodes (and swaps
where no copy is possible) that bring the node loads under the loosest cap that works, or, where it misses by
a little, with the cheapest swaps (balancer/node_swaps.py); then the replica-count candidates of step 1 with
the loosest node cap that works. Each layer keeps, among the candidates that
reach the balance target under the node-local rule, the one with the fewest cross-node rows per token,
estimated on tokens sampled from its load and routed as the model routes (another candidate must save
_ANCHOR_EDGE rows to replace a grouped layout that reaches the target: smaller savings are sample noise). A layer
that none reaches takes the best balanced of them (or the global plan), then swaps across nodes while they
raise its balance toward the target, and the global plan with whole GPUs traded between nodes competes.
The target holds for the mean over layers: where the layers balance above it together, layers whose grouped
layout fell short of their own target but sends fewer cross-node rows than their plan take it back, while
the mean stays at the target (_spend_slack).

Shape legend: L layers, E experts, R slots, G GPUs, N nodes, P = R // N slots per node, B = L * N rows.
"""

import torch

from moe_serve.balancer.grouped_layout import grouped_counts
from moe_serve.balancer.locality import (node_counts, node_local_balancedness, remote_nodes_per_token, replica_loads,
                                         sample_routed_tokens)
from moe_serve.balancer.node_swaps import regroup_gpus, swap_to_target
from moe_serve.balancer.packing import align, improve, lpt, match_blocks, per_gpu_cap

_SET_ABOVE = (0.0, 1.0, 4.0, float("inf"))  # x mean GPU load: experts this hot grow in node sets
_CAP_MARGINS = (0.0, 0.02)  # node load cap: mean node load / (target + margin), tried in turn
_SAMPLE_TOKENS = 1024  # tokens per layer that estimate a candidate's cross-node rows
_ANCHOR_EDGE = 0.01  # cross-node rows per token another candidate must save to replace a grouped layout
_NEAR = 0.05  # balancedness below the target from which the grouped layout tries swaps across nodes
_COPY_NEAR = 0.15  # ... and copies across nodes (each moves 1/N of an expert's load: far more would not do)
_GROUPED_MARGINS = (0.0, 0.005, 0.01)  # grouped layout's node load cap: mean / (target + margin), in turn


def plan_node_aware(weight_LE: torch.Tensor, counts_LE: torch.Tensor, affinity_LEE: torch.Tensor, num_groups: int,
                    num_nodes: int, num_gpus: int, target_L: torch.Tensor, fallback_LR: torch.Tensor,
                    topk: int = 8, topk_group: int | None = None) -> torch.Tensor:
    """phy2log_LR, per layer the candidate with the fewest estimated cross-node rows per token among those whose
    node-local balancedness reaches target_L (else the best balanced of them and fallback_LR, the global plan).
    counts_LE: the global plan's replica counts. The estimate routes tokens sampled from the load as the model
    routes them (topk experts from the topk_group best of num_groups groups; balancer/locality.py), the same
    sample (fixed seed) for every candidate and on every rank."""
    num_layers, num_logical = weight_LE.shape
    num_slots = fallback_LR.shape[1]
    topk_group = min(topk_group or max(1, num_groups // 2), num_groups)
    topk = min(topk, num_logical if num_groups <= 1 else topk_group * (num_logical // num_groups))
    gen = torch.Generator().manual_seed(0)
    tokens_L = [sample_routed_tokens(w_E, _SAMPLE_TOKENS, topk, num_groups, topk_group, gen) for w_E in weight_LE]
    src_T = torch.arange(_SAMPLE_TOKENS) % num_nodes
    plan_LR = fallback_LR.clone()
    balance_L = node_local_balancedness(weight_LE, fallback_LR, num_gpus, num_nodes)
    met_L = balance_L >= target_L
    remote_L = torch.full((num_layers,), float("inf"), dtype=torch.float64)
    remote_L[met_L] = _remote(tokens_L, src_T, fallback_LR, met_L.nonzero().flatten(), num_gpus, num_nodes)

    def offer(rows: torch.Tensor, trial_TR: torch.Tensor) -> torch.Tensor:
        """Keep each row's trial if it reaches the target with fewer remote rows (or, while no plan of that row
        reaches it, if it balances better). Returns which rows reached the target."""
        bal_T = node_local_balancedness(weight_LE[rows], trial_TR, num_gpus, num_nodes)
        ok_T = bal_T >= target_L[rows]
        rem_T = torch.full((len(rows),), float("inf"), dtype=torch.float64)
        rem_T[ok_T] = _remote(tokens_L, src_T, trial_TR[ok_T], rows[ok_T], num_gpus, num_nodes)
        take_T = torch.where(ok_T, rem_T < remote_L[rows], ~met_L[rows] & (bal_T > balance_L[rows]))
        plan_LR[rows[take_T]] = trial_TR[take_T]
        balance_L[rows[take_T]] = bal_T[take_T]
        remote_L[rows[take_T]] = rem_T[take_T]
        met_L[rows[take_T & ok_T]] = True
        return ok_T

    all_L = torch.arange(num_layers)
    anchor_LR = None
    if num_groups >= num_nodes and num_groups % num_nodes == 0 and num_logical % num_groups == 0:
        # whole groups on nodes, replicas only within a node (EPLB's hierarchical layout), then, where that
        # misses the target, with as few moves across nodes as bring the node loads under a cap. How often two
        # groups serve one token comes from a sample of its own (not the one that judges candidates).
        size = num_logical // num_groups
        together_LGG = [None] * num_layers if num_groups == num_nodes else [
            _used_together(sample_routed_tokens(w_E, _SAMPLE_TOKENS, topk, num_groups, topk_group, gen) // size,
                           num_groups) for w_E in weight_LE]

        def grouped(rows: torch.Tensor, margin: float | None, move: bool = True) -> torch.Tensor:
            caps = [float("inf")] * len(rows) if margin is None else (
                weight_LE[rows].double().sum(1) / num_nodes / (target_L[rows] + margin)).tolist()
            count_TEN = torch.stack([grouped_counts(weight_LE[l], num_groups, num_nodes, num_slots // num_nodes, cap,
                                                    None if margin is None else together_LGG[l], move)
                                     for l, cap in zip(rows.tolist(), caps)])
            return _pack_nodes(weight_LE[rows], count_TEN, num_gpus)

        anchor_LR = grouped(all_L, None)
        anchored_L = offer(all_L, anchor_LR)
        remote_L[anchored_L] -= _ANCHOR_EDGE  # where a grouped layout reaches the target, beat it by this or keep it
        short = all_L[~anchored_L & ~offer(all_L, grouped(all_L, 0.0, move=False))]
        anchor_bal_L = node_local_balancedness(weight_LE, anchor_LR, num_gpus, num_nodes)
        tries = short[anchor_bal_L[short] >= target_L[short] - _COPY_NEAR]  # copies across nodes can reach it
        short = short[anchor_bal_L[short] >= target_L[short] - _NEAR]  # a few swaps across nodes can reach it
        if len(short):
            short = short[~offer(short, _swaps(anchor_LR[short], weight_LE[short], num_nodes, num_gpus, target_L[short]))]
        for margin in _GROUPED_MARGINS:  # also where the swaps reached the target: fewer rows may leave their group
            if len(tries):
                ok_T = offer(tries, grouped(tries, margin))
                short, tries = short[~torch.isin(short, tries[ok_T])], tries[~ok_T]
        if len(short):  # swaps on the whole GPUs
            offer(short, _swap_across_nodes(anchor_LR[short], weight_LE[short], num_nodes, num_gpus, target_L[short]))
        remote_L[met_L & ~anchored_L & (plan_LR != fallback_LR).any(1)] -= _ANCHOR_EDGE
    gpu_mean_L = weight_LE.double().sum(1) / num_gpus
    tried = []
    for cand_LE in [node_set_counts(weight_LE, num_slots, num_gpus, num_nodes, a) for a in _SET_ABOVE] + [counts_LE]:
        # a replica heavier than a GPU may carry at the target makes the target unreachable: skip those layers,
        # and those whose counts an earlier candidate had
        todo_L = (weight_LE.double() / cand_LE).amax(1) <= gpu_mean_L / target_L.clamp(min=1e-9)
        for earlier_LE in tried:
            todo_L &= (earlier_LE != cand_LE).any(1)
        tried.append(cand_LE)
        for margin in _CAP_MARGINS:  # the loosest node cap that reaches the target
            rows = todo_L.nonzero().flatten()
            if len(rows) == 0:
                break
            count_TEN = _node_counts(weight_LE[rows], cand_LE[rows], affinity_LEE[rows], num_groups, num_nodes,
                                     num_slots // num_nodes, target_L[rows] + margin)
            todo_L[rows[offer(rows, _pack_nodes(weight_LE[rows], count_TEN, num_gpus))]] = False
    short = all_L[~met_L]
    if len(short):  # still short of the target: swaps across nodes on the best plan
        offer(short, _swap_across_nodes(plan_LR[short], weight_LE[short], num_nodes, num_gpus, target_L[short]))
    short = all_L[~met_L]
    if len(short):
        offer(short, _swaps(plan_LR[short], weight_LE[short], num_nodes, num_gpus, target_L[short]))
    short = all_L[~met_L]
    if len(short):  # the global plan with its GPUs traded between nodes
        offer(short, torch.stack([regroup_gpus(fallback_LR[l], weight_LE[l], num_gpus, num_nodes, float(target_L[l]))
                                  for l in short.tolist()]))
    if anchor_LR is not None:
        _spend_slack(plan_LR, anchor_LR, weight_LE, target_L, tokens_L, src_T, num_gpus, num_nodes)
    return plan_LR


def _spend_slack(plan_LR: torch.Tensor, anchor_LR: torch.Tensor, weight_LE: torch.Tensor, target_L: torch.Tensor,
                 tokens_L: list[torch.Tensor], src_T: torch.Tensor, num_gpus: int, num_nodes: int) -> None:
    """The balance target holds for the mean over layers: where the layers together balance above it, layers
    whose grouped layout (the anchor) fell short of their own target, and where that anchor sends fewer
    cross-node rows than the layer's plan, go back to the anchor, least balance per row saved first, while the
    mean stays at or above the mean target. Only anchors within _NEAR of their layer's target qualify. In place
    on plan_LR."""
    all_L = torch.arange(len(plan_LR))
    plan_bal_L = node_local_balancedness(weight_LE, plan_LR, num_gpus, num_nodes)
    anchor_bal_L = node_local_balancedness(weight_LE, anchor_LR, num_gpus, num_nodes)
    slack = float((plan_bal_L - target_L).sum())
    rows = all_L[(plan_LR != anchor_LR).any(1) & (anchor_bal_L >= target_L - _NEAR) & (anchor_bal_L < plan_bal_L)]
    if slack <= 0 or len(rows) == 0:
        return
    saved_T = _remote(tokens_L, src_T, plan_LR[rows], rows, num_gpus, num_nodes) - _remote(
        tokens_L, src_T, anchor_LR[rows], rows, num_gpus, num_nodes)  # rows per token the anchor saves
    cost_T = (plan_bal_L - anchor_bal_L)[rows]
    gain = saved_T > 0
    for l, cost, _ in sorted(zip(rows[gain].tolist(), cost_T[gain].tolist(), (cost_T / saved_T)[gain].tolist()),
                             key=lambda x: x[2]):
        if cost > slack:
            continue
        plan_LR[l], slack = anchor_LR[l], slack - cost


def _used_together(group_TK: torch.Tensor, num_groups: int) -> torch.Tensor:
    """together_GG: the share of tokens that use both groups (the diagonal: each group's share)."""
    used_TG = torch.zeros(group_TK.shape[0], num_groups).scatter_(1, group_TK, 1.0)
    return used_TG.T @ used_TG / max(1, group_TK.shape[0])


def _swaps(plan_TR: torch.Tensor, weight_TE: torch.Tensor, num_nodes: int, num_gpus: int, target_T: torch.Tensor
           ) -> torch.Tensor:
    """Each row's plan after the swaps of balancer/node_swaps.py that cost the least locality."""
    return torch.stack([swap_to_target(p_R, w_E, num_gpus, num_nodes, float(t))
                        for p_R, w_E, t in zip(plan_TR, weight_TE, target_T)])


def _remote(tokens_L: list[torch.Tensor], src_T: torch.Tensor, plan_TR: torch.Tensor, rows: torch.Tensor,
            num_gpus: int, num_nodes: int) -> torch.Tensor:
    """Mean cross-node rows per sampled token of each row's plan."""
    return torch.tensor([remote_nodes_per_token(tokens_L[int(l)], src_T, p_R, num_gpus, num_nodes).double().mean()
                         for l, p_R in zip(rows, plan_TR)], dtype=torch.float64)


def node_set_counts(weight_LE: torch.Tensor, num_slots: int, num_gpus: int, num_nodes: int, set_above: float
                    ) -> torch.Tensor:
    """counts_LE (step 1): each redundant slot, EPLB's way, to the expert whose busiest replica (its replicas
    spread as evenly over the nodes as they can be) carries the most load. An expert with at least
    `set_above` x the mean GPU load, or N or more replicas, grows by whole node sets (to N, then N more);
    a lighter one by one partial replica (on another node) while it has fewer than N - 1. An expert whose
    step no longer fits the slots left is passed over; slots left at the end add single replicas to
    experts with node sets (or any)."""
    num_layers, num_logical = weight_LE.shape
    weight_LE = weight_LE.double()
    counts_LE = torch.ones(num_layers, num_logical, dtype=torch.int64)
    layers_L = torch.arange(num_layers)
    left_L = torch.full((num_layers,), num_slots - num_logical, dtype=torch.int64)
    hot_LE = weight_LE >= set_above * weight_LE.sum(1, keepdim=True) / num_gpus
    passed_LE = torch.zeros(num_layers, num_logical, dtype=torch.bool)
    while True:
        spread_LE = torch.where(counts_LE < num_nodes, counts_LE, counts_LE // num_nodes * num_nodes)
        sets_LE = hot_LE | (counts_LE + 1 >= num_nodes)
        step_LE = torch.where(sets_LE, torch.where(counts_LE < num_nodes, num_nodes - counts_LE, num_nodes), 1)
        passed_LE |= step_LE > left_L.unsqueeze(1)
        busiest_LE = (weight_LE / spread_LE).masked_fill(passed_LE, -1.0)
        go_L = ~passed_LE.all(1)
        if not go_L.any():
            break
        pick_L = busiest_LE.argmax(1)
        step_L = torch.where(go_L, step_LE[layers_L, pick_L], 0)
        counts_LE[layers_L, pick_L] += step_L
        left_L -= step_L
    while (left_L > 0).any():  # left over: one more replica for the busiest expert with a node set (or any)
        score_LE = weight_LE / counts_LE + weight_LE.sum(1, keepdim=True) * (counts_LE >= num_nodes)
        go_L = left_L > 0
        pick_L = score_LE.argmax(1)
        counts_LE[layers_L[go_L], pick_L[go_L]] += 1
        left_L -= go_L.long()
    return counts_LE


def _node_counts(weight_TE: torch.Tensor, counts_TE: torch.Tensor, affinity_TEE: torch.Tensor, num_groups: int,
                 num_nodes: int, slots_per_node: int, target_T: torch.Tensor) -> torch.Tensor:
    """count_TEN: how many replicas of each expert each node holds (step 2), rows (layers) in parallel."""
    num_rows, num_logical = weight_TE.shape
    rows_T = torch.arange(num_rows)
    weight_TE, counts_TE = weight_TE.double(), counts_TE.long()
    count_TEN = (counts_TE // num_nodes).unsqueeze(2).repeat(1, 1, num_nodes)
    free_TN = slots_per_node - count_TEN.sum(1)
    # node load of one of the replicas placed one by one (c < N: w / c; the rest of c >= N moves none)
    item_TE = torch.where(counts_TE < num_nodes, weight_TE / counts_TE.clamp(min=1), 0.0)
    load_TN = ((weight_TE * (counts_TE >= num_nodes)).sum(1) / num_nodes).unsqueeze(1).repeat(1, num_nodes)
    cap_T = weight_TE.sum(1) / num_nodes / target_T.double().clamp(min=1e-9)
    affinity_TEE = affinity_TEE.double()
    near_TEN = torch.bmm(affinity_TEE, (count_TEN > 0).double())  # affinity of e to what each node holds
    # the replicas to place, per row: group by group (heaviest group first), heaviest first in a group; -1 pads
    group_E = torch.arange(num_logical) // max(1, num_logical // max(1, num_groups))
    group_load_TE = torch.zeros(num_rows, int(group_E.max()) + 1, dtype=torch.float64).index_add_(
        1, group_E, weight_TE)[:, group_E]
    rest_TE = counts_TE % num_nodes
    most = int(rest_TE.max()) if rest_TE.numel() else 0
    expert_TX = torch.arange(num_logical).repeat_interleave(max(most, 1)).expand(num_rows, -1)
    real_TX = torch.arange(max(most, 1)).repeat(num_logical).expand(num_rows, -1) < rest_TE.repeat_interleave(
        max(most, 1), dim=1)
    key_TX = torch.where(real_TX, item_TE.gather(1, expert_TX), -1.0)
    order_TX = key_TX.argsort(dim=1, descending=True, stable=True)
    gkey_TX = torch.where(real_TX, group_load_TE.gather(1, expert_TX), -1.0).gather(1, order_TX)
    order_TX = order_TX.gather(1, gkey_TX.argsort(dim=1, descending=True, stable=True))
    items_TX = torch.where(real_TX.gather(1, order_TX), expert_TX.gather(1, order_TX), -1)
    for k in range(int(real_TX.sum(1).max()) if num_rows else 0):
        live = (items_TX[:, k] >= 0).nonzero().flatten()
        e = items_TX[live, k]
        item = item_TE[live, e]
        open_RN = (free_TN[live] > 0) & (count_TEN[live, e] == 0)
        open_RN = torch.where(open_RN.any(1, keepdim=True), open_RN, free_TN[live] > 0)
        fits_RN = open_RN & (load_TN[live] + item.unsqueeze(1) <= cap_T[live].unsqueeze(1))
        affine_RN = (near_TEN[live, e] - load_TN[live] * 1e-12).masked_fill(~fits_RN, -float("inf"))
        light_RN = (-load_TN[live]).masked_fill(~open_RN, -float("inf"))
        n = torch.where(fits_RN.any(1), affine_RN.argmax(1), light_RN.argmax(1))
        new = count_TEN[live, e, n] == 0
        near_TEN[live[new], :, n[new]] += affinity_TEE[live[new], :, e[new]]
        count_TEN[live, e, n] += 1
        free_TN[live, n] -= 1
        load_TN[live, n] += item
    for t in (load_TN.amax(1) > cap_T).nonzero().flatten().tolist():
        _repair(count_TEN[t], item_TE[t], load_TN[t], near_TEN[t], affinity_TEE[t], float(cap_T[t]))
    return count_TEN


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


def _swap_across_nodes(phy2log_TR: torch.Tensor, weight_TE: torch.Tensor, num_nodes: int, num_gpus: int,
                       target_T: torch.Tensor) -> torch.Tensor:
    """Swaps between any GPUs while they lower the busiest one, each replica keeping the load it has under the
    node-local rule where it is (as expert-on-node items: moving one changes the others' little)."""
    num_rows, num_slots = phy2log_TR.shape
    num_logical = weight_TE.shape[1]
    if num_rows == 0:
        return phy2log_TR
    count_TEN = node_counts(phy2log_TR, num_logical, num_gpus, num_nodes)
    share_TX = (replica_loads(weight_TE, count_TEN) * count_TEN).view(num_rows, -1)  # X = E * N items
    node_R = torch.arange(num_slots) // (num_slots // num_nodes)
    item_TR = phy2log_TR * num_nodes + node_R
    swapped_TR = improve(item_TR, share_TX, num_gpus, target_T + 1e-6, recounts=False)
    swapped_TR = improve(swapped_TR, share_TX, num_gpus, target_T + 1e-6, allow_doubles=True, recounts=False)
    return swapped_TR // num_nodes


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
    # The node's share of each expert, which improve splits over the node's replicas of it. An expert the node
    # lacks gets an infinite share: no recount move brings it in (its tokens would follow).
    share_BE = (load_BE * count_BE).masked_fill(count_BE == 0, float("inf"))
    packed_BP = improve(packed_BP, share_BE, gpus_per_node, recounts=False)
    packed_BP = improve(packed_BP, share_BE, gpus_per_node, allow_doubles=True)
    return packed_BP.view(num_rows, num_nodes * slots_per_node)


def align_nodes(plan_LR: torch.Tensor, prev_LR: torch.Tensor, num_nodes: int, num_gpus: int, num_logical: int
                ) -> torch.Tensor:
    """plan_LR with its nodes renumbered, then each node's GPUs and slots, to agree with prev_LR where they can
    (greedy by experts shared). Balance and locality are unchanged: a node keeps its GPUs, a GPU its experts."""
    num_layers, num_slots = plan_LR.shape
    per_node = num_slots // num_nodes
    prev_LNP = prev_LR.view(num_layers, num_nodes, per_node)
    moved_LNP = match_blocks(plan_LR.view(num_layers, num_nodes, per_node), prev_LNP, num_logical)
    rows_BP = align(moved_LNP.reshape(-1, per_node), prev_LNP.reshape(-1, per_node), num_gpus // num_nodes,
                     num_logical)
    return rows_BP.view(num_layers, num_slots)
