"""MoE compute kernels: the fused routed-experts op, its torch reference, and the Triton path's pieces.

Imports only torch here; triton is imported when the Triton backend is first used.
"""

from moe_serve.kernels.fused_moe import fused_moe
from moe_serve.kernels.moe_align import moe_align_block_size
from moe_serve.kernels.reference import dequant_fp8_block, fused_moe_reference, quant_fp8_per_token_group_reference

__all__ = [
    "fused_moe",
    "fused_moe_reference",
    "dequant_fp8_block",
    "quant_fp8_per_token_group_reference",
    "moe_align_block_size",
]
