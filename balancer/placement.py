"""Expert placement maps and the measures of a placement: pure functions on CPU tensors.

A placement puts the E logical experts of each MoE layer into R physical slots; slot p lives on GPU
p // (R // G). The same three maps as DeepSeek's EPLB describe it, so plans from either can be swapped.

Shape legend:
    L = MoE layers, E = logical experts, R = physical slots (replicas), G = GPUs, S = R // G slots per GPU,
    X = most replicas any expert has, T = tokens, K = experts per token (top-k).

    phy2log_LR   the logical expert held by each slot
    log2phy_LEX  the slots holding each expert, replica order, padded with -1
    logcnt_LE    how many slots hold each expert (>= 1)
    weight_LE    load per logical expert (tokens routed to it); a replicated expert's tokens split evenly
"""

import torch


def replica_counts(phy2log_LR: torch.Tensor, num_logical: int) -> torch.Tensor:
    """logcnt_LE: how many slots hold each expert."""
    counts_LE = torch.zeros(phy2log_LR.shape[0], num_logical, dtype=torch.int64)
    return counts_LE.scatter_add_(1, phy2log_LR.long(), torch.ones_like(phy2log_LR, dtype=torch.int64))


def build_log2phy(phy2log_LR: torch.Tensor, num_logical: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(log2phy_LEX, logcnt_LE) from phy2log_LR; each expert's replicas listed by ascending slot.

    X is the most replicas of any expert in any layer (as in EPLB); shorter rows are padded with -1.
    """
    phy2log_LR = phy2log_LR.long()
    num_layers, num_slots = phy2log_LR.shape
    logcnt_LE = replica_counts(phy2log_LR, num_logical)
    max_cnt = int(logcnt_LE.max()) if logcnt_LE.numel() else 0
    # Sort slots by expert (stable: slots of one expert stay ascending); the rank of a slot among its
    # expert's slots is its position minus where that expert's run starts.
    order_LR = phy2log_LR.argsort(dim=1, stable=True)
    expert_sorted_LR = phy2log_LR.gather(1, order_LR)
    run_start_LE = logcnt_LE.cumsum(1) - logcnt_LE
    rank_LR = torch.arange(num_slots).expand(num_layers, -1) - run_start_LE.gather(1, expert_sorted_LR)
    log2phy_LEX = torch.full((num_layers, num_logical * max_cnt), -1, dtype=torch.int64)
    log2phy_LEX.scatter_(1, expert_sorted_LR * max_cnt + rank_LR, order_LR)
    return log2phy_LEX.view(num_layers, num_logical, max_cnt), logcnt_LE


def gpu_loads(weight_LE: torch.Tensor, phy2log_LR: torch.Tensor, num_gpus: int) -> torch.Tensor:
    """load_LG: sum over each GPU's slots of weight[expert] / logcnt[expert]."""
    num_layers, num_slots = phy2log_LR.shape
    if num_slots % num_gpus:
        raise ValueError(f"{num_slots} slots do not divide evenly over {num_gpus} GPUs")
    weight_LE = weight_LE.double()
    logcnt_LE = replica_counts(phy2log_LR, weight_LE.shape[1])
    per_replica_LE = weight_LE / logcnt_LE.clamp(min=1)
    slot_load_LR = per_replica_LE.gather(1, phy2log_LR.long())
    return slot_load_LR.view(num_layers, num_gpus, num_slots // num_gpus).sum(2)


def balancedness(weight_LE: torch.Tensor, phy2log_LR: torch.Tensor, num_gpus: int) -> torch.Tensor:
    """Per layer mean GPU load / max GPU load, in (0, 1]; a layer with no load counts as 1.0.

    The plan's balancedness is the mean of this over layers; report the min alongside it.
    """
    load_LG = gpu_loads(weight_LE, phy2log_LR, num_gpus)
    max_L = load_LG.max(1).values
    return torch.where(max_L > 0, load_LG.mean(1) / max_L.clamp(min=1e-300), torch.ones_like(max_L))


def moved_slots(prev_phy2log_LR: torch.Tensor, new_phy2log_LR: torch.Tensor) -> int:
    """Slots whose expert changed, i.e. slots that must load new weights to go from one plan to the next."""
    if prev_phy2log_LR.shape != new_phy2log_LR.shape:
        raise ValueError(f"plans differ in shape: {tuple(prev_phy2log_LR.shape)} vs {tuple(new_phy2log_LR.shape)}")
    return int((prev_phy2log_LR != new_phy2log_LR).sum())


def validate_plan(phy2log_LR: torch.Tensor, log2phy_LEX: torch.Tensor, logcnt_LE: torch.Tensor,
                  num_logical: int) -> None:
    """Raise ValueError unless the three maps describe one valid placement of num_logical experts."""
    if phy2log_LR.dim() != 2:
        raise ValueError(f"phy2log must be [layers, slots], got shape {tuple(phy2log_LR.shape)}")
    num_layers, num_slots = phy2log_LR.shape
    if logcnt_LE.shape != (num_layers, num_logical):
        raise ValueError(f"logcnt must be [{num_layers}, {num_logical}], got {tuple(logcnt_LE.shape)}")
    if log2phy_LEX.dim() != 3 or log2phy_LEX.shape[:2] != (num_layers, num_logical):
        raise ValueError(f"log2phy must be [{num_layers}, {num_logical}, X], got {tuple(log2phy_LEX.shape)}")
    if num_slots < num_logical:
        raise ValueError(f"{num_slots} slots cannot hold {num_logical} experts: need at least one slot each")
    bad = (phy2log_LR < 0) | (phy2log_LR >= num_logical)
    if bad.any():
        layer, slot = bad.nonzero()[0].tolist()
        raise ValueError(f"phy2log[{layer}, {slot}] = {int(phy2log_LR[layer, slot])} is not an expert id in "
                         f"[0, {num_logical})")
    counts_LE = replica_counts(phy2log_LR, num_logical)
    if (counts_LE == 0).any():
        layer, expert = (counts_LE == 0).nonzero()[0].tolist()
        raise ValueError(f"expert {expert} of layer {layer} has no slot; every expert needs a replica")
    if not torch.equal(counts_LE, logcnt_LE.long()):
        layer, expert = (counts_LE != logcnt_LE).nonzero()[0].tolist()
        raise ValueError(f"logcnt[{layer}, {expert}] = {int(logcnt_LE[layer, expert])} but phy2log holds expert "
                         f"{expert} in {int(counts_LE[layer, expert])} slots")
    max_cnt = log2phy_LEX.shape[2]
    if max_cnt < int(counts_LE.max()):
        raise ValueError(f"log2phy has room for {max_cnt} replicas but an expert has {int(counts_LE.max())}")
    in_use_LEX = torch.arange(max_cnt) < logcnt_LE.unsqueeze(-1)
    if (log2phy_LEX[~in_use_LEX] != -1).any():
        raise ValueError("log2phy must be padded with -1 after each expert's logcnt replicas")
    slots = log2phy_LEX.clamp(min=0)
    if ((log2phy_LEX >= num_slots) | (in_use_LEX & (log2phy_LEX < 0))).any():
        raise ValueError(f"log2phy lists a slot outside [0, {num_slots})")
    holder_LEX = phy2log_LR.long().gather(1, slots.flatten(1)).view_as(slots)
    expected_LEX = torch.arange(num_logical).view(1, -1, 1).expand_as(slots)
    if (in_use_LEX & (holder_LEX != expected_LEX)).any():
        layer, expert, rep = (in_use_LEX & (holder_LEX != expected_LEX)).nonzero()[0].tolist()
        raise ValueError(f"log2phy[{layer}, {expert}, {rep}] = {int(log2phy_LEX[layer, expert, rep])} but that slot "
                         f"holds expert {int(holder_LEX[layer, expert, rep])}")
    # Each expert's listed slots all hold it and there are logcnt of them; they must also be distinct.
    seen_LR = torch.zeros(num_layers, num_slots, dtype=torch.int64)
    seen_LR.scatter_add_(1, slots.flatten(1), in_use_LEX.flatten(1).long())
    if (seen_LR != 1).any():
        layer, slot = (seen_LR != 1).nonzero()[0].tolist()
        raise ValueError(f"slot {slot} of layer {layer} appears {int(seen_LR[layer, slot])} times in log2phy; "
                         "it must appear exactly once")


def logical_to_physical(topk_ids_TK: torch.Tensor, log2phy_EX: torch.Tensor, logcnt_E: torch.Tensor,
                        token_index_T: torch.Tensor | None = None) -> torch.Tensor:
    """The one place logical expert ids become physical slot ids, for one layer.

    Token t's choice of expert e goes to replica log2phy[e, token_index[t] % logcnt[e]], so a hot
    expert's tokens spread evenly and deterministically over its replicas. token_index_T defaults to
    0..T-1 (pass global positions when a batch is split, so the spread does not restart per chunk).
    Returns phy_ids_TK on the device of topk_ids_TK (the maps are moved there).
    """
    device = topk_ids_TK.device
    if token_index_T is None:
        token_index_T = torch.arange(topk_ids_TK.shape[0], device=device)
    log2phy_EX = log2phy_EX.to(device)
    logcnt_TK = logcnt_E.to(device)[topk_ids_TK]
    replica_TK = token_index_T.to(device).view(-1, 1) % logcnt_TK
    return log2phy_EX[topk_ids_TK, replica_TK]


class ReplicaChooser:
    """Per-batch replica choice for one layer: each token's replica is picked from this batch's load on the
    EP ranks, not split evenly (what `logical_to_physical` does).

    The batch's tokens per expert are counted on the device; experts with one slot load their rank as they
    must; then each replicated expert, most replicated first (an order fixed by the placement, so no host
    sync), pours its tokens into its replicas' ranks by water-filling: the least loaded ranks first, until
    they are level, then evenly; three such sweeps (each expert re-poured given the others' shares). Token j of expert e (in batch order) goes to the replica whose share covers
    j. Replicas are only ever the expert's own slots; the choice is deterministic.
    Legend: T tokens, K top-k, E experts, X most replicas of an expert, G EP ranks, R slots.
    """

    SWEEPS = 3  # one pass is myopic where replicated experts share ranks; the next passes correct it

    def __init__(self, log2phy_EX: torch.Tensor, logcnt_E: torch.Tensor, num_ranks: int, slots_per_rank: int | None = None):
        """slots_per_rank: give it when log2phy_EX lists only some replicas (a node-local view)."""
        num_slots = int((log2phy_EX >= 0).sum())
        if slots_per_rank is None and num_slots % num_ranks:
            raise ValueError(f"{num_slots} slots do not divide evenly over {num_ranks} EP ranks")
        self.log2phy_EX, self.logcnt_E, self.num_ranks = log2phy_EX, logcnt_E, num_ranks
        per_rank = slots_per_rank or num_slots // num_ranks
        self.rank_EX = torch.where(log2phy_EX >= 0, log2phy_EX // per_rank, 0)
        counts = logcnt_E.tolist()
        self.replicated = sorted((e for e, c in enumerate(counts) if c > 1), key=lambda e: (-counts[e], e))
        self.replica_ranks = {e: self.rank_EX[e, :counts[e]] for e in self.replicated}

    def __call__(self, topk_ids_TK: torch.Tensor) -> torch.Tensor:
        device = topk_ids_TK.device
        flat_N = topk_ids_TK.reshape(-1)
        log2phy_EX, logcnt_E, rank_EX = (t.to(device) for t in (self.log2phy_EX, self.logcnt_E, self.rank_EX))
        num_experts, max_replicas = log2phy_EX.shape
        count_E = torch.zeros(num_experts, dtype=torch.float64, device=device).index_add_(
            0, flat_N, torch.ones(flat_N.numel(), dtype=torch.float64, device=device))
        single_E = logcnt_E == 1
        load_G = torch.zeros(self.num_ranks, dtype=torch.float64, device=device).index_add_(
            0, rank_EX[:, 0], count_E * single_E)
        share_EX = torch.zeros(num_experts, max_replicas, dtype=torch.float64, device=device)
        share_EX[:, 0] = count_E * single_E
        for sweep in range(self.SWEEPS):  # each sweep re-pours every replicated expert given all the others
            for e in self.replicated:
                ranks = self.replica_ranks[e].to(device)
                if sweep:
                    load_G.index_add_(0, ranks, -share_EX[e, :ranks.numel()])
                share = _water_fill(load_G[ranks], count_E[e])
                share_EX[e, :ranks.numel()] = share
                load_G.index_add_(0, ranks, share)
        # token j (0-based, batch order) of expert e takes the replica whose cumulative share first exceeds j
        bounds_EX = share_EX.cumsum(1)
        bounds_EX[torch.arange(max_replicas, device=device) >= logcnt_E.unsqueeze(1)] = float("inf")
        order_N = flat_N.argsort(stable=True)
        starts_E = count_E.cumsum(0) - count_E
        occurrence_N = torch.empty_like(flat_N)
        occurrence_N[order_N] = torch.arange(flat_N.numel(), device=device) - starts_E[flat_N[order_N]].long()
        replica_N = (bounds_EX[flat_N] <= occurrence_N.unsqueeze(1).double() + 0.5).sum(1)
        replica_N = torch.minimum(replica_N, logcnt_E[flat_N] - 1)
        return log2phy_EX[flat_N, replica_N].view_as(topk_ids_TK)


def _water_fill(load_X: torch.Tensor, amount: torch.Tensor) -> torch.Tensor:
    """How much of `amount` each of X bins gets so that the fullest bins after filling are as low as possible:
    bins below a common level are raised to it (pure tensor ops: no host sync)."""
    sorted_X, order_X = load_X.sort()
    k_X = torch.arange(1, load_X.numel() + 1, dtype=load_X.dtype, device=load_X.device)
    levels_X = (amount + sorted_X.cumsum(0)) / k_X  # the level if the k lowest bins share everything
    filled = (levels_X >= sorted_X).sum() - 1  # the last k whose level reaches its own bin
    level = levels_X.gather(0, filled.reshape(1))
    return (level - load_X).clamp(min=0.0)
