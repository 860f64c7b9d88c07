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
    a_ptr, b_ptr, c_ptr, a_scale_ptr, b_scale_ptr, topk_weights_ptr,
    sorted_token_ids_ptr, expert_ids_ptr, num_tokens_post_padded_ptr,
    num_pairs, size_m_padded, size_n, size_k,
    stride_am, stride_ak, stride_be, stride_bn, stride_bk, stride_cm, stride_cn,
    stride_asm, stride_ask, stride_bse, stride_bsn, stride_bsk, group_n, group_k,
    TOP_K: tl.constexpr,  # a's row for pair p is p // TOP_K (tokens for w13, pairs for w2)
    FUSE_SILU: tl.constexpr,  # b holds gate rows [0, size_n) then up rows [size_n, 2 size_n)
    MUL_ROUTED_WEIGHT: tl.constexpr,
    USE_FP8: tl.constexpr,
    UPCAST_DOT: tl.constexpr,  # interpreter only: its tl.dot multiplies bf16 bit patterns
    FP32_IEEE: tl.constexpr,  # float32 inputs: exact products instead of tf32
    BLOCK_SIZE_M: tl.constexpr, BLOCK_SIZE_N: tl.constexpr, BLOCK_SIZE_K: tl.constexpr,
    GROUP_SIZE_M: tl.constexpr,
):
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(size_m_padded, BLOCK_SIZE_M)
    num_pid_n = tl.cdiv(size_n, BLOCK_SIZE_N)
    pids_per_group = GROUP_SIZE_M * num_pid_n  # row blocks of a group share weight columns in L2
    first_pid_m = (pid // pids_per_group) * GROUP_SIZE_M
    group_size_m = min(num_pid_m - first_pid_m, GROUP_SIZE_M)
    pid_m = first_pid_m + (pid % pids_per_group) % group_size_m
    pid_n = (pid % pids_per_group) // group_size_m
    if pid_m * BLOCK_SIZE_M >= tl.load(num_tokens_post_padded_ptr):
        return
    expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    if expert < 0:
        return

    offs_m = pid_m * BLOCK_SIZE_M + tl.arange(0, BLOCK_SIZE_M)
    pair = tl.load(sorted_token_ids_ptr + offs_m).to(tl.int64)
    row_ok = pair < num_pairs
    a_row = pair // TOP_K
    offs_n = pid_n * BLOCK_SIZE_N + tl.arange(0, BLOCK_SIZE_N)
    col_ok = offs_n < size_n
    offs_k = tl.arange(0, BLOCK_SIZE_K)
    a_ptrs = a_ptr + a_row[:, None] * stride_am + offs_k[None, :] * stride_ak
    b_ptrs = b_ptr + expert * stride_be + offs_n[None, :] * stride_bn + offs_k[:, None] * stride_bk
    up_off = size_n * stride_bn
    if USE_FP8:
        a_scale_ptrs = a_scale_ptr + a_row * stride_asm
        b_scale_ptrs = b_scale_ptr + expert * stride_bse + (offs_n // group_n) * stride_bsn
        up_scale_ptrs = b_scale_ptr + expert * stride_bse + ((offs_n + size_n) // group_n) * stride_bsn

    acc = tl.zeros((BLOCK_SIZE_M, BLOCK_SIZE_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_SIZE_M, BLOCK_SIZE_N), dtype=tl.float32)
    for k_step in range(0, tl.cdiv(size_k, BLOCK_SIZE_K)):
        k_ok = offs_k < size_k - k_step * BLOCK_SIZE_K
        a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        if FUSE_SILU:
            b_up = tl.load(b_ptrs + up_off, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        if UPCAST_DOT:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
            if FUSE_SILU:
                b_up = b_up.to(tl.float32)
        if USE_FP8:
            k_group = (k_step * BLOCK_SIZE_K) // group_k
            a_s = tl.load(a_scale_ptrs + k_group * stride_ask, mask=row_ok, other=0.0)
            b_s = tl.load(b_scale_ptrs + k_group * stride_bsk, mask=col_ok, other=0.0)
            acc += tl.dot(a, b) * a_s[:, None] * b_s[None, :]
            if FUSE_SILU:
                up_s = tl.load(up_scale_ptrs + k_group * stride_bsk, mask=col_ok, other=0.0)
                acc_up += tl.dot(a, b_up) * a_s[:, None] * up_s[None, :]
        elif FP32_IEEE:
            acc = tl.dot(a, b, acc, input_precision="ieee")
            if FUSE_SILU:
                acc_up = tl.dot(a, b_up, acc_up, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
            if FUSE_SILU:
                acc_up = tl.dot(a, b_up, acc_up)
        a_ptrs += BLOCK_SIZE_K * stride_ak
        b_ptrs += BLOCK_SIZE_K * stride_bk

    if FUSE_SILU:
        acc = acc / (1.0 + tl.exp(-acc)) * acc_up
    if MUL_ROUTED_WEIGHT:
        weight = tl.load(topk_weights_ptr + pair, mask=row_ok, other=0.0).to(tl.float32)
        acc = acc * weight[:, None]
    c_ptrs = c_ptr + pair[:, None] * stride_cm + offs_n[None, :] * stride_cn
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


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
        TOP_K=top_k, FUSE_SILU=fuse_silu, MUL_ROUTED_WEIGHT=mul_routed_weight, USE_FP8=fp8,
        UPCAST_DOT=_INTERPRETED and a.dtype == torch.bfloat16, FP32_IEEE=a.dtype == torch.float32,
        BLOCK_SIZE_M=bm, BLOCK_SIZE_N=bn, BLOCK_SIZE_K=config["BLOCK_SIZE_K"],
        GROUP_SIZE_M=config["GROUP_SIZE_M"], num_warps=config["num_warps"], num_stages=config["num_stages"],
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
