"""bf16 linear layers on CPU through oneDNN, with each weight packed once after loading.

`F.linear` on a bf16 CPU weight re-lays the weight out for oneDNN (or falls back to a slow path) on every
call; at decode sizes (a few rows) that costs more than the product. oneDNN's packed linear
(`torch.ops.mkldnn._reorder_linear_weight` once, `_linear_pointwise` per call, as torch's own CPU
freezing pass does) gives the same result, 1.2-1.25x faster per 512x512 weight at 1-64 rows, one thread,
beyond cache (scripts/bench_linear.py; docs/benchmarks.md). The torch reference is F.linear.

Legend: T rows, I in features, O out features.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from moe_serve.kernels import cpu_bf16w


def can_pack(weight_OI: torch.Tensor) -> bool:
    """Whether this weight takes the packed path: a 2-D bf16 tensor on CPU, with oneDNN's bf16 available."""
    return (weight_OI.device.type == "cpu" and weight_OI.dtype == torch.bfloat16 and weight_OI.dim() == 2
            and bf16_supported())


def bf16_supported() -> bool:
    """oneDNN's bf16 linear needs AVX512 (BW/VL/DQ) or AVX-NE-CONVERT; on an AVX2-only CPU it refuses."""
    return (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
            and torch.ops.mkldnn._is_mkldnn_bf16_supported())


def pack(weight_OI: torch.Tensor) -> torch.Tensor | None:
    """The weight in oneDNN's layout (a copy), or None where `can_pack` says no."""
    if not can_pack(weight_OI):
        return None
    return torch.ops.mkldnn._reorder_linear_weight(weight_OI.contiguous(), 1)


def linear(x_TI: torch.Tensor, weight_OI: torch.Tensor, packed: torch.Tensor | None,
           bias_O: torch.Tensor | None = None) -> torch.Tensor:
    """x W^T (+ b), through the packed weight when there is one (and x matches its dtype); for float32 x and
    a bf16 weight (bf16 on a CPU without bf16 arithmetic), through kernels/cpu_bf16w.py; else F.linear."""
    if x_TI.device.type == "cpu" and x_TI.dtype == torch.float32 and weight_OI.dtype == torch.bfloat16:
        return cpu_bf16w.linear(x_TI, weight_OI, bias_O)
    if packed is None or x_TI.dtype != weight_OI.dtype or x_TI.device.type != "cpu":
        return F.linear(x_TI, weight_OI, bias_O)
    rows_TI = x_TI.reshape(-1, x_TI.shape[-1]).contiguous()
    y = torch.ops.mkldnn._linear_pointwise(rows_TI, packed, bias_O, "none", [], "")
    return y.view(*x_TI.shape[:-1], weight_OI.shape[0])
