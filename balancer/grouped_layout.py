"""The grouped layout: whole expert groups on nodes, spare slots as replicas on their expert's node (the
layout of EPLB's hierarchical policy, and the locality anchor of node-aware placement), then copies of
replicas (and, where none is possible, swaps) across nodes that bring every node's load under a cap.

Under group-limited routing a token's experts come from a few groups, so a group kept whole on one node
costs a token at most one cross-node row. What it cannot do is balance: a node's load is its groups'
load. So, per layer:
  1. groups onto nodes: heaviest first onto the lightest node with room, then swaps of two groups between
     nodes while they lower the busier of the two (several groups per node);
  2. each node's spare slots to its experts with the most load per replica;
  3. while a node is above the cap, a move (the busiest node's, to a node that stays under the cap):
       copy:  an expert with two or more replicas on the busy node, its home node, gets one on another
              node, which gives up one of its spare replicas: that node's own tokens of the expert stay
              there (1/N of its load moves) and no token reaches a node it would not reach anyway;
       swap:  an expert with one replica trades nodes with a lighter one (both leave their groups),
              only where no copy is possible, choosing the one that brings the node under the cap and
              splits the least load from its group's node, else the one moving the most.
     Copies come first, the one that brings the node under the cap moving the least load, else the one
     moving the most.
The node load is the node-local rule's (balancer/locality.py): each node's tokens served on their node
where it holds a replica, the other nodes' on the expert's home node.

Shape legend: E experts, N nodes, G groups.
"""

import torch

from moe_serve.balancer.locality import replica_loads


_MAX_MOVES = 48  # per layer (a copy moves 1/N of an expert's load; more swaps would not keep the groups whole)
_MIN_GAIN = 0.03  # share of tokens: a swap of groups must raise their use together by this (not sample noise)


def grouped_counts(weight_E: torch.Tensor, num_groups: int, num_nodes: int, slots_per_node: int,
                   cap: float = float("inf"), together_GG: torch.Tensor | None = None, move: bool = True
                   ) -> torch.Tensor:
    """count_EN for one layer: steps 1-3 above, the node loads brought under `cap` where the moves can (none
    without `move`).
    together_GG: how often two groups serve one token; given, step 1 ends with swaps that put groups used
    together on one node while both nodes stay under `cap` (or the busiest node's load, if higher)."""
    num_logical = weight_E.shape[0]
    weight_E = weight_E.double()
    group_E = torch.arange(num_logical) // (num_logical // num_groups)
    group_load_G = torch.zeros(num_groups, dtype=torch.float64).index_add_(0, group_E, weight_E)
    node_G = _groups_onto_nodes(group_load_G, num_nodes)
    if together_GG is not None and num_groups > num_nodes:
        _pair_used_together(node_G, group_load_G, together_GG.double(), num_nodes, cap)
    node_E = node_G[group_E]
    counts_E = torch.ones(num_logical, dtype=torch.int64)
    for n in range(num_nodes):
        mine = (node_E == n).nonzero().flatten()
        for _ in range(slots_per_node - len(mine)):
            counts_E[mine[(weight_E[mine] / counts_E[mine]).argmax()]] += 1
    count_EN = torch.zeros(num_logical, num_nodes, dtype=torch.int64)
    count_EN[torch.arange(num_logical), node_E] = counts_E
    if move and cap < float("inf"):
        _balance_nodes(weight_E, count_EN, cap)
    return count_EN


