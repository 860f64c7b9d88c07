"""Small building blocks: RMSNorm, rotary embedding (plain and YaRN), the dense SiLU MLP.

Shapes: T = tokens in the step, N = heads, R = rope dims (qk_rope_head_dim), H = hidden size.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from moe_serve.kernels import ops
from moe_serve.kernels.ops import MLPWeights
from moe_serve.moe.config import ModelConfig, yarn_mscale
from moe_serve.moe.parallel_linear import MergedColumnParallelLinear, RowParallelLinear


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.rms_norm(x, self.weight, self.eps)


def rope_inv_freq(cfg: ModelConfig) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [R/2] and the cos/sin magnitude, for default rope or YaRN."""
    dim, theta = cfg.qk_rope_head_dim, cfg.rope_theta
    native_R2 = theta ** -(torch.arange(0, dim, 2, dtype=torch.float32) / dim)  # one frequency per rotated pair
    if cfg.rope_type == "default":
        return native_R2, 1.0
    yarn = cfg.rope_scaling
    stretch = yarn["factor"]
    context = yarn.get("original_max_position_embeddings") or cfg.max_position_embeddings
    weight_R2 = _yarn_stretch_weight(dim, theta, context, yarn.get("beta_fast") or 32, yarn.get("beta_slow") or 1,
                                     yarn.get("truncate", True))
    # YaRN: fast pairs (many turns over the original context) keep their frequency, slow ones are slowed by the
    # stretch factor, and the pairs between blend the two linearly in pair index.
    inv_freq_R2 = native_R2 * (1 - weight_R2) + (native_R2 / stretch) * weight_R2
    return inv_freq_R2, float(_yarn_attention_factor(yarn, stretch))


def _yarn_stretch_weight(dim: int, theta: float, context: int, fast_turns: float, slow_turns: float,
                         whole_pairs: bool) -> torch.Tensor:
    """[R/2] share of the stretched frequency per pair: 0 up to the pair that turns `fast_turns` times over
    `context` positions, 1 from the pair that turns `slow_turns` times, linear in between."""
    def pair_turning(turns: float) -> float:  # pair index (fractional) whose wavelength fits `turns` times
        return dim / 2 * math.log(context / (2 * math.pi * turns)) / math.log(theta)

    first, last = pair_turning(fast_turns), pair_turning(slow_turns)
    if whole_pairs:
        first, last = math.floor(first), math.ceil(last)
    first, last = max(first, 0), min(last, dim - 1)
    width = last - first if last != first else 1e-3  # a step, not a division by zero
    return ((torch.arange(dim // 2, dtype=torch.float32) - first) / width).clamp(0.0, 1.0)


def _yarn_attention_factor(yarn: dict, stretch: float) -> float:
    """The cos/sin magnitude: given, or DeepSeek's ratio of two mscales, or YaRN's own 0.1 ln(s) + 1."""
    if yarn.get("attention_factor") is not None:
        return yarn["attention_factor"]
    mscale, mscale_all_dim = yarn.get("mscale"), yarn.get("mscale_all_dim")
    if not (mscale and mscale_all_dim):
        return yarn_mscale(stretch)
    return yarn_mscale(stretch, mscale) / yarn_mscale(stretch, mscale_all_dim)


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

    def cos_sin(self, positions_T: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs_TR2 = positions_T.float()[:, None] * self.inv_freq[None, :]
        return freqs_TR2.cos() * self.attention_factor, freqs_TR2.sin() * self.attention_factor

    def forward(self, x_TNR: torch.Tensor, cos_TR2: torch.Tensor, sin_TR2: torch.Tensor) -> torch.Tensor:
        return ops.rope(x_TNR, cos_TR2, sin_TR2, self.interleaved)


class MLP(nn.Module):
    """Dense SiLU-gated MLP (the first dense layers and the shared experts), tensor-parallel over
    `tp_group` by intermediate columns; gate and up projections are one weight (gate rows, then up rows).
    With `reduce=False` it returns this rank's partial sum."""

    def __init__(self, hidden_size: int, intermediate_size: int, tp_group=None, reduce: bool = True,
                 fp8_block: tuple[int, int] | None = None):
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [intermediate_size] * 2, ("gate_proj", "up_proj"),
                                                       tp_group, fp8_block)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, tp_group, reduce=reduce, fp8_block=fp8_block)

    def weights(self) -> MLPWeights:
        return MLPWeights(self.gate_up_proj.weight, self.down_proj.weight, self.gate_up_proj.weight_scale_inv,
                          self.down_proj.weight_scale_inv)

    def forward(self, x_TH: torch.Tensor) -> torch.Tensor:
        return self.down_proj(ops.silu_and_mul(self.gate_up_proj(x_TH)))
