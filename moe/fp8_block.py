"""DeepSeek-V3's block-wise FP8 weight format, as pure functions on CPU or GPU tensors.

A weight W_RC (R rows = out features, C cols = in features) is stored as
  `<name>`            float8_e4m3fn [R, C]
  `<name>_scale_inv`  float32       [ceil(R / 128), ceil(C / 128)]
and W = fp8.float() * scale_inv, each scale covering one 128x128 block (the last blocks may be partial).
"""

from __future__ import annotations

import math

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite float8_e4m3fn value
DEFAULT_BLOCK = (128, 128)


def _expand_scales(scale_RbCb: torch.Tensor, rows: int, cols: int, block: tuple[int, int]) -> torch.Tensor:
    block_r, block_c = block
    want = (math.ceil(rows / block_r), math.ceil(cols / block_c))
    if tuple(scale_RbCb.shape) != want:
        raise ValueError(
            f"scale_inv shape {tuple(scale_RbCb.shape)} does not match weight [{rows}, {cols}] with "
            f"block {list(block)}: expected {list(want)}"
        )
    return scale_RbCb.float().repeat_interleave(block_r, 0)[:rows].repeat_interleave(block_c, 1)[:, :cols]


def dequantize_fp8_block(
    w_fp8_RC: torch.Tensor, scale_inv_RbCb: torch.Tensor, block: tuple[int, int] = DEFAULT_BLOCK
) -> torch.Tensor:
    """float8 weight [R, C] and per-block scales [ceil(R/br), ceil(C/bc)] -> float32 weight [R, C]."""
    if w_fp8_RC.dim() != 2:
        raise ValueError(f"expected a 2-D fp8 weight, got shape {tuple(w_fp8_RC.shape)}")
    rows, cols = w_fp8_RC.shape
    return w_fp8_RC.float() * _expand_scales(scale_inv_RbCb, rows, cols, block)


def quantize_fp8_block(
    w_RC: torch.Tensor, block: tuple[int, int] = DEFAULT_BLOCK
) -> tuple[torch.Tensor, torch.Tensor]:
    """float weight [R, C] -> (float8_e4m3fn weight [R, C], float32 scale_inv [ceil(R/br), ceil(C/bc)]).

    Each block's scale maps its largest magnitude to FP8_MAX, as in DeepSeek-V3's checkpoints.
    """
    if w_RC.dim() != 2:
        raise ValueError(f"expected a 2-D weight, got shape {tuple(w_RC.shape)}")
    rows, cols = w_RC.shape
    block_r, block_c = block
    n_rb, n_cb = math.ceil(rows / block_r), math.ceil(cols / block_c)
    padded = torch.zeros(n_rb * block_r, n_cb * block_c, dtype=torch.float32, device=w_RC.device)
    padded[:rows, :cols] = w_RC.float()
    amax_RbCb = padded.view(n_rb, block_r, n_cb, block_c).abs().amax(dim=(1, 3))
    scale_inv_RbCb = (amax_RbCb / FP8_MAX).clamp(min=1e-12)
    scaled_RC = w_RC.float() / _expand_scales(scale_inv_RbCb, rows, cols, block)
    w_fp8_RC = scaled_RC.clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return w_fp8_RC, scale_inv_RbCb
