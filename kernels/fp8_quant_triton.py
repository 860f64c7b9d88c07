"""Per-token-group fp8 activation quant in Triton (torch reference: quant_fp8_per_token_group_reference).

Legend (shape suffixes): M rows (tokens or token-expert pairs), D columns, G = ceil(D / group_size).
Row m's columns [g * group_size, (g + 1) * group_size) share scale[m, g] = max(|x|, eps) / FP8_MAX.

The interpreter (TRITON_INTERPRET=1) rounds float32 -> fp8 wrongly: half-up instead of to even, and a
mantissa carry is OR-ed into the exponent, so 124.3 becomes 64 (triton-lang/triton#8322, PR #9808). There
the kernel first rounds onto the e4m3 grid in float32 so the cast is exact; on a GPU it casts directly.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from triton.runtime.interpreter import InterpretedFunction

from moe_serve.kernels.reference import FP8_DTYPE, FP8_MAX, FP8_SCALE_EPS


@triton.jit
def _round_to_e4m3_grid(v):
    """Round float32 v (|v| <= 448) to the nearest float8_e4m3fn value, ties to even, staying in float32."""
    exponent = tl.maximum(((v.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127, -6)  # e4m3 subnormal step 2^-9
    # 1.5 * 2^(exponent - 3 + 23): adding then subtracting it rounds to a multiple of 2^(exponent - 3).
    magic = (((exponent + 147) << 23) | (1 << 22)).to(tl.float32, bitcast=True)
    return (v + magic) - magic


@triton.jit
def _quant_fp8_group_kernel(
    x_ptr, q_ptr, scale_ptr, size_d, stride_xm, stride_qm, stride_sm, group_size, eps, fp8_max,
    BLOCK: tl.constexpr, ROUND_ON_GRID: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    group = tl.program_id(1)
    offs = tl.arange(0, BLOCK)
    cols = group * group_size + offs
    mask = (offs < group_size) & (cols < size_d)
    x = tl.load(x_ptr + row * stride_xm + cols, mask=mask, other=0.0).to(tl.float32)
    scale = tl.maximum(tl.max(tl.abs(x), axis=0), eps) / fp8_max
    q = tl.clamp(x / scale, -fp8_max, fp8_max)
    if ROUND_ON_GRID:
        q = _round_to_e4m3_grid(q)
    tl.store(q_ptr + row * stride_qm + cols, q.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(scale_ptr + row * stride_sm + group, scale)


_INTERPRETED = isinstance(_quant_fp8_group_kernel, InterpretedFunction)


def quant_fp8_per_token_group(x_MD: torch.Tensor, group_size: int = 128):
    """x [M, D] (unit column stride) -> (fp8 [M, D], float32 scale [M, ceil(D / group_size)])."""
    assert x_MD.dim() == 2 and x_MD.stride(1) == 1, f"x must be 2-D with unit column stride, got {x_MD.stride()}"
    assert group_size > 0, f"group_size must be positive, got {group_size}"
    M, D = x_MD.shape
    G = math.ceil(D / group_size)
    q_MD = torch.empty(M, D, dtype=FP8_DTYPE, device=x_MD.device)
    scale_MG = torch.empty(M, G, dtype=torch.float32, device=x_MD.device)
    if M == 0:
        return q_MD, scale_MG
    _quant_fp8_group_kernel[(M, G)](
        x_MD, q_MD, scale_MG, D, x_MD.stride(0), q_MD.stride(0), scale_MG.stride(0), group_size,
        FP8_SCALE_EPS, FP8_MAX, BLOCK=triton.next_power_of_2(group_size), ROUND_ON_GRID=_INTERPRETED,
    )
    return q_MD, scale_MG
