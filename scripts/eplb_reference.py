"""DeepSeek's public EPLB algorithm (github.com/deepseek-ai/EPLB, eplb.py), re-implemented for comparison.

Same steps and outputs as the original: `replicate_experts` gives each extra replica to the expert with
the most load per replica; `balanced_packing` puts items heaviest first into the lightest pack that still
has room; the hierarchical policy packs expert groups onto nodes, replicates within each node, then packs
to the node's GPUs; the global policy is the hierarchical one with one group and one node. Two
differences, neither a change of algorithm: `balanced_packing` runs over all rows at once instead of a
Python loop per row, and sorts stably (the original's sort is unstable, so ties may be broken differently).

Shape legend: L layers, E logical experts, R physical slots, G GPUs, X max replicas per expert.
"""

import torch


def balanced_packing(weight_XN: torch.Tensor, num_packs: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Pack N items per row into num_packs packs of N / num_packs items each, as balanced as LPT gets.

    Returns (pack_index_XN, rank_in_pack_XN).
    """
    num_rows, num_items = weight_XN.shape
    assert num_items % num_packs == 0
    per_pack = num_items // num_packs
    if per_pack == 1:
        pack_index = torch.arange(num_items, dtype=torch.int64).expand(num_rows, -1).clone()
        return pack_index, torch.zeros_like(pack_index)
    order_XN = weight_XN.float().sort(dim=-1, descending=True, stable=True).indices
    pack_index = torch.full((num_rows, num_items), -1, dtype=torch.int64)
    rank_in_pack = torch.full_like(pack_index, -1)
    pack_weight = torch.zeros(num_rows, num_packs, dtype=torch.float32)
    pack_items = torch.zeros(num_rows, num_packs, dtype=torch.int64)
    rows = torch.arange(num_rows)
    for k in range(num_items):
        item = order_XN[:, k]
        # First pack (lowest index) of least weight among those with room, as Python's min() picks.
        pack = pack_weight.masked_fill(pack_items == per_pack, float("inf")).argmin(1)
        pack_index[rows, item] = pack
        rank_in_pack[rows, item] = pack_items[rows, pack]
        pack_weight[rows, pack] += weight_XN[rows, item].float()
        pack_items[rows, pack] += 1
    return pack_index, rank_in_pack


def replicate_experts(weight: torch.Tensor, num_phy: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Replicate num_log experts to num_phy replicas minimising the max load per replica.

    weight: [X, num_log]. Returns phy2log [X, num_phy], rank [X, num_phy], logcnt [X, num_log].
    """
    n, num_log = weight.shape
    assert num_phy >= num_log
    phy2log = torch.arange(num_phy, dtype=torch.int64).repeat(n, 1)
    rank = torch.zeros(n, num_phy, dtype=torch.int64)
    logcnt = torch.ones(n, num_log, dtype=torch.int64)
    arangen = torch.arange(n, dtype=torch.int64)
    for i in range(num_log, num_phy):
        redundant_indices = (weight / logcnt).max(dim=-1).indices
        phy2log[:, i] = redundant_indices
        rank[:, i] = logcnt[arangen, redundant_indices]
        logcnt[arangen, redundant_indices] += 1
    return phy2log, rank, logcnt


def _inverse(perm: torch.Tensor) -> torch.Tensor:
    inv = torch.empty_like(perm)
    inv.scatter_(1, perm, torch.arange(perm.size(1), dtype=torch.int64).expand(perm.shape))
    return inv


def rebalance_experts_hierarchical(weight: torch.Tensor, num_physical_experts: int, num_groups: int,
                                   num_nodes: int, num_gpus: int):
    """Returns (phy2log [L, R], phyrank [L, R], logcnt [L, E])."""
    num_layers, num_logical_experts = weight.shape
    assert num_logical_experts % num_groups == 0
    group_size = num_logical_experts // num_groups
    assert num_groups % num_nodes == 0
    groups_per_node = num_groups // num_nodes
    assert num_gpus % num_nodes == 0
    assert num_physical_experts % num_gpus == 0
    phy_experts_per_gpu = num_physical_experts // num_gpus

    # Step 1: pack groups to nodes.
    tokens_per_group = weight.unflatten(-1, (num_groups, group_size)).sum(-1)
    group_pack_index, group_rank_in_pack = balanced_packing(tokens_per_group, num_nodes)
    log2mlog = (((group_pack_index * groups_per_node + group_rank_in_pack) * group_size).unsqueeze(-1)
                + torch.arange(group_size, dtype=torch.int64)).flatten(-2)
    mlog2log = _inverse(log2mlog)

    # Step 2: construct redundant experts within nodes. [L * num_nodes, E / num_nodes]
    tokens_per_mlog = weight.gather(-1, mlog2log).view(-1, num_logical_experts // num_nodes)
    phy2mlog, phyrank, mlogcnt = replicate_experts(tokens_per_mlog, num_physical_experts // num_nodes)

    # Step 3: pack physical experts to GPUs. [L * num_nodes, R / num_nodes]
    tokens_per_phy = (tokens_per_mlog / mlogcnt).gather(-1, phy2mlog)
    pack_index, rank_in_pack = balanced_packing(tokens_per_phy, num_gpus // num_nodes)
    phy2pphy = pack_index * phy_experts_per_gpu + rank_in_pack
    pphy2phy = _inverse(phy2pphy)

    pphy2mlog = phy2mlog.gather(-1, pphy2phy)
    pphy2mlog = (pphy2mlog.view(num_layers, num_nodes, -1)
                 + torch.arange(0, num_logical_experts, num_logical_experts // num_nodes).view(1, -1, 1)).flatten(-2)
    pphy2log = mlog2log.gather(-1, pphy2mlog)
    pphyrank = phyrank.gather(-1, pphy2phy).view(num_layers, -1)
    logcnt = mlogcnt.view(num_layers, -1).gather(-1, log2mlog)
    return pphy2log, pphyrank, logcnt


def rebalance_experts(weight: torch.Tensor, num_replicas: int, num_groups: int, num_nodes: int, num_gpus: int,
                      policy: str = "auto") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """EPLB's entry point. policy "auto" is EPLB's own choice: hierarchical when groups divide over nodes.

    Returns phy2log [L, R], log2phy [L, E, X] (padded with -1), logcnt [L, E].
    """
    num_layers, num_logical_experts = weight.shape
    weight = weight.float().cpu()
    if policy == "auto":
        policy = "hierarchical" if num_groups % num_nodes == 0 else "global"
    if policy == "hierarchical":
        phy2log, phyrank, logcnt = rebalance_experts_hierarchical(weight, num_replicas, num_groups, num_nodes,
                                                                  num_gpus)
    elif policy == "global":
        phy2log, phyrank, logcnt = rebalance_experts_hierarchical(weight, num_replicas, 1, 1, num_gpus)
    else:
        raise ValueError(f"policy {policy!r} is not one of 'auto', 'hierarchical', 'global'")
    maxlogcnt = int(logcnt.max())
    log2phy = torch.full((num_layers, num_logical_experts, maxlogcnt), -1, dtype=torch.int64)
    log2phy.view(num_layers, -1).scatter_(-1, phy2log * maxlogcnt + phyrank,
                                          torch.arange(num_replicas, dtype=torch.int64).expand(num_layers, -1))
    return phy2log, log2phy, logcnt
