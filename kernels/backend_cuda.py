"""The CUDA backend: the Triton fused MoE (kernels/fused_moe_triton.py) for routed experts, w8a8 block-FP8
GEMMs for FP8 linears and experts (activations quantised per token group, kernels/fp8_linear_triton.py),
and torch CUDA ops for the rest (as the torch backend). With TRITON_INTERPRET=1 set before triton is
imported, its kernels also run on CPU tensors at small shapes (how tests and scripts/gpu_check.py exercise
them without a GPU).
"""

from __future__ import annotations

import os

import torch

from moe_serve.kernels.backend_torch import TorchBackend
from moe_serve.kernels.fused_moe import fused_moe
from moe_serve.kernels.ops import MLPWeights


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


class CudaBackend(TorchBackend):
    name = "cuda"

    def __init__(self, device: torch.device | str = "cuda", fp8_block: tuple[int, int] | None = None):
        super().__init__(device, fp8_block)
        if self.device.type != "cuda" and not interpreting():
            raise ValueError(f"--kernel-backend cuda runs on a CUDA device, not on {self.device}")
        if fp8_block and any(b < 16 or b & (b - 1) for b in fp8_block):  # Triton tiles are powers of two
            raise ValueError(f"--kernel-backend cuda takes FP8 blocks of powers of two from 16, this checkpoint's "
                             f"weight_block_size is {list(fp8_block)}; use --kernel-backend torch")

    @staticmethod
    def unavailable_reason() -> str | None:
        if not torch.cuda.is_available() and not interpreting():
            return "this machine has no CUDA GPU"
        try:
            import triton  # noqa: F401
        except ImportError as err:
            return f"triton cannot be imported ({err})"
        return None

    def describe(self) -> str:
        return "Triton fused MoE and w8a8 block-FP8 GEMMs, torch CUDA ops elsewhere"

    def linear(self, x_TI, w_OI, scale_inv=None, bias_O=None) -> torch.Tensor:
        if scale_inv is None:
            return super().linear(x_TI, w_OI, None, bias_O)
        from moe_serve.kernels.fp8_linear_triton import fp8_linear_triton

        return fp8_linear_triton(x_TI, w_OI, scale_inv, self.fp8_block, bias_O)

    def fused_moe(self, x_TH, experts: MLPWeights, topk_weights_TK, topk_ids_TK,
                  shared: MLPWeights | None = None) -> torch.Tensor:
        y_TH = fused_moe(x_TH, experts.w13, experts.w2, topk_weights_TK, topk_ids_TK, w13_scale=experts.w13_scale,
                         w2_scale=experts.w2_scale, block_shape=self.fp8_block, backend="triton")
        return y_TH if shared is None else y_TH + self.gated_mlp(x_TH, shared)
