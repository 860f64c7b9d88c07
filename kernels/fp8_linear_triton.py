"""A block-FP8 linear on the GPU through the Triton MoE GEMM (kernels/fused_moe_triton.py) as one expert:
activations quantised per token group of `block[1]` columns, w8a8 products with the weight's block scales,
float32 accumulation. Reference: F.linear on the dequantised weight (kernels/backend_torch.py).

Legend: T rows, I in features, O out features.
"""

from __future__ import annotations

import functools

import torch

from moe_serve.kernels.fp8_quant_triton import quant_fp8_per_token_group
from moe_serve.kernels.fused_moe_triton import moe_gemm
from moe_serve.kernels.moe_align import moe_align_block_size


def config_for(T: int, block: tuple[int, int]) -> dict:
    """Small row blocks for decode-sized inputs, larger ones for prompt chunks."""
    bn, bk = block
    small = T <= 64
    return dict(BLOCK_SIZE_M=16 if small else 64, BLOCK_SIZE_N=min(bn, 128), BLOCK_SIZE_K=min(bk, 128),
                GROUP_SIZE_M=1 if small else 8, num_warps=4, num_stages=3)


@functools.lru_cache(maxsize=256)
def _dense_rows(T: int, block_m: int, device: torch.device):
    """The MoE GEMM's row mapping for a dense linear (every row to "expert" 0, in order), and unit route
    weights: built once per row count, not by the align step's ~20 small kernels on every call (at decode
    sizes those launches, not the GEMM, set the time)."""
    align = moe_align_block_size(torch.zeros(T, 1, dtype=torch.int32, device=device), block_m, 1)
    return align, torch.ones(T, dtype=torch.float32, device=device)


def fp8_linear_triton(x_TI: torch.Tensor, w_OI: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int],
                      bias_O: torch.Tensor | None = None) -> torch.Tensor:
    """x W^T (+ b) for an FP8 weight [O, I] with scales [ceil(O/bn), ceil(I/bk)]; x [..., I] in any float dtype."""
    rows_TI = x_TI.reshape(-1, x_TI.shape[-1]).contiguous()
    T, O = rows_TI.shape[0], w_OI.shape[0]
    y_TO = torch.empty(T, O, dtype=x_TI.dtype, device=x_TI.device)
    if T:
        config = config_for(T, block)
        align, ones_T = _dense_rows(T, config["BLOCK_SIZE_M"], x_TI.device)
        a_TI, a_scale_TG = quant_fp8_per_token_group(rows_TI, block[1])
        moe_gemm(a_TI, a_scale_TG, w_OI[None], scale_inv[None], y_TO, ones_T, align, top_k=1, fuse_silu=False,
                 mul_routed_weight=False, config=config, block_shape=tuple(block))
    if bias_O is not None:
        y_TO += bias_O
    return y_TO.view(*x_TI.shape[:-1], O)
