"""One decoder layer's weights, described for a backend's whole-layer fast path (`ops.fused_decode_layer`).

The model fills it after loading (moe/model.py DecoderLayer.kernel_spec); the tensors are the modules' own
(no copies). A backend that can run the layer in one call returns a callable; others return None and the
layer runs module by module.
Legend: H hidden, N heads, C kv_lora_rank, Dn / Dv nope / value head dims, E experts.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moe_serve.kernels.ops import MLPWeights
from moe_serve.kernels.routing import RouterConfig


@dataclass
class Linear:
    weight: torch.Tensor  # [out, in]
    scale_inv: torch.Tensor | None = None  # block-FP8 scales, None for other weights


@dataclass
class Norm:
    weight: torch.Tensor
    eps: float


@dataclass
class DecoderLayerSpec:
    in_norm: Norm
    q_a: Linear | None  # None without q compression: then q_b is q_proj
    q_a_norm: Norm | None
    q_b: Linear
    kv_a: Linear
    kv_a_norm: Norm
    w_uk_NCD: torch.Tensor
    w_uv_NVC: torch.Tensor  # may be a view of kv_b_proj's weight (unit stride in C, not contiguous over N)
    w_uk_scale: torch.Tensor | None  # their block-FP8 scales [N, C/b, Dn/b] and [N, Dv/b, C/b], or None
    w_uv_scale: torch.Tensor | None
    o: Linear
    softmax_scale: float
    rope_interleaved: bool
    post_norm: Norm
    router: RouterConfig | None  # None: a dense layer
    gate_EH: torch.Tensor | None
    gate_bias_E: torch.Tensor | None
    experts: MLPWeights | None
    mlp: MLPWeights | None  # the shared experts of a MoE layer, or the dense MLP
    fp8_block: tuple[int, int] | None
    parallel: bool  # tensor or expert parallel: the layer's collectives run between its ops
