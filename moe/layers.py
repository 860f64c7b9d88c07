"""Small building blocks: RMSNorm, rotary embedding (plain and YaRN), the dense SiLU MLP.

Shapes: T = tokens in the step, N = heads, R = rope dims (qk_rope_head_dim), H = hidden size.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from moe_serve.kernels import cpu_ops
from moe_serve.moe.config import ModelConfig, yarn_mscale
from moe_serve.moe.parallel_linear import ColumnParallelLinear, RowParallelLinear


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.use_cpu_kernel = False  # set where bf16 weights compute in float32 (kernels/cpu_ops.py)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.use_cpu_kernel:
            return cpu_ops.rms_norm(x, self.weight, self.eps)
        return cpu_ops.rms_norm_reference(x, self.weight, self.eps)


def rope_inv_freq(cfg: ModelConfig) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [R/2] and the cos/sin magnitude, for default rope or YaRN."""
    dim, base = cfg.qk_rope_head_dim, cfg.rope_theta
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    if cfg.rope_type == "default":
        return 1.0 / pos_freqs, 1.0
    rs = cfg.rope_scaling
    factor = rs["factor"]
    mscale, mscale_all_dim = rs.get("mscale"), rs.get("mscale_all_dim")
    attention_factor = rs.get("attention_factor")
    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
        else:
            attention_factor = yarn_mscale(factor)
    beta_fast, beta_slow = rs.get("beta_fast") or 32, rs.get("beta_slow") or 1
    original_max = rs.get("original_max_position_embeddings") or cfg.max_position_embeddings

    def correction_dim(num_rotations: float) -> float:
        return dim * math.log(original_max / (num_rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if rs.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, float(attention_factor)


class RotaryEmbedding(nn.Module):
    """Rotates the rope part of queries and keys by position.

    Interleaved rope (DeepSeek's native layout) rotates pairs (x[2i], x[2i+1]); the plain one rotates
    (x[i], x[i + R/2]). Either way the output is laid out as [first of each pair, second of each pair],
    the same for queries and keys, so their dot products are those of the reference.
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        inv_freq, self.attention_factor = rope_inv_freq(cfg)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.interleaved = cfg.rope_interleave
        self.use_cpu_kernel = False  # set where bf16 weights compute in float32 (kernels/cpu_ops.py)

    def cos_sin(self, positions_T: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs_TR2 = positions_T.float()[:, None] * self.inv_freq[None, :]
        return freqs_TR2.cos() * self.attention_factor, freqs_TR2.sin() * self.attention_factor

    def forward(self, x_TNR: torch.Tensor, cos_TR2: torch.Tensor, sin_TR2: torch.Tensor) -> torch.Tensor:
        if self.use_cpu_kernel:
            return cpu_ops.rope(x_TNR, cos_TR2, sin_TR2, self.interleaved)
        return cpu_ops.rope_reference(x_TNR, cos_TR2, sin_TR2, self.interleaved)


class MLP(nn.Module):
    """Dense SiLU-gated MLP (the first dense layers and the shared experts), tensor-parallel over
    `tp_group` by intermediate columns. With `reduce=False` it returns this rank's partial sum."""

    def __init__(self, hidden_size: int, intermediate_size: int, tp_group=None, reduce: bool = True):
        super().__init__()
        self.gate_proj = ColumnParallelLinear(hidden_size, intermediate_size, tp_group)
        self.up_proj = ColumnParallelLinear(hidden_size, intermediate_size, tp_group)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, tp_group, reduce=reduce)
        self.w13: torch.Tensor | None = None  # set by hold_gate_up_together

    def hold_gate_up_together(self) -> None:
        """Hold the gate and up weights as one tensor (gate rows, then up rows; the two linears' weights become
        views of it) and the down weight contiguous, for the CPU kernels that run an MLP in one call. Once."""
        if self.w13 is not None:
            return
        self.w13 = torch.cat([self.gate_proj.weight.data, self.up_proj.weight.data]).contiguous()
        rows = self.gate_proj.weight.shape[0]
        self.gate_proj.weight.data, self.up_proj.weight.data = self.w13[:rows], self.w13[rows:]
        self.down_proj.weight.data = self.down_proj.weight.data.contiguous()

    def forward(self, x_TH: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x_TH)) * self.up_proj(x_TH))
