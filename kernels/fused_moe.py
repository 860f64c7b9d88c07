"""fused_moe: the one entry point for routed experts; checks its inputs, then runs the torch or Triton path.

Legend (shape suffixes):
  T tokens, H hidden size, I expert intermediate size, E experts on this rank, K top-k slots per token.
"""

from __future__ import annotations

import math

import torch

from moe_serve.kernels.reference import DEFAULT_BLOCK_SHAPE, FP8_DTYPE

BACKENDS = ("triton", "torch")
ACT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _check_inputs(x_TH, w13_E2IH, w2_EHI, topk_weights_TK, topk_ids_TK, w13_scale, w2_scale, block_shape):
    if x_TH.dim() != 2 or w13_E2IH.dim() != 3 or w2_EHI.dim() != 3:
        raise ValueError(
            f"expected x [T, H], w13 [E, 2I, H], w2 [E, H, I]; got x {tuple(x_TH.shape)}, "
            f"w13 {tuple(w13_E2IH.shape)}, w2 {tuple(w2_EHI.shape)}"
        )
    T, H = x_TH.shape
    E, I = w2_EHI.shape[0], w2_EHI.shape[2]
    if tuple(w13_E2IH.shape) != (E, 2 * I, H) or tuple(w2_EHI.shape) != (E, H, I):
        raise ValueError(
            f"weights do not fit x [T={T}, H={H}]: w13 {tuple(w13_E2IH.shape)} should be [E, 2I, H] and "
            f"w2 {tuple(w2_EHI.shape)} should be [E, H, I] (gate rows then up rows in w13)"
        )
    if topk_ids_TK.dim() != 2 or topk_ids_TK.shape[0] != T or topk_weights_TK.shape != topk_ids_TK.shape:
        raise ValueError(
            f"topk_weights {tuple(topk_weights_TK.shape)} and topk_ids {tuple(topk_ids_TK.shape)} "
            f"must both be [T={T}, K]"
        )
    if topk_ids_TK.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"topk_ids must be int32 or int64, got {topk_ids_TK.dtype}")
    if x_TH.dtype not in ACT_DTYPES:
        raise TypeError(f"x must be one of {ACT_DTYPES}, got {x_TH.dtype}")
    tensors = [x_TH, w13_E2IH, w2_EHI, topk_weights_TK, topk_ids_TK]
    if (w13_scale is None) != (w2_scale is None):
        raise ValueError("pass both w13_scale and w2_scale (fp8 weights) or neither")
    if w13_scale is None:
        same = w13_E2IH.dtype == w2_EHI.dtype == x_TH.dtype
        # bf16 weights with float32 x: bf16 on a CPU without bf16 arithmetic (kernels/cpu_bf16w.py)
        widened = (x_TH.dtype == torch.float32 and not x_TH.is_cuda
                   and w13_E2IH.dtype == w2_EHI.dtype == torch.bfloat16)
        if not (same or widened):
            raise TypeError(
                f"weights ({w13_E2IH.dtype}, {w2_EHI.dtype}) must have x's dtype {x_TH.dtype}, "
                f"or be {FP8_DTYPE} with w13_scale and w2_scale (or bf16 for float32 x on CPU)"
            )
    else:
        if w13_E2IH.dtype != FP8_DTYPE or w2_EHI.dtype != FP8_DTYPE:
            raise TypeError(f"scales were given, so the weights must be {FP8_DTYPE}, got {w13_E2IH.dtype}")
        bn, bk = block_shape
        for name, w, s in (("w13_scale", w13_E2IH, w13_scale), ("w2_scale", w2_EHI, w2_scale)):
            want = (E, math.ceil(w.shape[1] / bn), math.ceil(w.shape[2] / bk))
            if tuple(s.shape) != want:
                raise ValueError(f"{name} is {tuple(s.shape)}; block_shape {[bn, bk]} needs {list(want)}")
        tensors += [w13_scale, w2_scale]
    devices = {t.device for t in tensors}
    if len(devices) != 1:
        raise ValueError(f"all fused_moe inputs must be on one device, got {sorted(map(str, devices))}")


def fused_moe(
    x_TH: torch.Tensor,
    w13_E2IH: torch.Tensor,
    w2_EHI: torch.Tensor,
    topk_weights_TK: torch.Tensor,
    topk_ids_TK: torch.Tensor,
    *,
    w13_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
    block_shape=None,
    backend: str | None = None,
) -> torch.Tensor:
    """Routed experts: out[t] = sum_k topk_weights[t, k] * w2[e] @ (silu(gate) * up), e = topk_ids[t, k].

    x [T, H]; w13 [E, 2I, H] (gate rows, then up rows); w2 [E, H, I]; topk_weights [T, K];
    topk_ids [T, K] int32/int64, -1 = expert not on this rank (contributes nothing).
    FP8: float8_e4m3fn weights with w13_scale [E, ceil(2I/bn), ceil(H/bk)] and w2_scale
    [E, ceil(H/bn), ceil(I/bk)] (real = fp8 * scale), block_shape [bn, bk] (default [128, 128]).
    backend: "triton", "torch", or None (Triton for CUDA tensors, torch otherwise).
    Returns [T, H] in x's dtype; sums run in float32.
    """
    if backend not in (None, *BACKENDS):
        raise ValueError(f"backend must be one of {BACKENDS} or None, got {backend!r}")
    block_shape = tuple(block_shape or DEFAULT_BLOCK_SHAPE)
    _check_inputs(x_TH, w13_E2IH, w2_EHI, topk_weights_TK, topk_ids_TK, w13_scale, w2_scale, block_shape)
    if backend is None:
        backend = "triton" if x_TH.is_cuda else "torch"
    if backend == "triton" and w13_scale is None and w13_E2IH.dtype != x_TH.dtype:
        raise TypeError(f"the Triton path needs weights in x's dtype {x_TH.dtype}, got {w13_E2IH.dtype}")
    scales = dict(w13_scale=w13_scale, w2_scale=w2_scale, block_shape=block_shape)
    if backend == "torch":
        from moe_serve.kernels.fused_moe_torch import fused_moe_torch

        return fused_moe_torch(x_TH, w13_E2IH, w2_EHI, topk_weights_TK, topk_ids_TK, **scales)
    from moe_serve.kernels.fused_moe_triton import fused_moe_triton  # imports triton only when asked for

    return fused_moe_triton(x_TH, w13_E2IH, w2_EHI, topk_weights_TK, topk_ids_TK, **scales)
