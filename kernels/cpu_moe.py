"""Routed experts with bf16 weights and float32 activations on CPU in one C call (csrc/moe_bf16w.c): how
`--dtype bfloat16` runs its experts on a CPU without bf16 arithmetic (server/runner.compute_dtype).

The torch path (kernels/fused_moe_torch.py) costs a sort, a host sync, a gather and a Python loop of
GEMMs per call; at decode sizes those ops cost more than the arithmetic. The kernel counts pairs into
expert order, gathers, multiplies and scatters in C. Its reference is kernels.reference.fused_moe_reference
on the widened weights; results differ from it only by float32 summation order.

Legend: T tokens, H hidden size, I expert intermediate size, E experts on this rank, K top-k slots.
"""

from __future__ import annotations

import torch

from moe_serve.kernels import cpu_build


def fits(x_TH: torch.Tensor, w13_E2IH: torch.Tensor, w2_EHI: torch.Tensor) -> bool:
    """float32 x with unit column stride, contiguous bf16 expert weights, on CPU, and the kernels built."""
    return (x_TH.dtype == torch.float32 and w13_E2IH.dtype == w2_EHI.dtype == torch.bfloat16
            and x_TH.is_cpu and x_TH.stride(1) == 1 and w13_E2IH.is_contiguous()
            and w2_EHI.is_contiguous() and cpu_build.lib() is not None)


def fused_moe_bf16w(x_TH: torch.Tensor, w13_E2IH: torch.Tensor, w2_EHI: torch.Tensor,
                    topk_weights_TK: torch.Tensor, topk_ids_TK: torch.Tensor,
                    shared_w13_2SH: torch.Tensor | None = None, shared_w2_HS: torch.Tensor | None = None) -> torch.Tensor:
    """kernels.fused_moe for inputs that `fits` (shapes as it checks them); float32 [T, H]. With the shared
    expert's weights (bf16, contiguous: gate rows then up rows [2S, H], down [H, S]) its output is added
    for every token, as DeepSeek's MoE block adds its shared experts."""
    T, H = x_TH.shape
    E, I, K = w13_E2IH.shape[0], w2_EHI.shape[2], topk_ids_TK.shape[1]
    ids_TK = topk_ids_TK.to(torch.int64).contiguous()
    weights_TK = topk_weights_TK.to(torch.float32).contiguous()
    out_TH = x_TH.new_empty(T, H)
    if T == 0:
        return out_TH
    shared = shared_w13_2SH is not None
    if shared and not (shared_w13_2SH.dtype == shared_w2_HS.dtype == torch.bfloat16 and shared_w13_2SH.is_contiguous()
                       and shared_w2_HS.is_contiguous() and shared_w13_2SH.shape[1] == H
                       and tuple(shared_w2_HS.shape) == (H, shared_w13_2SH.shape[0] // 2)):
        raise ValueError(f"shared expert weights {tuple(shared_w13_2SH.shape)} / {tuple(shared_w2_HS.shape)} must be "
                         f"contiguous bf16 [2S, H={H}] / [H, S]")
    status = cpu_build.lib().moe_bf16w(x_TH.data_ptr(), x_TH.stride(0), T, H, w13_E2IH.data_ptr(),
                                       w2_EHI.data_ptr(), E, I, ids_TK.data_ptr(), weights_TK.data_ptr(), K,
                                       out_TH.data_ptr(), shared_w13_2SH.data_ptr() if shared else None,
                                       shared_w2_HS.shape[1] if shared else 0,
                                       shared_w2_HS.data_ptr() if shared else None)
    if status > 0:
        bad = ids_TK.reshape(-1)[status - 1].item()
        raise ValueError(f"topk_ids must lie in [-1, {E}) for {E} local experts, got {bad}")
    if status < 0:
        raise MemoryError("fused_moe: no memory for the CPU kernel's scratch")
    return out_TH
