"""Routed-expert weights of one MoE layer, stacked per local slot for the grouped GEMM.

Legend: S = local expert slots, I = moe_intermediate_size, H = hidden size.
`w13_SIH [S, 2I, H]` holds each slot's gate rows then up rows; `w2_SHI [S, H, I]` its down projection.
"""

from __future__ import annotations

import torch
from torch import nn


class ExpertWeights(nn.Module):
    def __init__(self, num_slots: int, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.num_slots, self.intermediate_size = num_slots, intermediate_size
        self.w13 = nn.Parameter(torch.empty(num_slots, 2 * intermediate_size, hidden_size), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(num_slots, hidden_size, intermediate_size), requires_grad=False)
        self.slot_to_expert: list[int] = list(range(num_slots))  # logical expert held by each local slot

    def slots_of(self, expert: int) -> list[int]:
        return [s for s, e in enumerate(self.slot_to_expert) if e == expert]

    def load_projection(self, slot: int, proj: str, weight: torch.Tensor) -> None:
        """Copy one checkpoint matrix (gate_proj / up_proj / down_proj) into its slot."""
        I = self.intermediate_size
        target = {"gate_proj": self.w13.data[slot, :I], "up_proj": self.w13.data[slot, I:], "down_proj": self.w2.data[slot]}[proj]
        if tuple(weight.shape) != tuple(target.shape):
            raise ValueError(f"expert {proj} has shape {tuple(weight.shape)}, expected {tuple(target.shape)}")
        target.copy_(weight)
