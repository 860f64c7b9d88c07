"""The torch backend: every op in plain torch, on any device, computing in the weights' dtype. It is the
reference the other backends are tested against; block-FP8 weights are dequantised on every call.

Legend: T tokens, H hidden, I in features, O out features, N heads, R rope dims, B decode rows,
L context length, C latent dims, E experts, K experts per token.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from moe_serve.kernels.attn_metadata import AttentionMetadata
from moe_serve.kernels.cpu_ops import mla_cache_write_reference, rms_norm_reference, rope_reference
from moe_serve.kernels.fused_moe import fused_moe
from moe_serve.kernels.ops import MLPWeights
from moe_serve.kernels.reference import DEFAULT_BLOCK_SHAPE, dequant_fp8_block
from moe_serve.kernels.routing import RouterConfig, route_reference


def future_mask(Q: int, L: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """mask_QL: True where key l is in query i's future (query i sits at position L - Q + i)."""
    return torch.arange(L, device=device)[None, :] > (torch.arange(Q, device=device) + (L - Q))[:, None]


class TorchBackend:
    name = "torch"

    def __init__(self, device: torch.device | str = "cpu", fp8_block: tuple[int, int] | None = None):
        self.device = torch.device(device)
        self.fp8_block = tuple(fp8_block or DEFAULT_BLOCK_SHAPE)

    @staticmethod
    def unavailable_reason() -> str | None:
        return None  # runs wherever torch does

    def describe(self) -> str:
        return "torch ops in the weights' dtype (the reference); FP8 weights dequantised per call"

    # ---- preparation -------------------------------------------------------------------------
    def prepare(self, model: torch.nn.Module) -> None:
        """Nothing to change: the model computes with the weights as loaded."""

    def fused_decode_layer(self, spec):
        return None

    def step_threads(self):
        """A context for one engine step's ops (the CPU kernels take the threads from torch's own ops)."""
        return contextlib.nullcontext()

    # ---- ops ---------------------------------------------------------------------------------
    def embedding(self, ids_T: torch.Tensor, weight_VH: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids_T, weight_VH)

    def dequantize(self, w: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return dequant_fp8_block(w, scale_inv, self.fp8_block).to(dtype)

    def linear(self, x_TI, w_OI, scale_inv=None, bias_O=None) -> torch.Tensor:
        w_OI = self.dequantize(w_OI, scale_inv, x_TI.dtype) if scale_inv is not None else w_OI.to(x_TI.dtype)
        return F.linear(x_TI, w_OI, None if bias_O is None else bias_O.to(x_TI.dtype))

    def rms_norm(self, x_TD, w_D, eps: float) -> torch.Tensor:
        return rms_norm_reference(x_TD, w_D, eps)

    def rope(self, x_TNR, cos_TR2, sin_TR2, interleaved: bool) -> torch.Tensor:
        return rope_reference(x_TNR, cos_TR2, sin_TR2, interleaved)

    def silu_and_mul(self, x_T2I: torch.Tensor) -> torch.Tensor:
        I = x_T2I.shape[-1] // 2
        return F.silu(x_T2I[..., :I]) * x_T2I[..., I:]

    def mla_cache_write(self, kv_TD, norm_w_C, eps, cos_TR2, sin_TR2, interleaved, kv_cache, slots_T) -> None:
        mla_cache_write_reference(kv_TD, norm_w_C, eps, cos_TR2, sin_TR2, interleaved, kv_cache, slots_T)

    def bmm_wt(self, x_BMK: torch.Tensor, w_BOK: torch.Tensor, scale_inv=None) -> torch.Tensor:
        w_BOK = self.dequantize(w_BOK, scale_inv, x_BMK.dtype) if scale_inv is not None else w_BOK.to(x_BMK.dtype)
        return torch.bmm(x_BMK, w_BOK.transpose(1, 2))

    def mla_decode(self, q_BNK: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, latent_dim: int,
                   scale: float) -> torch.Tensor:
        """Latent attention of each decode row over its cached context, in groups of rows that each pad only
        to their own longest context (rows sorted by context length)."""
        return torch.cat([self._decode_group(q_BNK[start:end], kv_cache, meta, start, end, blocks, latent_dim, scale)
                          for start, end, blocks in meta.groups()])

    def _decode_group(self, q_BNK, kv_cache, meta: AttentionMetadata, start: int, end: int, blocks: int,
                      latent_dim: int, scale: float) -> torch.Tensor:
        B = end - start
        tables_BM = meta.decode_block_tables_BM[start:end, :blocks]
        kv_BLK = meta.gather_blocks(kv_cache, tables_BM).view(B, -1, kv_cache.shape[-1]).to(q_BNK.dtype)
        scores_BNL = torch.bmm(q_BNK, kv_BLK.transpose(1, 2)).float() * scale
        scores_BNL.masked_fill_(meta.decode_padding_B1L(start, end, kv_BLK.shape[1]), float("-inf"))
        probs_BNL = scores_BNL.softmax(dim=-1).to(q_BNK.dtype)
        # The values are the latent part of each cached row. Multiplying by whole rows and dropping the rope
        # columns after is faster than a bmm on the strided latent slice (which copies it first).
        return torch.bmm(probs_BNL, kv_BLK)[..., :latent_dim]

    def prefill_attention(self, q_NQK: torch.Tensor, k_NLK: torch.Tensor, v_NLV: torch.Tensor, scale: float,
                          stored_dtype: torch.dtype) -> torch.Tensor:
        """Matmul, float32 softmax, matmul: on CPU, for 8 heads and chunks of up to a few hundred tokens, ~2x
        faster than torch's scaled_dot_product_attention with or without a mask (about as fast at 1024)."""
        Q, L = q_NQK.shape[1], k_NLK.shape[1]
        scores_NQL = torch.matmul(q_NQK, k_NLK.transpose(1, 2)).float() * scale
        scores_NQL.masked_fill_(future_mask(Q, L, q_NQK.device)[None], float("-inf"))
        return torch.matmul(scores_NQL.softmax(dim=-1).to(q_NQK.dtype), v_NLV)

    def route(self, x_TH, gate_EH, bias_E, rc: RouterConfig) -> tuple[torch.Tensor, torch.Tensor]:
        return route_reference(x_TH, gate_EH, bias_E, rc)

    def gated_mlp(self, x_TH: torch.Tensor, m: MLPWeights) -> torch.Tensor:
        return self.linear(self.silu_and_mul(self.linear(x_TH, m.w13, m.w13_scale)), m.w2, m.w2_scale)

    def fused_moe(self, x_TH, experts: MLPWeights, topk_weights_TK, topk_ids_TK,
                  shared: MLPWeights | None = None) -> torch.Tensor:
        y_TH = fused_moe(x_TH, experts.w13, experts.w2, topk_weights_TK, topk_ids_TK, w13_scale=experts.w13_scale,
                         w2_scale=experts.w2_scale, block_shape=self.fp8_block, backend="torch")
        return y_TH if shared is None else y_TH + self.gated_mlp(x_TH, shared)
