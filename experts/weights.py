"""Routed-expert weights of one MoE layer, stacked per local slot for the grouped GEMM.

Legend: S = local expert slots, I = moe_intermediate_size (this rank's share of it under tensor
parallelism), H = hidden size. `w13 [S, 2I, H]` holds each slot's gate rows then up rows;
`w2 [S, H, I]` its down projection. Slot s of this rank holds logical expert `slot_to_expert[s]`.
A block-FP8 checkpoint keeps them float8_e4m3fn with their block scales (bn x bk blocks):
`w13_scale_inv [S, 2I/bn, ceil(H/bk)]`, `w2_scale_inv [S, ceil(H/bn), ceil(I/bk)]`.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from moe_serve.kernels.ops import MLPWeights
from moe_serve.kernels.reference import FP8_DTYPE


class ExpertWeights(nn.Module):
    def __init__(self, slot_to_expert: list[int], hidden_size: int, intermediate_size: int,
                 tp_rank: int = 0, tp_size: int = 1, fp8_block: tuple[int, int] | None = None):
        super().__init__()
        if intermediate_size % tp_size:
            raise ValueError(f"tensor parallel size {tp_size} does not divide moe_intermediate_size {intermediate_size}")
        self.slot_to_expert = list(slot_to_expert)
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.intermediate_size = I = intermediate_size // tp_size
        self.fp8_block = fp8_block
        S, H = len(self.slot_to_expert), hidden_size
        dtype = FP8_DTYPE if fp8_block else None
        self.w13 = nn.Parameter(torch.empty(S, 2 * I, H, dtype=dtype), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(S, H, I, dtype=dtype), requires_grad=False)
        if not fp8_block:
            self.w13_scale_inv = self.w2_scale_inv = None
            return
        bn, bk = fp8_block
        if I % bn or (tp_size > 1 and I % bk):
            raise ValueError(f"FP8 block {list(fp8_block)} does not divide the experts' intermediate size {I} "
                             f"(per tensor-parallel rank): gate and up rows are stacked at whole blocks")
        self.w13_scale_inv = nn.Parameter(torch.empty(S, 2 * I // bn, math.ceil(H / bk), dtype=torch.float32),
                                          requires_grad=False)
        self.w2_scale_inv = nn.Parameter(torch.empty(S, math.ceil(H / bn), math.ceil(I / bk), dtype=torch.float32),
                                         requires_grad=False)

    @property
    def num_slots(self) -> int:
        return len(self.slot_to_expert)

    def weights(self) -> MLPWeights:
        return MLPWeights(self.w13, self.w2, self.w13_scale_inv, self.w2_scale_inv)

    def slot_tensors(self) -> list[torch.Tensor]:
        """Everything a slot holds (what moves when its expert changes)."""
        return [t.data for t in (self.w13, self.w2, self.w13_scale_inv, self.w2_scale_inv) if t is not None]

    def slots_of(self, expert: int) -> list[int]:
        return [s for s, e in enumerate(self.slot_to_expert) if e == expert]

    def load_projection(self, slot: int, proj: str, weight: torch.Tensor, scale: bool = False) -> None:
        """Copy this rank's share of one checkpoint matrix (gate_proj / up_proj / down_proj), or of its FP8
        block scales (`scale`), into a slot."""
        I, r, tp = self.intermediate_size, self.tp_rank, self.tp_size
        bn, bk = self.fp8_block if scale else (1, 1)  # a scale holds one entry per block
        rows, cols = I // bn, I // bk  # this rank's share of I, in the tensor's own units
        H = self.w2.shape[1]
        if proj == "down_proj":
            target = (self.w2_scale_inv if scale else self.w2).data[slot]
            want = (math.ceil(H / bn), math.ceil(I * tp / bk))
            share = None if tuple(weight.shape) != want else (weight if tp == 1 else weight[:, r * cols:(r + 1) * cols])
        else:
            whole = (self.w13_scale_inv if scale else self.w13).data[slot]
            target = whole[:rows] if proj == "gate_proj" else whole[rows:]
            want = (rows * tp, math.ceil(H / bk))
            share = weight[r * rows:(r + 1) * rows] if tuple(weight.shape) == want else None
        if share is None:
            what = "scales" if scale else "weight"
            raise ValueError(f"expert {proj} {what} has shape {tuple(weight.shape)}, expected {want}")
        target.copy_(share)
