"""The align step of the Triton MoE path: group token-expert pairs by expert in blocks of block_m rows.

Legend (shape suffixes):
  T tokens, K top-k slots, N = T * K pairs (pair n is token n // K, slot n % K), E experts,
  P padded slots = round_up(N + E * (block_m - 1), block_m) (room for the worst-case padding),
  B = P // block_m blocks.

Worked example: topk_ids = [[2, 0], [-1, 2], [0, 2]] (T=3, K=2, so pairs 0..5), E=4, block_m=2.
  expert 0 has pairs 1, 4      -> one full block  [1, 4]
  expert 1 has none            -> no block
  expert 2 has pairs 0, 3, 5   -> two blocks      [0, 3], [5, 6]   (6 = N is the padding sentinel)
  expert 3 has none; pair 2 (id -1) is on another rank and is left out.
  sorted_token_ids = [1, 4, 0, 3, 5, 6, 6, 6, 6, 6]   (P = round_up(6 + 4 * 1, 2) = 10)
  expert_ids       = [0, 2, 2, -1, -1]                (-1: block past the end)
  num_tokens_post_padded = [6]
Everything stays on the ids' device with no host sync, so the kernels can be captured in a CUDA graph.
"""

from __future__ import annotations

import torch


def moe_align_block_size(topk_ids_TK: torch.Tensor, block_m: int, num_experts: int):
    """topk_ids [T, K] -> (sorted_token_ids [P] int32, expert_ids [B] int32, num_tokens_post_padded [1] int32).

    Ids outside [0, num_experts) (the -1 "not on this rank" ids) are left out.
    """
    if block_m <= 0 or num_experts <= 0:
        raise ValueError(f"block_m ({block_m}) and num_experts ({num_experts}) must be positive")
    E, device = num_experts, topk_ids_TK.device
    ids_N = topk_ids_TK.reshape(-1).long()
    N = ids_N.numel()
    P = (N + E * (block_m - 1) + block_m - 1) // block_m * block_m

    bucket_N = torch.where((ids_N >= 0) & (ids_N < E), ids_N, E)  # bucket E: left out
    counts_E1 = torch.zeros(E + 1, dtype=torch.long, device=device).scatter_add_(0, bucket_N, torch.ones_like(ids_N))
    start_E1 = torch.cumsum(counts_E1, 0) - counts_E1  # where each bucket starts in sorted order
    padded_E = (counts_E1[:E] + block_m - 1) // block_m * block_m
    padded_end_E = torch.cumsum(padded_E, 0)
    padded_start_E1 = torch.cat([padded_end_E - padded_E, torch.full((1,), P, device=device)])  # bucket E -> slot P

    sorted_bucket_N, order_N = torch.sort(bucket_N, stable=True)
    rank_N = torch.arange(N, device=device) - start_E1[sorted_bucket_N]
    dest_N = torch.where(sorted_bucket_N < E, padded_start_E1[sorted_bucket_N] + rank_N, P)
    sorted_token_ids_P = torch.full((P + 1,), N, dtype=torch.int32, device=device)
    sorted_token_ids_P.scatter_(0, dest_N, order_N.to(torch.int32))  # slot P is a dump, cut off below

    block_start_B = torch.arange(0, P, block_m, device=device)
    expert_ids_B = torch.searchsorted(padded_end_E, block_start_B, right=True)
    expert_ids_B = torch.where(expert_ids_B < E, expert_ids_B, -1).to(torch.int32)
    return sorted_token_ids_P[:P], expert_ids_B, padded_end_E[-1:].to(torch.int32)