def _groups_onto_nodes(group_load_G: torch.Tensor, num_nodes: int) -> torch.Tensor:
    """node_G: heaviest group first onto the lightest node with room, then pairwise swaps of groups on two
    nodes while one lowers the busier node of the pair."""
    num_groups = group_load_G.shape[0]
    node_load_N = torch.zeros(num_nodes, dtype=torch.float64)
    room_N = torch.full((num_nodes,), num_groups // num_nodes)
    node_G = torch.empty(num_groups, dtype=torch.int64)
    for g in group_load_G.argsort(descending=True, stable=True).tolist():
        n = int(node_load_N.masked_fill(room_N == 0, float("inf")).argmin())
        node_G[g], node_load_N[n], room_N[n] = n, node_load_N[n] + group_load_G[g], room_N[n] - 1
    if num_groups == num_nodes:
        return node_G
    for _ in range(num_groups * num_groups):
        d_GG = group_load_G.unsqueeze(1) - group_load_G.unsqueeze(0)  # load g gives h's node, h gives g's
        a_GG, b_GG = node_load_N[node_G].unsqueeze(1), node_load_N[node_G].unsqueeze(0)
        new_max_GG = torch.maximum(a_GG - d_GG, b_GG + d_GG)
        gain_GG = torch.maximum(a_GG, b_GG) - new_max_GG
        gain_GG = gain_GG.masked_fill((d_GG <= 0) | (node_G.unsqueeze(1) == node_G.unsqueeze(0)), 0.0)
        best = int(gain_GG.argmax())
        if gain_GG.view(-1)[best] <= 1e-9 * float(node_load_N.max()):
            break
        g, h = divmod(best, num_groups)
        d = float(d_GG[g, h])
        node_load_N[node_G[g]] -= d
        node_load_N[node_G[h]] += d
        node_G[g], node_G[h] = node_G[h].clone(), node_G[g].clone()
    return node_G


def _pair_used_together(node_G: torch.Tensor, group_load_G: torch.Tensor, together_GG: torch.Tensor, num_nodes: int,
                        cap: float) -> None:
    """In place: while one raises it by more than _MIN_GAIN, the swap of two groups on two nodes that most raises
    how often groups on one node are used together, both nodes staying under max(cap, busiest node load)."""
    num_groups = node_G.shape[0]
    node_load_N = torch.zeros(num_nodes, dtype=torch.float64).index_add_(0, node_G, group_load_G)
    limit = max(cap, float(node_load_N.max()))
    off_GG = together_GG * ~torch.eye(num_groups, dtype=torch.bool)
    for _ in range(num_groups * num_groups):
        on_GN = torch.zeros(num_groups, num_nodes, dtype=torch.float64)
        on_GN[torch.arange(num_groups), node_G] = 1.0
        with_GN = off_GG @ on_GN  # how often g is used with the groups on each node
        here_G = with_GN.gather(1, node_G.view(-1, 1)).squeeze(1)
        # g to h's node, h to g's node: g gains its use with h's node mates (less h), h likewise
        gain_GG = (with_GN[:, node_G] - off_GG) - here_G.unsqueeze(1) + (with_GN[:, node_G] - off_GG).T - here_G.unsqueeze(0)
        d_GG = group_load_G.unsqueeze(1) - group_load_G.unsqueeze(0)
        a_GG, b_GG = node_load_N[node_G].unsqueeze(1), node_load_N[node_G].unsqueeze(0)
        ok_GG = (node_G.unsqueeze(1) != node_G.unsqueeze(0)) & (a_GG - d_GG <= limit) & (b_GG + d_GG <= limit)
        gain_GG = gain_GG.masked_fill(~ok_GG, 0.0)
        best = int(gain_GG.argmax())
        if gain_GG.view(-1)[best] <= _MIN_GAIN:
            return
        g, h = divmod(best, num_groups)
        d = float(d_GG[g, h])
        node_load_N[node_G[g]] -= d
        node_load_N[node_G[h]] += d
        node_G[g], node_G[h] = node_G[h].clone(), node_G[g].clone()


def _balance_nodes(weight_E: torch.Tensor, count_EN: torch.Tensor, cap: float) -> None:
    """In place: step 3 while the busiest node is above `cap` (at most _MAX_MOVES moves, one per expert)."""
    num_logical, num_nodes = count_EN.shape
    nodes_N = torch.arange(num_nodes)
    moved_E = torch.zeros(num_logical, dtype=torch.bool)
    for _ in range(_MAX_MOVES):
        load_N = (replica_loads(weight_E.view(1, -1), count_EN.unsqueeze(0))[0] * count_EN).sum(0)
        hot = int(load_N.argmax())
        if load_N[hot] <= cap * (1 + 1e-12):
            return
        excess, room_N = float(load_N[hot] - cap), cap - load_N
        room_N[hot] = -1.0
        one_node_E = (count_EN > 0).sum(1) == 1
        here_E = one_node_E & (count_EN[:, hot] > 0) & ~moved_E
        spare_EN = one_node_E.unsqueeze(1) & (count_EN >= 2)  # a spare replica a node can give up
        # copy e (c >= 2 replicas here, the most of any node) to node n, which gives up a spare: n then serves
        # its own tokens of e, every other node's stay here
        c_E = count_EN[:, hot]
        move_E = weight_E / num_nodes
        home_E = (c_E >= 2) & (c_E > count_EN.masked_fill(nodes_N == hot, 0).amax(1))  # stays home after a copy
        ok_EN = home_E.unsqueeze(1) & spare_EN.any(0).unsqueeze(0) & (nodes_N != hot).unsqueeze(0) & (count_EN == 0)
        ok_EN &= move_E.unsqueeze(1) <= room_N.unsqueeze(0)
        # swap e (one replica, here) with f (one replica, on node n): e's load for f's
        single_E = one_node_E & (count_EN.sum(1) == 1) & ~moved_E
        e_A = (single_E & here_E).nonzero().flatten()
        f_B = (single_E & ~here_E).nonzero().flatten()
        n_B = count_EN[f_B].argmax(1)
        d_AB = weight_E[e_A].unsqueeze(1) - weight_E[f_B].unsqueeze(0)
        ok_AB = (d_AB > 0) & (d_AB <= room_N[n_B].unsqueeze(0))
        # key: a move that fixes the busy node, by the load it splits from its group; else the most moved
        fixes_EN = ok_EN & (move_E.unsqueeze(1) >= excess)
        fixes_AB = ok_AB & (d_AB >= excess)
        split_EN = move_E.unsqueeze(1).expand(-1, num_nodes)
        split_AB = weight_E[e_A].unsqueeze(1) + weight_E[f_B].unsqueeze(0)
        inf = float("inf")
        if ok_EN.any():  # copies first: they leave every token's nodes as they were
            top = 2.0 * float(move_E.max()) + 1.0  # the copies that fix the node rank before all others
            key_EN = torch.where(fixes_EN, split_EN, top - split_EN).masked_fill(~ok_EN, inf)
            key_AB = torch.full_like(d_AB, inf)
        elif fixes_AB.any():
            key_EN = split_EN.masked_fill(~fixes_EN, inf)
            key_AB = split_AB.masked_fill(~fixes_AB, inf)
        else:
            key_EN = (-split_EN).masked_fill(~ok_EN, inf)
            key_AB = (-d_AB).masked_fill(~ok_AB, inf)
        best_rel = float(key_EN.min()) if key_EN.numel() else inf
        best_swap = float(key_AB.min()) if key_AB.numel() else inf
        if min(best_rel, best_swap) == inf:
            return
        if best_rel <= best_swap:
            e, n = divmod(int(key_EN.argmin()), num_nodes)
            give_F = spare_EN[:, n].nonzero().flatten()  # n gives up the spare whose expert then loads least
            f = int(give_F[(weight_E[give_F] / (count_EN[give_F, n] - 1)).argmin()])
            count_EN[f, n] -= 1
            count_EN[e, n] += 1
        else:
            a, b = divmod(int(key_AB.argmin()), len(f_B))
            e, f, n = int(e_A[a]), int(f_B[b]), int(n_B[b])
            count_EN[e, hot], count_EN[e, n] = 0, 1
            count_EN[f, n], count_EN[f, hot] = 0, 1
            moved_E[e] = moved_E[f] = True
