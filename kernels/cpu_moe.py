"""Routed experts with bf16 or block-FP8 weights and float32 activations on CPU in one C call
(csrc/moe_bf16w.cpp, the torch op moe_serve::fused_moe): how `--dtype bfloat16` runs its experts on a CPU
without bf16 arithmetic (the cpu kernel backend, kernels/backend_cpu.py).

The torch path (kernels/fused_moe_torch.py) costs a sort, a host sync, a gather and a Python loop of
GEMMs per call; at decode sizes those ops cost more than the arithmetic. The kernel counts pairs into
expert order, gathers, multiplies and scatters in C. Its reference is kernels.reference.fused_moe_reference
on the widened (or dequantised) weights; results differ from it only by float32 summation order.

FP8 experts: float8_e4m3fn w13 [E, 2I, H] and w2 [E, H, I] with float32 block scales [E, ceil(2I / bo),
ceil(H / bk)] and [E, ceil(H / bo), ceil(I / bk)] for block = (bo, bk), both multiples of 8 (DeepSeek-V3:
(128, 128)); a shared expert's as [ceil(2S / bo), ceil(H / bk)] and [ceil(H / bo), ceil(S / bk)].

Legend: T tokens, H hidden size, I expert intermediate size, E experts on this rank, K top-k slots,
S shared expert intermediate size.
"""

from __future__ import annotations

import torch

from moe_serve.kernels import cpu_build


def _weight_fits(w: torch.Tensor, scale: torch.Tensor | None) -> bool:
    narrow = torch.bfloat16 if scale is None else torch.float8_e4m3fn
    return w.dtype == narrow and w.is_cpu and w.stride(-1) == 1


def fits(x_TH: torch.Tensor, w13_E2IH: torch.Tensor, w2_EHI: torch.Tensor, w13_scale: torch.Tensor | None = None,
         w2_scale: torch.Tensor | None = None) -> bool:
    """float32 x with unit column stride, and bf16 expert weights, or FP8 ones with their scales, with unit
    stride in their last dims, on CPU, and the kernels built. (The op checks the shapes.)"""
    return (x_TH.dtype == torch.float32 and x_TH.is_cpu and x_TH.stride(1) == 1
            and _weight_fits(w13_E2IH, w13_scale) and _weight_fits(w2_EHI, w2_scale) and cpu_build.available())


def fused_moe_bf16w(x_TH: torch.Tensor, w13_E2IH: torch.Tensor, w2_EHI: torch.Tensor,
                    topk_weights_TK: torch.Tensor, topk_ids_TK: torch.Tensor,
                    shared_w13_2SH: torch.Tensor | None = None, shared_w2_HS: torch.Tensor | None = None, *,
                    w13_scale: torch.Tensor | None = None, w2_scale: torch.Tensor | None = None,
                    shared_w13_scale: torch.Tensor | None = None, shared_w2_scale: torch.Tensor | None = None,
                    block: tuple[int, int] | None = None) -> torch.Tensor:
    """kernels.fused_moe for inputs that `fits`; float32 [T, H]. With the shared expert's weights (gate rows
    then up rows [2S, H], down [H, S]) its output is added for every token, as DeepSeek's MoE block adds its
    shared experts. FP8 weights come with their scales and `block`; the op checks every shape (ValueError)."""
    T, H = x_TH.shape
    out_TH = x_TH.new_empty(T, H)
    scaled = any(s is not None for s in (w13_scale, w2_scale, shared_w13_scale, shared_w2_scale))
    if scaled and block is None:
        raise ValueError("FP8 expert weights need their block shape (block=(rows, cols)) with their scales")
    torch.ops.moe_serve.fused_moe(x_TH, w13_E2IH, w2_EHI, topk_weights_TK.to(torch.float32).contiguous(),
                                  topk_ids_TK.to(torch.int64).contiguous(), shared_w13_2SH, shared_w2_HS, w13_scale,
                                  w2_scale, shared_w13_scale, shared_w2_scale, list(block) if scaled else [], out_TH)
    return out_TH
