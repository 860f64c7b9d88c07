"""Tensor-parallel layers. Each receives its group (`parallel.comm.Group`) and issues its own collective.

A `None` group (or a group of one) means no tensor parallelism: the layers are plain ones. Every
sharded parameter carries `shard_dim`, `shard_rank` and `shard_size`, so the loader slices the full
checkpoint tensor it reads (see `shard_for`).
Legend: T = tokens, I/O = in/out features, V = vocabulary, H = hidden size.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from moe_serve.kernels import ops
from moe_serve.kernels.reference import FP8_DTYPE
from moe_serve.parallel import comm


def group_rank_size(group: comm.Group | None) -> tuple[int, int]:
    return (0, 1) if group is None else (group.index, group.size)


def _mark(param: nn.Parameter, dim: int, rank: int, size: int) -> nn.Parameter:
    param.shard_dim, param.shard_rank, param.shard_size = dim, rank, size
    return param


def shard_for(param: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
    """The slice of a full checkpoint tensor that this rank's parameter holds."""
    size = getattr(param, "shard_size", 1)
    if size == 1:
        return full
    dim, rank = param.shard_dim, param.shard_rank
    if full.shape[dim] % size:
        raise ValueError(f"dimension {dim} of size {full.shape[dim]} does not split over {size} tensor-parallel ranks")
    step = full.shape[dim] // size
    return full.narrow(dim, rank * step, step)


def all_reduce(x: torch.Tensor, group: comm.Group | None) -> torch.Tensor:
    return x if group is None else comm.all_reduce(x, group)


