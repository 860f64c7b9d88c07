"""Fused MoE in Triton: align, grouped GEMM w13 + SiLU-and-mul, grouped GEMM w2 x top-k weight, sum over K.

Legend (shape suffixes):
  T tokens, H hidden size, I expert intermediate size, E experts on this rank, K top-k slots per token,
  N = T * K token-expert pairs, P padded pair slots from the align step, Gh/Gi activation scale groups.
Inside the GEMM kernel M/N/K are the GEMM's own rows/columns/depth (named size_m, size_n, size_k).

Data flow (torch reference: kernels.reference.fused_moe_reference):
  moe_align_block_size(topk_ids) -> pairs grouped by expert in BLOCK_SIZE_M runs
  act_NI = silu(x @ w13_gate.T) * (x @ w13_up.T)   one program per (row block, column block), both halves
  y_NH   = topk_weight * (act_NI @ w2.T)           same kernel, weight applied in the epilogue
  out_TH = sum over the K slots of y_NH            fp32 sum, -1 slots skipped
FP8 (w8a8, block scales): x and act are quantized per token group of block_shape[1] columns first; the
kernel multiplies each BLOCK_SIZE_K partial product by a_scale * b_scale (BLOCK_SIZE_K divides the group).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from moe_serve.kernels.fp8_quant_triton import quant_fp8_per_token_group
from moe_serve.kernels.moe_align import moe_align_block_size
from moe_serve.kernels.moe_configs import check_config, device_name, dtype_name, get_config
from moe_serve.kernels.reference import DEFAULT_BLOCK_SHAPE, FP8_DTYPE


@triton.jit
def _moe_gemm_kernel(
    x_ptr, w_ptr, out_ptr, x_scale_ptr, w_scale_ptr, pair_weight_ptr,
    pair_order_ptr, block_expert_ptr, used_len_ptr,
    num_pairs, padded_len, out_cols, depth,
    x_row_stride, x_col_stride, w_expert_stride, w_out_stride, w_in_stride, out_row_stride, out_col_stride,
    xs_row_stride, xs_group_stride, ws_expert_stride, ws_out_stride, ws_in_stride, ws_rows, ws_cols,
    PAIRS_PER_ROW: tl.constexpr,  # x's row for pair p is p // PAIRS_PER_ROW (tokens for w13, pairs for w2)
    GATED: tl.constexpr,  # w holds gate rows [0, out_cols) then up rows [out_cols, 2 out_cols): out = silu(g) * u
    SCALE_BY_ROUTE: tl.constexpr,  # multiply each output row by its pair's routing weight
    FP8: tl.constexpr,
    UPCAST_DOT: tl.constexpr,  # float32 tl.dot: the interpreter's bf16 one is wrong, FP8 ones need K >= 32
    FP32_IEEE: tl.constexpr,  # float32 inputs: exact products instead of tf32
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    """One [BLOCK_M pairs, BLOCK_N output columns] tile of one expert's GEMM over the pairs the align step
    gathered into that expert's row blocks."""
    row_blocks, col_blocks = tl.cdiv(padded_len, BLOCK_M), tl.cdiv(out_cols, BLOCK_N)
    tile = tl.program_id(0)
    # GROUP_M row blocks in turn walk the column blocks together, so they share weight tiles in L2.
    row_block, col_block = tl.swizzle2d(tile // col_blocks, tile % col_blocks, row_blocks, col_blocks, GROUP_M)
    if row_block * BLOCK_M >= tl.load(used_len_ptr):
        return  # past the last expert's padded run
    expert = tl.load(block_expert_ptr + row_block).to(tl.int64)
    if expert < 0:
        return  # a block of pairs routed to another rank's experts

    pair_M = tl.load(pair_order_ptr + row_block * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    live_M = pair_M < num_pairs  # padding slots hold num_pairs
    x_row_M = pair_M // PAIRS_PER_ROW
    col_N = col_block * BLOCK_N + tl.arange(0, BLOCK_N)
    live_N = col_N < out_cols
    lane_K = tl.arange(0, BLOCK_K)
    w_expert = w_ptr + expert * w_expert_stride
    if FP8:
        ws_expert = w_scale_ptr + expert * ws_expert_stride

    gate_MN = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    up_MN = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, depth, BLOCK_K):
        k_K = k0 + lane_K
        live_K = k_K < depth
        x_MK = tl.load(x_ptr + x_row_M[:, None] * x_row_stride + k_K[None, :] * x_col_stride,
                       mask=live_M[:, None] & live_K[None, :], other=0.0)
        w_at_KN = w_expert + k_K[:, None] * w_in_stride + col_N[None, :] * w_out_stride
        w_mask_KN = live_K[:, None] & live_N[None, :]
        gate_w_KN = tl.load(w_at_KN, mask=w_mask_KN, other=0.0)
        if GATED:
            up_w_KN = tl.load(w_at_KN + out_cols * w_out_stride, mask=w_mask_KN, other=0.0)
        if UPCAST_DOT:
            x_MK = x_MK.to(tl.float32)
            gate_w_KN = gate_w_KN.to(tl.float32)
            if GATED:
                up_w_KN = up_w_KN.to(tl.float32)
        if FP8:
            # BLOCK_K divides the scale group, so one activation scale and one weight scale cover this step.
            group = k0 // ws_cols
            x_s_M = tl.load(x_scale_ptr + x_row_M * xs_row_stride + group * xs_group_stride, mask=live_M, other=0.0)
            gate_s_N = tl.load(ws_expert + (col_N // ws_rows) * ws_out_stride + group * ws_in_stride,
                               mask=live_N, other=0.0)
            gate_MN += x_s_M[:, None] * tl.dot(x_MK, gate_w_KN) * gate_s_N[None, :]
            if GATED:
                up_s_N = tl.load(ws_expert + ((col_N + out_cols) // ws_rows) * ws_out_stride + group * ws_in_stride,
                                 mask=live_N, other=0.0)
                up_MN += x_s_M[:, None] * tl.dot(x_MK, up_w_KN) * up_s_N[None, :]
        elif FP32_IEEE:
            gate_MN = tl.dot(x_MK, gate_w_KN, gate_MN, input_precision="ieee")
            if GATED:
                up_MN = tl.dot(x_MK, up_w_KN, up_MN, input_precision="ieee")
        else:
            gate_MN = tl.dot(x_MK, gate_w_KN, gate_MN)
            if GATED:
                up_MN = tl.dot(x_MK, up_w_KN, up_MN)

    out_MN = gate_MN * tl.sigmoid(gate_MN) * up_MN if GATED else gate_MN
    if SCALE_BY_ROUTE:
        out_MN = out_MN * tl.load(pair_weight_ptr + pair_M, mask=live_M, other=0.0).to(tl.float32)[:, None]
    tl.store(out_ptr + pair_M[:, None] * out_row_stride + col_N[None, :] * out_col_stride,
             out_MN.to(out_ptr.dtype.element_ty), mask=live_M[:, None] & live_N[None, :])


@triton.jit
def _moe_sum_kernel(y_ptr, topk_ids_ptr, out_ptr, size_h, num_experts, stride_ym, stride_om,
                    TOP_K: tl.constexpr, BLOCK_H: tl.constexpr):
    """out[t] = sum over k of y[t * TOP_K + k], skipping slots whose id is not a local expert."""
    t = tl.program_id(0).to(tl.int64)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = offs_h < size_h
    acc = tl.zeros((BLOCK_H,), dtype=tl.float32)
    for k in tl.static_range(TOP_K):
        expert = tl.load(topk_ids_ptr + t * TOP_K + k)
        cols = tl.where((expert >= 0) & (expert < num_experts), size_h, 0)  # 0: slot on another rank
        y = tl.load(y_ptr + (t * TOP_K + k) * stride_ym + offs_h, mask=offs_h < cols, other=0.0)
        acc += y.to(tl.float32)
    tl.store(out_ptr + t * stride_om + offs_h, acc.to(out_ptr.dtype.element_ty), mask=h_ok)


_INTERPRETED = isinstance(_moe_gemm_kernel, InterpretedFunction)  # decided by TRITON_INTERPRET at import


def moe_gemm(a, a_scale, w, w_scale, c, topk_weights_N, align, *, top_k, fuse_silu, mul_routed_weight,
             config, block_shape=None):
    """c[p] = epilogue(w[e] @ a[p // top_k]) for every pair p the align step put in expert e's blocks.

    a [rows, D]; w [E, O, D] with O = 2 * c.shape[1] when fuse_silu else c.shape[1]; c [N, c_cols].
    fp8: a and w float8_e4m3fn, a_scale [rows, ceil(D / bk)], w_scale [E, ceil(O / bn), ceil(D / bk)].
    """
    sorted_token_ids_P, expert_ids_B, num_tokens_post_padded = align
    size_n, size_k = c.shape[1], a.shape[1]
    assert w.dim() == 3 and w.shape[2] == size_k, f"w {tuple(w.shape)} does not match a {tuple(a.shape)}"
    assert w.shape[1] == (2 if fuse_silu else 1) * size_n, f"w {tuple(w.shape)} does not match c {tuple(c.shape)}"
    assert c.shape[0] == topk_weights_N.numel() and topk_weights_N.is_contiguous(), "one contiguous weight per pair"
    fp8 = a_scale is not None
    if fp8:
        assert a.dtype == w.dtype == FP8_DTYPE, f"fp8 path wants fp8 a and w, got {a.dtype}, {w.dtype}"
        assert block_shape[1] % config["BLOCK_SIZE_K"] == 0, f"BLOCK_SIZE_K must divide {block_shape[1]}"
        assert a_scale.shape == (a.shape[0], triton.cdiv(size_k, block_shape[1])), f"a_scale {tuple(a_scale.shape)}"
        want = (w.shape[0], triton.cdiv(w.shape[1], block_shape[0]), triton.cdiv(size_k, block_shape[1]))
        assert w_scale.shape == want, f"w_scale {tuple(w_scale.shape)} should be {want} for block {block_shape}"
    else:
        assert a.dtype == w.dtype, f"a ({a.dtype}) and w ({w.dtype}) must share a dtype"
        a_scale, w_scale, block_shape = a, w, (1, 1)  # unused pointers
    bm, bn = config["BLOCK_SIZE_M"], config["BLOCK_SIZE_N"]
    assert sorted_token_ids_P.numel() % bm == 0, "align with the same BLOCK_SIZE_M as the config"
    grid = (triton.cdiv(sorted_token_ids_P.numel(), bm) * triton.cdiv(size_n, bn),)
    _moe_gemm_kernel[grid](
        a, w, c, a_scale, w_scale, topk_weights_N, sorted_token_ids_P, expert_ids_B, num_tokens_post_padded,
        c.shape[0], sorted_token_ids_P.numel(), size_n, size_k,
        a.stride(0), a.stride(1), w.stride(0), w.stride(1), w.stride(2), c.stride(0), c.stride(1),
        a_scale.stride(0) if fp8 else 0, a_scale.stride(1) if fp8 else 0,
        w_scale.stride(0) if fp8 else 0, w_scale.stride(1) if fp8 else 0, w_scale.stride(2) if fp8 else 0,
        block_shape[0], block_shape[1],
        PAIRS_PER_ROW=top_k, GATED=fuse_silu, SCALE_BY_ROUTE=mul_routed_weight, FP8=fp8,
        # the interpreter's tl.dot multiplies bf16 bit patterns; a GPU's FP8 tl.dot needs K >= 32 (blocks of 16)
        UPCAST_DOT=(_INTERPRETED and a.dtype == torch.bfloat16) or (fp8 and config["BLOCK_SIZE_K"] < 32),
        FP32_IEEE=a.dtype == torch.float32,
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=config["BLOCK_SIZE_K"], GROUP_M=config["GROUP_SIZE_M"],
        num_warps=config["num_warps"], num_stages=config["num_stages"],
    )


def moe_sum(y_NH: torch.Tensor, topk_ids_TK: torch.Tensor, out_TH: torch.Tensor, num_experts: int) -> None:
    """out[t] = sum_k y[t * K + k] over slots with a local expert id, accumulated in float32."""
    T, K = topk_ids_TK.shape
    assert y_NH.shape == (T * K, out_TH.shape[1]) and y_NH.stride(1) == 1 and out_TH.stride(1) == 1
    assert topk_ids_TK.is_contiguous(), "topk_ids must be contiguous"
    block_h = min(1024, triton.next_power_of_2(out_TH.shape[1]))
    _moe_sum_kernel[(T, triton.cdiv(out_TH.shape[1], block_h))](
        y_NH, topk_ids_TK, out_TH, out_TH.shape[1], num_experts, y_NH.stride(0), out_TH.stride(0),
        TOP_K=K, BLOCK_H=block_h,
    )


def fused_moe_triton(
    x_TH: torch.Tensor,
    w13_E2IH: torch.Tensor,
    w2_EHI: torch.Tensor,
    topk_weights_TK: torch.Tensor,
    topk_ids_TK: torch.Tensor,
    *,
    w13_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
    block_shape=None,
    config: dict | None = None,
) -> torch.Tensor:
    """See kernels.fused_moe (inputs already validated there). config overrides the tuned/default blocks."""
    if not (x_TH.is_cuda or _INTERPRETED):
        raise RuntimeError(
            "the Triton MoE path needs CUDA tensors, or TRITON_INTERPRET=1 set before triton is imported; "
            "use backend='torch' on CPU"
        )
    T, H = x_TH.shape
    E, I, K = w13_E2IH.shape[0], w2_EHI.shape[2], topk_ids_TK.shape[1]
    out_TH = torch.empty(T, H, dtype=x_TH.dtype, device=x_TH.device)
    if T == 0 or K == 0:
        return out_TH.zero_()
    fp8 = w13_scale is not None
    block_shape = tuple(block_shape or DEFAULT_BLOCK_SHAPE) if fp8 else None
    if config is None:
        config = get_config(T, E, I, H, dtype_name(x_TH.dtype, fp8), block_shape, device_name(x_TH.device))
    check_config(config, block_shape[1] if fp8 else None)

    topk_ids_TK = topk_ids_TK.contiguous()
    weights_N = topk_weights_TK.reshape(-1).contiguous()
    align = moe_align_block_size(topk_ids_TK, config["BLOCK_SIZE_M"], E)
    # Rows of slots on other ranks are never written; with fp8 they are still quantized, so zero them.
    act_NI = (torch.zeros if fp8 else torch.empty)(T * K, I, dtype=x_TH.dtype, device=x_TH.device)
    y_NH = torch.empty(T * K, H, dtype=x_TH.dtype, device=x_TH.device)
    common = dict(config=config, block_shape=block_shape)

    a_TH, a_scale_TGh = quant_fp8_per_token_group(x_TH.contiguous(), block_shape[1]) if fp8 else (x_TH, None)
    moe_gemm(a_TH, a_scale_TGh, w13_E2IH, w13_scale, act_NI, weights_N, align,
             top_k=K, fuse_silu=True, mul_routed_weight=False, **common)
    a_NI, a_scale_NGi = quant_fp8_per_token_group(act_NI, block_shape[1]) if fp8 else (act_NI, None)
    moe_gemm(a_NI, a_scale_NGi, w2_EHI, w2_scale, y_NH, weights_N, align,
             top_k=1, fuse_silu=False, mul_routed_weight=True, **common)
    moe_sum(y_NH, topk_ids_TK, out_TH, E)
    return out_TH
