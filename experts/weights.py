"""Routed-expert weights of one MoE layer, stacked per local slot for the grouped GEMM.

Legend: S = local expert slots, I = moe_intermediate_size (this rank's share of it under tensor
parallelism), H = hidden size. `w13 [S, 2I, H]` holds each slot's gate rows then up rows;
`w2 [S, H, I]` its down projection. Slot s of this rank holds logical expert `slot_to_expert[s]`.
"""

from __future__ import annotations

import torch
from torch import nn


class ExpertWeights(nn.Module):
    def __init__(self, slot_to_expert: list[int], hidden_size: int, intermediate_size: int,
                 tp_rank: int = 0, tp_size: int = 1):
        super().__init__()
        if intermediate_size % tp_size:
            raise ValueError(f"tensor parallel size {tp_size} does not divide moe_intermediate_size {intermediate_size}")
        self.slot_to_expert = list(slot_to_expert)
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.intermediate_size = I = intermediate_size // tp_size
        S = len(self.slot_to_expert)
        self.w13 = nn.Parameter(torch.empty(S, 2 * I, hidden_size), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(S, hidden_size, I), requires_grad=False)

    @property
    def num_slots(self) -> int:
        return len(self.slot_to_expert)

    def slots_of(self, expert: int) -> list[int]:
        return [s for s, e in enumerate(self.slot_to_expert) if e == expert]

    def load_projection(self, slot: int, proj: str, weight: torch.Tensor) -> None:
        """Copy this rank's share of one checkpoint matrix (gate_proj / up_proj / down_proj) into a slot."""
        I, r = self.intermediate_size, self.tp_rank
        full_I = I * self.tp_size
        if proj == "down_proj":
            want, target = (self.w2.shape[1], full_I), self.w2.data[slot]
            share = weight[:, r * I:(r + 1) * I] if tuple(weight.shape) == want else None
        else:
            want = (full_I, self.w13.shape[2])
            target = self.w13.data[slot, :I] if proj == "gate_proj" else self.w13.data[slot, I:]
            share = weight[r * I:(r + 1) * I] if tuple(weight.shape) == want else None
        if share is None:
            raise ValueError(f"expert {proj} has shape {tuple(weight.shape)}, expected {want}")
        target.copy_(share)
