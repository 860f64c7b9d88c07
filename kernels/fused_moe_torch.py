"""Fused MoE on CPU with torch ops: sort pairs by expert, one gather, grouped GEMMs, one index_add_.

Legend (shape suffixes):
  T tokens, H hidden size, I expert intermediate size, E experts on this rank, K top-k slots per token,
  N = T * K token-expert pairs (slot n belongs to token n // K), R routed pairs (ids != -1) sorted by
  expert, C rows of one chunk of those.

Steps (one host sync, for the per-expert row counts):
  1. stable-sort the N expert ids; ids of -1 sort first and are skipped, experts follow in order;
  2. gather the routed rows of x (expert e owns sorted rows [ends[e-1], ends[e]));
  3. grouped GEMM with w13, silu(gate) * up, grouped GEMM with w2, each expert on its contiguous run;
  4. scale each row by its top-k weight and index_add_ it into a float32 [T, H] accumulator.
Steps 2-4 run over chunks of rows inside ONE scratch buffer allocated per call. Fresh multi-MiB buffers
cost more than the arithmetic here: glibc returns freed memory to the kernel, and on the 2-core VM the
page faults to get it back took ~40% of the call (bf16, 256 tokens). One block under glibc's 32 MiB mmap
ceiling is recycled from its heap instead.
The grouped GEMM is a loop of torch.mm(out=...) over the non-empty runs. torch._grouped_mm also runs on
CPU in torch 2.13 (float32, bfloat16, float16; int32 offsets; 16-byte aligned row strides), but there
it is the same loop of mm in C++ and allocates its output, so it cannot write into the scratch buffer.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from moe_serve.kernels import cpu_bf16w
from moe_serve.kernels.reference import DEFAULT_BLOCK_SHAPE, dequant_fp8_block

SCRATCH_BYTES = 16 << 20  # target size of the per-call scratch buffer (chunks shrink to fit)
MIN_CHUNK_ROWS = 256  # below this the per-expert GEMMs get too short; the buffer grows instead
_ALIGN = 64


def _carve(buf_B: torch.Tensor, offset: int, shape: tuple[int, ...], dtype: torch.dtype):
    """A contiguous `shape` view of dtype at byte `offset` of buf, and the next aligned free offset."""
    nbytes = math.prod(shape) * dtype.itemsize
    view = buf_B[offset : offset + nbytes].view(dtype).view(shape)
    return view, offset + -(-nbytes // _ALIGN) * _ALIGN


def _grouped_mm_into(a_CD: torch.Tensor, w_EOD: torch.Tensor, ends_E: list[int], out_CO: torch.Tensor) -> None:
    """out[c] = w[e] @ a[c] for the rows c of expert e, [ends[e-1], ends[e]). bf16 w with float32 a: see
    kernels/cpu_bf16w.py."""
    start = 0
    for e, end in enumerate(ends_E):
        if end > start:
            if w_EOD.dtype == a_CD.dtype:
                torch.mm(a_CD[start:end], w_EOD[e].t(), out=out_CO[start:end])
            else:
                cpu_bf16w.mm_into(a_CD[start:end], w_EOD[e], out_CO[start:end])
        start = end


def fused_moe_torch(
    x_TH: torch.Tensor,
    w13_E2IH: torch.Tensor,
    w2_EHI: torch.Tensor,
    topk_weights_TK: torch.Tensor,
    topk_ids_TK: torch.Tensor,
    *,
    w13_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
    block_shape=None,
) -> torch.Tensor:
    """See kernels.fused_moe; inputs are already validated. GEMMs run in x's dtype, the sum in float32."""
    T, H = x_TH.shape
    E, I, K = w13_E2IH.shape[0], w2_EHI.shape[2], topk_ids_TK.shape[1]
    if T == 0 or K == 0:
        return x_TH.new_zeros(T, H)
    if w13_scale is not None:  # the reference: dequantised on every call
        block_shape = block_shape or DEFAULT_BLOCK_SHAPE
        w13_E2IH = dequant_fp8_block(w13_E2IH, w13_scale, block_shape).to(x_TH.dtype)
        w2_EHI = dequant_fp8_block(w2_EHI, w2_scale, block_shape).to(x_TH.dtype)

    ids_N = topk_ids_TK.reshape(-1).long()
    sorted_ids_N, order_N = torch.sort(ids_N, stable=True)
    starts_E1 = torch.searchsorted(sorted_ids_N, torch.arange(E + 1, device=ids_N.device))
    stats = torch.cat([starts_E1, sorted_ids_N[[0, -1]]]).tolist()  # the one host sync
    first, last, min_id, max_id = stats[0], stats[E], stats[-2], stats[-1]
    if min_id < -1 or max_id >= E:
        raise ValueError(f"topk_ids must lie in [-1, {E}) for {E} local experts, got ids from {min_id} to {max_id}")
    if last == first:  # every slot is on another rank
        return x_TH.new_zeros(T, H)
    pair_R = order_N[first:last]
    tok_R = pair_R // K
    weight_R = topk_weights_TK.reshape(-1).index_select(0, pair_R).float()
    ends_E = [s - first for s in stats[1 : E + 1]]  # expert e owns sorted rows [ends[e-1], ends[e])

    # Scratch: [float32 accumulator unless x is float32,] then x, gate|up, act, y (x's dtype), float32 y.
    dtype, R = x_TH.dtype, last - first
    upcast = dtype != torch.float32
    acc_bytes = (4 * T * H + _ALIGN) if upcast else 0
    row_bytes = (2 * H + 3 * I) * dtype.itemsize + (4 * H if upcast else 0)
    rows = min(R, max(MIN_CHUNK_ROWS, (SCRATCH_BYTES - acc_bytes) // row_bytes))
    buf_B = torch.empty(acc_bytes + rows * row_bytes + 5 * _ALIGN, dtype=torch.uint8, device=x_TH.device)
    if upcast:
        out_TH, off = _carve(buf_B, 0, (T, H), torch.float32)
        out_TH.zero_()
    else:  # float32: accumulate straight into the returned tensor
        out_TH, off = torch.zeros(T, H, dtype=torch.float32, device=x_TH.device), 0
    x_CH, off = _carve(buf_B, off, (rows, H), dtype)
    h_C2I, off = _carve(buf_B, off, (rows, 2 * I), dtype)
    act_CI, off = _carve(buf_B, off, (rows, I), dtype)
    y_CH, off = _carve(buf_B, off, (rows, H), dtype)
    y32_CH = _carve(buf_B, off, (rows, H), torch.float32)[0] if upcast else y_CH

    for c0 in range(0, R, rows):
        C = min(rows, R - c0)
        ends_chunk_E = [min(max(end - c0, 0), C) for end in ends_E]
        tok_C = tok_R[c0 : c0 + C]
        x, h, act, y, y32 = x_CH[:C], h_C2I[:C], act_CI[:C], y_CH[:C], y32_CH[:C]
        torch.index_select(x_TH, 0, tok_C, out=x)
        _grouped_mm_into(x, w13_E2IH, ends_chunk_E, h)
        torch.mul(F.silu(h[:, :I], inplace=True), h[:, I:], out=act)
        _grouped_mm_into(act, w2_EHI, ends_chunk_E, y)
        if upcast:
            y32.copy_(y)
        y32.mul_(weight_R[c0 : c0 + C, None])
        out_TH.index_add_(0, tok_C, y32)
    return out_TH.to(dtype)
