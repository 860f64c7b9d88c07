"""Where a placement sends tokens across nodes: pure measures for multi-node expert parallelism.

GPUs are numbered node by node: GPU g is on node g // (G // N), slot p on GPU p // (R // G). Cross-node
traffic is the scarce resource of wide EP, so a token that needs an expert its own node holds uses that
replica (the node-local rule). A token from a node without one goes to the expert's home node, where one
node holds more of its replicas than any other (a copy on another node then serves only that node's
tokens: it moves load without sending any token to a node it would not visit anyway); where no node
holds the most, those tokens spread evenly over all of the expert's replicas. A token costs one
cross-node row per distinct remote node it must reach.

Shape legend (see balancer/placement.py): L layers, E logical experts, R slots, G GPUs, N nodes,
T tokens, K experts per token, X most replicas of an expert.
"""

import torch


def planning_nodes(nodes: tuple[int, ...]) -> int:
    """How many nodes a planner may assume for EP ranks on `nodes` (one node id per rank, in EP order): their
    count when the ranks come node by node, the same number on each; else 1 (plan as if on one node)."""
    if not nodes:
        return 1
    runs = [n for i, n in enumerate(nodes) if i == 0 or n != nodes[i - 1]]
    if len(runs) != len(set(runs)) or len(nodes) % len(runs) or any(
            nodes.count(n) != len(nodes) // len(runs) for n in runs):
        return 1
    return len(runs)


def node_of_slot(num_slots: int, num_gpus: int, num_nodes: int) -> torch.Tensor:
    """node_R: the node of each slot."""
    if num_gpus % num_nodes or num_slots % num_gpus:
        raise ValueError(f"{num_nodes} nodes must divide {num_gpus} GPUs, which must divide {num_slots} slots")
    return torch.arange(num_slots) // (num_slots // num_gpus) // (num_gpus // num_nodes)


def node_counts(phy2log_LR: torch.Tensor, num_logical: int, num_gpus: int, num_nodes: int) -> torch.Tensor:
    """count_LEN: replicas of each expert on each node."""
    num_layers, num_slots = phy2log_LR.shape
    node_R = node_of_slot(num_slots, num_gpus, num_nodes)
    count_LEN = torch.zeros(num_layers, num_logical * num_nodes, dtype=torch.int64)
    count_LEN.scatter_add_(1, phy2log_LR.long() * num_nodes + node_R, torch.ones_like(phy2log_LR, dtype=torch.int64))
    return count_LEN.view(num_layers, num_logical, num_nodes)


def home_nodes(count_LEN: torch.Tensor) -> torch.Tensor:
    """home_LEN: True on an expert's home node, the one node that holds more of its replicas than any other
    (it serves the tokens of nodes without a replica); False on every node where no node holds the most."""
    top_LEN = count_LEN == count_LEN.amax(2, keepdim=True)
    return top_LEN & (top_LEN.sum(2, keepdim=True) == 1) & (count_LEN > 0)


def replica_loads(weight_LE: torch.Tensor, count_LEN: torch.Tensor) -> torch.Tensor:
    """load_LEN: expected load of ONE replica of expert e on node n under the node-local rule, tokens coming
    evenly from every node: its node's share (split over the local replicas) plus, on the home node, the
    tokens from nodes without a replica (split over its replicas there), or, where the expert has no home
    node, an even share of them. 0 where the node holds none."""
    num_nodes = count_LEN.shape[2]
    weight_LE = weight_LE.double()
    total_LE = count_LEN.sum(2)
    lacking_LE = (count_LEN == 0).sum(2)
    home_LEN = home_nodes(count_LEN)
    has_home_LE = home_LEN.any(2, keepdim=True)
    away_LEN = torch.where(has_home_LE, home_LEN / count_LEN.clamp(min=1), 1.0 / total_LE.clamp(min=1).unsqueeze(2))
    per_LEN = (weight_LE / num_nodes).unsqueeze(2) * (1.0 / count_LEN.clamp(min=1) + lacking_LE.unsqueeze(2) * away_LEN)
    return per_LEN.masked_fill(count_LEN == 0, 0.0)


def node_local_gpu_loads(weight_LE: torch.Tensor, phy2log_LR: torch.Tensor, num_gpus: int, num_nodes: int
                         ) -> torch.Tensor:
    """load_LG under the node-local rule (with one node, the even split of balancer.placement.gpu_loads)."""
    num_layers, num_slots = phy2log_LR.shape
    count_LEN = node_counts(phy2log_LR, weight_LE.shape[1], num_gpus, num_nodes)
    per_LEN = replica_loads(weight_LE, count_LEN)
    node_R = node_of_slot(num_slots, num_gpus, num_nodes)
    slot_load_LR = per_LEN.view(num_layers, -1).gather(1, phy2log_LR.long() * num_nodes + node_R)
    return slot_load_LR.view(num_layers, num_gpus, -1).sum(2)


def node_local_balancedness(weight_LE: torch.Tensor, phy2log_LR: torch.Tensor, num_gpus: int, num_nodes: int
                            ) -> torch.Tensor:
    """Per layer mean GPU load / max GPU load under the node-local rule; 1.0 for a layer without load."""
    load_LG = node_local_gpu_loads(weight_LE, phy2log_LR, num_gpus, num_nodes)
    max_L = load_LG.max(1).values
    return torch.where(max_L > 0, load_LG.mean(1) / max_L.clamp(min=1e-300), torch.ones_like(max_L))


def remote_nodes_per_token(topk_ids_TK: torch.Tensor, src_node_T: torch.Tensor, phy2log_R: torch.Tensor,
                           num_gpus: int, num_nodes: int, node_local: bool = True) -> torch.Tensor:
    """remote_T: distinct nodes other than its own that each token's experts take it to (one layer).

    node_local: an expert with a replica on the token's node is served there, else on its home node if it
    has one; otherwise (and for every expert when node_local is False) token t takes replica t % count, the
    even split."""
    num_slots = phy2log_R.shape[0]
    num_logical = int(phy2log_R.max()) + 1
    node_R = node_of_slot(num_slots, num_gpus, num_nodes)
    count_1EN = node_counts(phy2log_R.view(1, -1), num_logical, num_gpus, num_nodes)
    total_E = count_1EN[0].sum(1)
    order_R = phy2log_R.argsort(stable=True)  # slots grouped by expert, ascending
    start_E = total_E.cumsum(0) - total_E
    num_tokens = topk_ids_TK.shape[0]
    pick_TK = torch.arange(num_tokens).view(-1, 1) % total_E[topk_ids_TK]
    node_TK = node_R[order_R[start_E[topk_ids_TK] + pick_TK]]
    if node_local:
        home_EN = home_nodes(count_1EN)[0]
        node_TK = torch.where(home_EN.any(1)[topk_ids_TK], home_EN.long().argmax(1)[topk_ids_TK], node_TK)
        local_TK = count_1EN[0][topk_ids_TK, src_node_T.view(-1, 1).expand_as(topk_ids_TK)] > 0
        node_TK = torch.where(local_TK, src_node_T.view(-1, 1), node_TK)
    reach_TN = torch.zeros(num_tokens, num_nodes, dtype=torch.bool)
    reach_TN.scatter_(1, node_TK, True)
    reach_TN[torch.arange(num_tokens), src_node_T] = False
    return reach_TN.sum(1)


def sample_routed_tokens(weight_E: torch.Tensor, num_tokens: int, topk: int, num_groups: int = 1, topk_group: int = 1,
                         generator: torch.Generator | None = None) -> torch.Tensor:
    """topk_ids_TK: tokens routed as DeepSeek-V3 routes them, their expert scores log(load share) plus Gumbel
    noise: the `topk_group` groups with the best sum of their top-2 scores, then the `topk` best experts in
    them (num_groups 1: plain top-k). A stand-in for recorded routing when only the load is known."""
    num_logical = weight_E.shape[0]
    share_E = weight_E.double() / weight_E.double().sum().clamp(min=1e-300)
    uniform_TE = torch.rand(num_tokens, num_logical, generator=generator, dtype=torch.float64).clamp(min=1e-12)
    score_TE = share_E.clamp(min=1e-12).log() - (-uniform_TE.log()).log()
    if num_groups > 1:
        group_TGE = score_TE.view(num_tokens, num_groups, -1)
        best_TG = group_TGE.topk(min(2, group_TGE.shape[2]), dim=2).values.sum(2)
        keep_TG = torch.zeros_like(best_TG, dtype=torch.bool).scatter_(1, best_TG.topk(topk_group, dim=1).indices,
                                                                       True)
        score_TE = group_TGE.masked_fill(~keep_TG.unsqueeze(2), -float("inf")).view(num_tokens, num_logical)
    return score_TE.topk(topk, dim=1).indices


def group_affinity(weight_LE: torch.Tensor, num_groups: int) -> torch.Tensor:
    """affinity_LEE: how often two experts are expected to serve one token when routing is group-limited
    (DeepSeek's: a token's experts come from a few groups of E // num_groups consecutive experts) and
    nothing better is recorded: load x load within a group, 0 across groups and on the diagonal."""
    num_layers, num_logical = weight_LE.shape
    group_E = torch.arange(num_logical) // (num_logical // num_groups)
    same_EE = (group_E.view(-1, 1) == group_E.view(1, -1)) & ~torch.eye(num_logical, dtype=torch.bool)
    share_LE = weight_LE.double() / weight_LE.double().sum(1, keepdim=True).clamp(min=1e-300)
    return share_LE.unsqueeze(2) * share_LE.unsqueeze(1) * same_EE


def coactivation(topk_ids_TK: torch.Tensor, num_logical: int, out_EE: torch.Tensor | None = None) -> torch.Tensor:
    """count_EE: tokens that chose both e and f (e != f), for one layer, counted on topk_ids' device; added
    into out_EE (int64, contiguous) when given."""
    pairs_TKK = topk_ids_TK.long().unsqueeze(2) * num_logical + topk_ids_TK.long().unsqueeze(1)
    pairs_N = pairs_TKK[topk_ids_TK.unsqueeze(2) != topk_ids_TK.unsqueeze(1)]
    if out_EE is None:
        out_EE = torch.zeros(num_logical, num_logical, dtype=torch.int64, device=topk_ids_TK.device)
    out_EE.view(-1).index_add_(0, pairs_N, torch.ones_like(pairs_N))
    return out_EE


def split_affinity(phy2log_LR: torch.Tensor, affinity_LEE: torch.Tensor, num_gpus: int, num_nodes: int
                   ) -> torch.Tensor:
    """Per layer, the affinity of expert pairs that share no node (each pair once): what node-aware placement
    keeps low."""
    present_LEN = (node_counts(phy2log_LR, affinity_LEE.shape[1], num_gpus, num_nodes) > 0).double()
    apart_LEE = torch.bmm(present_LEN, present_LEN.transpose(1, 2)) == 0
    return (affinity_LEE.double() * apart_LEE).sum((1, 2)) / 2


def node_local_view(log2phy_EX: torch.Tensor, logcnt_E: torch.Tensor, slots_per_rank: int,
                    rank_nodes: list[int] | tuple[int, ...], node: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(log2phy_EX, logcnt_E) as a rank on `node` should use them, the EP ranks on `rank_nodes` (one node id
    per rank, in EP order): an expert with replicas on this node lists only those (the node-local rule),
    one without lists only those on its home node where it has one, and the others keep all their replicas."""
    device = log2phy_EX.device
    node_R = torch.tensor(list(rank_nodes), device=device)
    valid_EX = log2phy_EX >= 0
    node_EX = torch.where(valid_EX, node_R[torch.where(valid_EX, log2phy_EX // slots_per_rank, 0)], -1)
    num_nodes = int(node_R.max()) + 1
    count_EN = (node_EX.unsqueeze(2) == torch.arange(num_nodes, device=device)).sum(1)
    home_EN = home_nodes(count_EN.unsqueeze(0))[0]
    local_EX = node_EX == node
    home_EX = valid_EX & home_EN.gather(1, node_EX.clamp(min=0))
    keep_EX = torch.where(local_EX.any(1, keepdim=True), local_EX,
                          torch.where(home_EN.any(1, keepdim=True), home_EX, valid_EX))
    order_EX = (~keep_EX).long().argsort(dim=1, stable=True)  # kept replicas first, in slot order
    view_EX = torch.where(keep_EX, log2phy_EX, -1).gather(1, order_EX)
    return view_EX, keep_EX.sum(1).to(logcnt_E.dtype)


__all__ = ["planning_nodes", "node_of_slot", "node_counts", "home_nodes", "replica_loads", "node_local_gpu_loads",
           "node_local_balancedness", "remote_nodes_per_token", "sample_routed_tokens", "group_affinity",
           "coactivation", "split_affinity", "node_local_view"]
