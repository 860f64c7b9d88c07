"""Tensor-parallel layers. Each receives its group (`parallel.comm.Group`) and issues its own collective.

A `None` group (or a group of one) means no tensor parallelism: the layers are plain ones. Every
sharded parameter carries `shard_dim`, `shard_rank` and `shard_size`, so the loader slices the full
checkpoint tensor it reads (see `shard_for`).
Legend: T = tokens, I/O = in/out features, V = vocabulary, H = hidden size.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from moe_serve.kernels import cpu_linear
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


class PackedLinear(nn.Module):
    """Base of the linear layers: after loading, `pack_weight()` keeps a oneDNN-packed copy of a bf16 CPU
    weight that `_linear` then uses (kernels/cpu_linear.py); elsewhere it is F.linear."""

    packed: torch.Tensor | None = None

    def pack_weight(self) -> None:
        self.packed = cpu_linear.pack(self.weight.detach())

    def _linear(self, x_TI: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return cpu_linear.linear(x_TI, self.weight, self.packed, bias)


class ReplicatedLinear(PackedLinear):
    """y = x W^T with the whole W on every rank (no bias: DeepSeek's low-rank projections have none)."""

    def __init__(self, in_features: int, out_features: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)

    def forward(self, x_TI: torch.Tensor) -> torch.Tensor:
        return self._linear(x_TI)


class ColumnParallelLinear(PackedLinear):
    """y = x W^T with W's output rows split over the group; each rank keeps its slice of y."""

    def __init__(self, in_features: int, out_features: int, group=None, bias: bool = False):
        super().__init__()
        rank, size = group_rank_size(group)
        if out_features % size:
            raise ValueError(f"tensor parallel size {size} does not divide {out_features} output features")
        self.weight = _mark(nn.Parameter(torch.empty(out_features // size, in_features), requires_grad=False), 0, rank, size)
        self.bias = _mark(nn.Parameter(torch.empty(out_features // size), requires_grad=False), 0, rank, size) if bias else None

    def forward(self, x_TI: torch.Tensor) -> torch.Tensor:
        return self._linear(x_TI, self.bias)


class RowParallelLinear(PackedLinear):
    """y = x W^T with W's input columns split over the group; partial sums are all-reduced
    (unless `reduce=False`: the caller reduces once for several partial sums). No bias: DeepSeek
    models have none here."""

    def __init__(self, in_features: int, out_features: int, group=None, reduce: bool = True):
        super().__init__()
        self.group, self.reduce = group, reduce
        rank, size = group_rank_size(group)
        if in_features % size:
            raise ValueError(f"tensor parallel size {size} does not divide {in_features} input features")
        self.weight = _mark(nn.Parameter(torch.empty(out_features, in_features // size), requires_grad=False), 1, rank, size)

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
            return F.embedding(ids_T, self.weight)
        local_T = ids_T - self.start
        outside_T = (local_T < 0) | (local_T >= self.per_rank)
        x_TH = F.embedding(local_T.masked_fill(outside_T, 0), self.weight)
        x_TH = x_TH.masked_fill(outside_T[:, None], 0)
        return all_reduce(x_TH, self.group)


class ParallelLMHead(PackedLinear):
    """Vocabulary-parallel output projection; logits are gathered so every rank sees all of them."""

    def __init__(self, hidden_size: int, vocab_size: int, group=None):
        super().__init__()
        self.group = group
        rank, size = group_rank_size(group)
        if vocab_size % size:
            raise ValueError(f"tensor parallel size {size} does not divide the vocabulary of {vocab_size}")
        self.weight = _mark(nn.Parameter(torch.empty(vocab_size // size, hidden_size), requires_grad=False), 0, rank, size)

    def forward(self, x_TH: torch.Tensor) -> torch.Tensor:
        logits_TV = self._linear(x_TH)
        return logits_TV if self.group is None else comm.all_gather(logits_TV, self.group, dim=-1)
