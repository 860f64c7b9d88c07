"""Index maths for expert-parallel dispatch: who gets which token, in which order, and how to sum it back.

Pure functions on tensors (no communication); `experts/dispatch.py` puts the all-to-alls between them.

Legend (shape suffixes):
  T tokens on this rank, K top-k slots per token, H hidden size, W ranks in the EP group,
  S rows this rank sends: one per (token, destination rank) pair, grouped by destination rank,
  R rows this rank receives (grouped by source rank).
Physical expert slot s lives on EP rank s // slots_per_rank, as local slot s % slots_per_rank.
Top-k ids of -1 mean "no expert" and go nowhere.

The running example below: slots_per_rank = 2, W = 3 ranks (slots 0-1 on rank 0, 2-3 on rank 1, 4-5 on
rank 2), T = 3 tokens with K = 2:
    topk_ids_TK = [[0, 1],    token 0: both experts on rank 0        -> sent once, to rank 0
                   [1, 4],    token 1: rank 0 and rank 2             -> sent twice
                   [5, -1]]   token 2: rank 2 (the -1 goes nowhere)  -> sent once
"""

from __future__ import annotations

import torch


def destination_mask(topk_ids_TK: torch.Tensor, slots_per_rank: int, num_ranks: int) -> torch.Tensor:
    """mask_TW[t, w]: token t has at least one expert on rank w. Ids must be < num_ranks * slots_per_rank
    (dispatch checks that in its one host sync).

    Example: -> [[1, 0, 0],
                 [1, 0, 1],
                 [0, 0, 1]]
    """
    T = topk_ids_TK.shape[0]
    ids = topk_ids_TK.long()
    dest_TK = torch.where(ids >= 0, ids // slots_per_rank, num_ranks)  # -1 -> a spare column, dropped
    mask = torch.zeros(T, num_ranks + 1, dtype=torch.bool, device=ids.device)
    return mask.scatter_(1, dest_TK, True)[:, :num_ranks]


def send_order(mask_TW: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rows to send, grouped by destination rank, tokens ascending within a rank.

    Returns (token_idx_S, rank_S, counts_W).
    Example: token_idx_S = [0, 1, 1, 2], rank_S = [0, 0, 2, 2], counts_W = [2, 0, 2].
    """
    rank_S, token_idx_S = mask_TW.t().nonzero(as_tuple=True)  # row-major over [W, T]: by rank, then token
    return token_idx_S, rank_S, mask_TW.sum(dim=0)


def local_slot_ids(topk_ids_SK: torch.Tensor, rank_S: torch.Tensor, slots_per_rank: int) -> torch.Tensor:
    """Each sent row's top-k ids as the destination rank's local slots; -1 where the slot lives elsewhere.

    Example: the rows [[0, 1], [1, 4], [1, 4], [5, -1]] going to ranks [0, 0, 2, 2]
             -> [[0, 1], [1, -1], [-1, 0], [1, -1]]   (int32)
    """
    ids = topk_ids_SK.long()
    first_S1 = (rank_S * slots_per_rank)[:, None]
    here = (ids >= first_S1) & (ids < first_S1 + slots_per_rank)
    return torch.where(here, ids - first_S1, -1).to(torch.int32)


def pack_routing(local_ids_SK: torch.Tensor, weights_SK: torch.Tensor) -> torch.Tensor:
    """ids and weights in one int32 tensor [S, 2K] so one all-to-all carries both (weights bit-cast from float32)."""
    return torch.cat([local_ids_SK.to(torch.int32), weights_SK.to(torch.float32).view(torch.int32)], dim=1)


def unpack_routing(packed_S2K: torch.Tensor, weight_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of pack_routing: (local_ids_SK int32, weights_SK in weight_dtype)."""
    K = packed_S2K.shape[1] // 2
    return packed_S2K[:, :K], packed_S2K[:, K:].contiguous().view(torch.float32).to(weight_dtype)


def sum_by_token(y_SH: torch.Tensor, token_idx_S: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """out_TH[t] = sum of the rows of y that came from token t, in float32.

    Example: y rows [a, b, c, d] for token_idx_S [0, 1, 1, 2] -> [a, b + c, d].
    """
    out_TH = torch.zeros(num_tokens, y_SH.shape[1], dtype=torch.float32, device=y_SH.device)
    return out_TH.index_add_(0, token_idx_S, y_SH.float())


def expert_rows_per_rank(topk_ids_TK: torch.Tensor, slots_per_rank: int, num_ranks: int) -> torch.Tensor:
    """Rows a per-expert dispatch (one copy per (token, expert)) would send to each rank: counts_W.

    Example: -> [3, 0, 2]   (token 0 twice to rank 0, token 1 once to ranks 0 and 2, token 2 once to rank 2)
    """
    ids = topk_ids_TK.reshape(-1).long()
    dest = ids[ids >= 0] // slots_per_rank
    return torch.bincount(dest, minlength=num_ranks)[:num_ranks]


def remote_node_rows(mask_TW: torch.Tensor, nodes_W: tuple[int, ...], me: int) -> torch.Tensor:
    """0-dim count of (token, node other than rank `me`'s) pairs where the token goes to some rank of that node;
    0 when all ranks share one node (nothing computed). Stays on mask's device (no host sync)."""
    ids = sorted(set(nodes_W))
    if len(ids) < 2:
        return torch.zeros((), dtype=torch.int64, device=mask_TW.device)
    node_W = torch.tensor([ids.index(n) for n in nodes_W], device=mask_TW.device)
    onehot_WN = torch.nn.functional.one_hot(node_W, len(ids)).to(torch.float32)
    reach_TN = mask_TW.to(torch.float32) @ onehot_WN > 0
    reach_TN[:, ids.index(nodes_W[me])] = False
    return reach_TN.sum()


def dispatch_volume(
    topk_ids_TK: torch.Tensor, src_rank_T: torch.Tensor, slots_per_rank: int, num_ranks: int
) -> dict[str, int]:
    """Rows crossing between ranks for a whole batch, analytically (no processes needed).

    topk_ids_TK: every token of the step (all source ranks together); src_rank_T: the rank each token is on.
    Returns dedup_remote_rows (sum over tokens of distinct remote destination ranks), dedup_local_rows
    (tokens that also go to their own rank: a local copy), naive_remote_rows ((token, expert) pairs with
    the expert on another rank). Multiply by H x element size for bytes.
    Example, all three tokens on rank 0: dedup_remote 2 (token 1 and 2 to rank 2), dedup_local 2,
    naive_remote 2 (expert 4 of token 1, expert 5 of token 2).
    """
    mask_TW = destination_mask(topk_ids_TK, slots_per_rank, num_ranks)
    own_TW = torch.zeros_like(mask_TW).scatter_(1, src_rank_T.long()[:, None], True)
    ids = topk_ids_TK.long()
    remote_TK = (ids >= 0) & (ids // slots_per_rank != src_rank_T.long()[:, None])
    return dict(
        dedup_remote_rows=int((mask_TW & ~own_TW).sum()),
        dedup_local_rows=int((mask_TW & own_TW).sum()),
        naive_remote_rows=int(remote_TK.sum()),
    )
