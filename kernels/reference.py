"""Plain torch oracles for the fused MoE kernels: slow, obvious, float32 throughout.

Legend (shape suffixes):
  T tokens, H hidden size, I expert intermediate size, E experts on this rank, K top-k slots per token,
  G = ceil(H / group) activation scale groups, Rb/Cb = weight scale blocks along rows/cols.

Expert e computes  y = w2[e] @ (silu(gate) * up)  with  gate, up = split(w13[e] @ x)  (gate rows first).
A top-k id of -1 means "this expert lives on another rank": that slot contributes nothing.
FP8 weights use DeepSeek-V3's `weight_scale_inv` format: real = fp8.float() * scale, one scale per
block_shape = [block_rows, block_cols] block (the last blocks may be partial).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite float8_e4m3fn value
FP8_SCALE_EPS = 1e-10  # floor on amax so an all-zero group gets a finite scale
DEFAULT_BLOCK_SHAPE = (128, 128)


def dequant_fp8_block(
    w_XRC: torch.Tensor, scale_inv_XRbCb: torch.Tensor, block_shape=DEFAULT_BLOCK_SHAPE
) -> torch.Tensor:
    """fp8 weight [..., R, C] and block scales [..., ceil(R/br), ceil(C/bc)] -> float32 weight [..., R, C]."""
    block_r, block_c = block_shape
    rows, cols = w_XRC.shape[-2:]
    want = (*w_XRC.shape[:-2], math.ceil(rows / block_r), math.ceil(cols / block_c))
    if tuple(scale_inv_XRbCb.shape) != want:
        raise ValueError(
            f"scale shape {tuple(scale_inv_XRbCb.shape)} does not fit weight {tuple(w_XRC.shape)} with "
            f"block_shape {list(block_shape)}: expected {list(want)}"
        )
    scale_XRC = scale_inv_XRbCb.float().repeat_interleave(block_r, -2)[..., :rows, :]
    scale_XRC = scale_XRC.repeat_interleave(block_c, -1)[..., :cols]
    return w_XRC.float() * scale_XRC


def quant_fp8_per_token_group_reference(x_TH: torch.Tensor, group_size: int = 128):
    """Activation quant: x [T, H] -> (fp8 [T, H], float32 scale [T, ceil(H/group)]), x ~= fp8 * scale.

    Each token's run of `group_size` values along H shares one scale = amax / FP8_MAX.
    """
    T, H = x_TH.shape
    G = math.ceil(H / group_size)
    padded_TGS = torch.zeros(T, G * group_size, dtype=torch.float32, device=x_TH.device)
    padded_TGS[:, :H] = x_TH.float()
    padded_TGS = padded_TGS.view(T, G, group_size)
    scale_TG = padded_TGS.abs().amax(dim=-1).clamp(min=FP8_SCALE_EPS) / FP8_MAX
    q_TGS = (padded_TGS / scale_TG[:, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q_TGS.view(T, G * group_size)[:, :H].contiguous(), scale_TG


def _fake_quant(x_TH: torch.Tensor, group_size: int) -> torch.Tensor:
    q_TH, scale_TG = quant_fp8_per_token_group_reference(x_TH, group_size)
    return dequant_fp8_block(q_TH, scale_TG, (1, group_size))


def fused_moe_reference(
    x_TH: torch.Tensor,
    w13_E2IH: torch.Tensor,
    w2_EHI: torch.Tensor,
    topk_weights_TK: torch.Tensor,
    topk_ids_TK: torch.Tensor,
    *,
    w13_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
    block_shape=None,
    quant_act: bool = False,
) -> torch.Tensor:
    """The oracle: one Python iteration per expert, all maths in float32, result in x's dtype.

    With fp8 weights (scales given) the weights are dequantized first; block_shape defaults to
    [128, 128]. quant_act=True also rounds each GEMM's input through per-token-group fp8 (group =
    block_shape[1]) the way the fp8 kernels do, for a tight comparison with them.
    """
    if (w13_scale is None) != (w2_scale is None):
        raise ValueError("pass both w13_scale and w2_scale (fp8 weights) or neither")
    block_shape = tuple(block_shape or DEFAULT_BLOCK_SHAPE)
    if w13_scale is not None:
        w13_E2IH = dequant_fp8_block(w13_E2IH, w13_scale, block_shape)
        w2_EHI = dequant_fp8_block(w2_EHI, w2_scale, block_shape)
    x32_TH, w13_E2IH, w2_EHI = x_TH.float(), w13_E2IH.float(), w2_EHI.float()
    if quant_act:
        x32_TH = _fake_quant(x32_TH, block_shape[1])
    I = w2_EHI.shape[2]
    out_TH = torch.zeros(x_TH.shape, dtype=torch.float32, device=x_TH.device)
    for e in range(w13_E2IH.shape[0]):
        tok_R, slot_R = torch.where(topk_ids_TK == e)
        if tok_R.numel() == 0:
            continue
        gate_RI, up_RI = (x32_TH[tok_R] @ w13_E2IH[e].T).split(I, dim=-1)
        act_RI = F.silu(gate_RI) * up_RI
        if quant_act:
            act_RI = _fake_quant(act_RI, block_shape[1])
        y_RH = act_RI @ w2_EHI[e].T
        out_TH.index_add_(0, tok_R, y_RH * topk_weights_TK[tok_R, slot_R].float()[:, None])
    return out_TH.to(x_TH.dtype)