class LinearBase(nn.Module):
    """A linear layer's weight [O, I] (this rank's share) and, for a block-FP8 checkpoint (`fp8_block` =
    (bn, bk)), the weight in float8_e4m3fn with its per-block scales `weight_scale_inv` [ceil(O/bn),
    ceil(I/bk)], named as in the checkpoint. The kernel backend (kernels/ops.py) computes x W^T."""

    def _make_weight(self, out_features: int, in_features: int, fp8_block: tuple[int, int] | None,
                     shard_dim: int = 0, rank: int = 0, size: int = 1) -> None:
        dtype = FP8_DTYPE if fp8_block else None
        self.weight = _mark(nn.Parameter(torch.empty(out_features, in_features, dtype=dtype), requires_grad=False),
                            shard_dim, rank, size)
        if not fp8_block:
            self.register_parameter("weight_scale_inv", None)
            return
        bn, bk = fp8_block
        if size > 1 and (out_features, in_features)[shard_dim] % (bn, bk)[shard_dim]:
            raise ValueError(f"FP8 block {list(fp8_block)} does not divide the {(out_features, in_features)[shard_dim]} "
                             f"{('output', 'input')[shard_dim]} features each of {size} tensor-parallel ranks holds; "
                             f"use a tensor-parallel size that keeps whole blocks")
        scale = torch.empty(math.ceil(out_features / bn), math.ceil(in_features / bk), dtype=torch.float32)
        self.weight_scale_inv = _mark(nn.Parameter(scale, requires_grad=False), shard_dim, rank, size)

    def _linear(self, x_TI: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return ops.linear(x_TI, self.weight, self.weight_scale_inv, bias)


class ReplicatedLinear(LinearBase):
    """y = x W^T with the whole W on every rank (no bias: DeepSeek's low-rank projections have none)."""

    def __init__(self, in_features: int, out_features: int, fp8_block: tuple[int, int] | None = None):
        super().__init__()
        self._make_weight(out_features, in_features, fp8_block)

    def forward(self, x_TI: torch.Tensor) -> torch.Tensor:
        return self._linear(x_TI)


class ColumnParallelLinear(LinearBase):
    """y = x W^T with W's output rows split over the group; each rank keeps its slice of y."""

    def __init__(self, in_features: int, out_features: int, group=None, bias: bool = False,
                 fp8_block: tuple[int, int] | None = None):
        super().__init__()
        rank, size = group_rank_size(group)
        if out_features % size:
            raise ValueError(f"tensor parallel size {size} does not divide {out_features} output features")
        self._make_weight(out_features // size, in_features, fp8_block, 0, rank, size)
        self.bias = _mark(nn.Parameter(torch.empty(out_features // size), requires_grad=False), 0, rank, size) if bias else None

    def forward(self, x_TI: torch.Tensor) -> torch.Tensor:
        return self._linear(x_TI, self.bias)


class MergedColumnParallelLinear(LinearBase):
    """Several column-parallel linears of one input as one weight (a MLP's gate and up projections): each
    part's rows are split over the group, and this rank holds its share of part 0, then of part 1, ...
    The checkpoint stores the parts as separate tensors, named `part_names` beside this module; the loader
    places each with `load_part`."""

    def __init__(self, in_features: int, part_features: list[int], part_names: tuple[str, ...], group=None,
                 fp8_block: tuple[int, int] | None = None):
        super().__init__()
        self.part_names = tuple(part_names)
        self.rank, size = group_rank_size(group)
        self.tp_size = size
        if any(n % size for n in part_features):
            raise ValueError(f"tensor parallel size {size} does not divide the output features {part_features}")
        self.part_rows = [n // size for n in part_features]
        if fp8_block and any(rows % fp8_block[0] for rows in self.part_rows):
            raise ValueError(f"FP8 block {list(fp8_block)} does not split the stacked projections of "
                             f"{self.part_rows} rows per rank at whole blocks; the checkpoint needs a block size "
                             f"that divides them")
        self.fp8_block = fp8_block
        self._make_weight(sum(self.part_rows), in_features, fp8_block)

    def load_part(self, part: int, full: torch.Tensor, scale: bool = False) -> None:
        """Copy this rank's share of part `part` (a full checkpoint weight, or its block scales) into place."""
        unit = self.fp8_block[0] if scale else 1  # scales hold one row per block of rows
        rows = self.part_rows[part] // unit
        first = sum(self.part_rows[:part]) // unit
        target = (self.weight_scale_inv if scale else self.weight).data
        want = (rows * self.tp_size, target.shape[1])
        if tuple(full.shape) != want:
            raise ValueError(f"has shape {tuple(full.shape)}, the model expects {want}")
        target[first:first + rows].copy_(full[self.rank * rows:(self.rank + 1) * rows])

    def forward(self, x_TI: torch.Tensor) -> torch.Tensor:
        return self._linear(x_TI)


class RowParallelLinear(LinearBase):
    """y = x W^T with W's input columns split over the group; partial sums are all-reduced
    (unless `reduce=False`: the caller reduces once for several partial sums). No bias: DeepSeek
    models have none here."""

    def __init__(self, in_features: int, out_features: int, group=None, reduce: bool = True,
                 fp8_block: tuple[int, int] | None = None):
        super().__init__()
        self.group, self.reduce = group, reduce
        rank, size = group_rank_size(group)
        if in_features % size:
            raise ValueError(f"tensor parallel size {size} does not divide {in_features} input features")
        self._make_weight(out_features, in_features // size, fp8_block, 1, rank, size)

    def forward(self, x_TI: torch.Tensor) -> torch.Tensor:
        y_TO = self._linear(x_TI)
        return all_reduce(y_TO, self.group) if self.reduce else y_TO


class VocabParallelEmbedding(nn.Module):
    """Each rank holds a contiguous range of vocabulary rows; rows owned elsewhere embed to 0, then
    one all-reduce assembles every token's embedding."""

    def __init__(self, vocab_size: int, hidden_size: int, group=None):
        super().__init__()
        self.group = group
        rank, size = group_rank_size(group)
        if vocab_size % size:
            raise ValueError(f"tensor parallel size {size} does not divide the vocabulary of {vocab_size}")
        self.per_rank = vocab_size // size
        self.start = rank * self.per_rank
        self.weight = _mark(nn.Parameter(torch.empty(self.per_rank, hidden_size), requires_grad=False), 0, rank, size)

    def forward(self, ids_T: torch.Tensor) -> torch.Tensor:
        if group_rank_size(self.group)[1] == 1:
            return ops.embedding(ids_T, self.weight)
        local_T = ids_T - self.start
        outside_T = (local_T < 0) | (local_T >= self.per_rank)
        x_TH = ops.embedding(local_T.masked_fill(outside_T, 0), self.weight)
        x_TH = x_TH.masked_fill(outside_T[:, None], 0)
        return all_reduce(x_TH, self.group)


class ParallelLMHead(LinearBase):
    """Vocabulary-parallel output projection; logits are gathered so every rank sees all of them."""

    def __init__(self, hidden_size: int, vocab_size: int, group=None):
        super().__init__()
        self.group = group
        rank, size = group_rank_size(group)
        if vocab_size % size:
            raise ValueError(f"tensor parallel size {size} does not divide the vocabulary of {vocab_size}")
        self._make_weight(vocab_size // size, hidden_size, None, 0, rank, size)  # never FP8 in DeepSeek's checkpoints

    def forward(self, x_TH: torch.Tensor) -> torch.Tensor:
        logits_TV = self._linear(x_TH)
        return logits_TV if self.group is None else comm.all_gather(logits_TV, self.group, dim=-1)
