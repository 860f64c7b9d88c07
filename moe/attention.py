"""Multi-head latent attention (MLA) in the absorbed form over a paged latent cache.

The cache of one layer is `kv_cache_NBD [num_blocks, block_size, C + R]`: per token, the normalised
compressed latent (C = kv_lora_rank) followed by the rotated shared rope key (R = qk_rope_head_dim).
Nothing per head is cached. Decode queries are absorbed into latent space with W_UK, scores are taken
against the latent directly, and the attention output is lifted back out with W_UV. Prompt chunks, whose
many queries share one context, decompress that context's latents into per-head keys and values instead
and attend over those (fewer FLOPs there than in the absorbed form), unless the chunk is short for its
context (`absorbed_is_cheaper`): then the runner describes its queries as decode rows, each seeing the
context up to its own position.

Legend: T = tokens in the step, N = (local) heads, C = kv_lora_rank, R = qk_rope_head_dim,
Dn = qk_nope_head_dim, Dv = v_head_dim, L = context length, B = decode sequences, H = hidden size.
"""

from __future__ import annotations

import torch
from torch import nn

from moe_serve.kernels import ops
from moe_serve.kernels.attn_metadata import AttentionMetadata, PrefillSeq
from moe_serve.moe.config import ModelConfig
from moe_serve.moe.layers import RMSNorm, RotaryEmbedding
from moe_serve.moe.parallel_linear import ColumnParallelLinear, ReplicatedLinear, RowParallelLinear, group_rank_size


__all__ = ["AttentionMetadata", "PrefillSeq", "MLAttention"]


def absorbed_is_cheaper(num_query: int, context_len: int, cfg: ModelConfig) -> bool:
    """Whether a chunk of `num_query` queries over `context_len` cached tokens costs fewer multiply-adds
    per head in the absorbed (latent) form than with its context decompressed through kv_b_proj.

    Decompressing costs L * C * (Dn + Dv) however few the queries; the absorbed form costs per query
    Dn * C + C * Dv and per (query, key) pair C + R + C. A short chunk late in a long prompt (what a step
    carries when prompts are spread over steps) is several times cheaper absorbed; a whole prompt is not.
    """
    Q, L, C, R = num_query, context_len, cfg.kv_lora_rank, cfg.qk_rope_head_dim
    Dn, Dv = cfg.qk_nope_head_dim, cfg.v_head_dim
    absorbed = Q * (Dn * C + C * Dv) + Q * L * (2 * C + R)
    decompressed = L * C * (Dn + Dv) + Q * L * (Dn + R + Dv)
    return absorbed < decompressed


class MLAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, rope: RotaryEmbedding, tp_group=None):
        """Heads are split over `tp_group`; every rank keeps the whole latent cache of its tokens
        (the latent is shared by all heads), and o_proj's all-reduce assembles the output."""
        super().__init__()
        _, tp = group_rank_size(tp_group)
        if cfg.num_attention_heads % tp:
            raise ValueError(f"tensor parallel size {tp} does not divide {cfg.num_attention_heads} attention heads")
        self.num_heads = cfg.num_attention_heads // tp
        self.q_lora_rank, self.kv_lora_rank = cfg.q_lora_rank, cfg.kv_lora_rank
        self.nope_dim, self.rope_dim, self.v_dim = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        self.scale = cfg.softmax_scale
        self.rope = rope
        H, N_all, fp8 = cfg.hidden_size, cfg.num_attention_heads, cfg.quant_block_shape
        self.fp8_block = fp8
        if fp8 and (fp8[0] != fp8[1] or self.nope_dim % fp8[0] or self.v_dim % fp8[0]):
            raise ValueError(f"FP8 block {list(fp8)} must be square and divide qk_nope_head_dim {self.nope_dim} and "
                             f"v_head_dim {self.v_dim} (kv_b_proj is split per head at whole blocks)")
        if self.q_lora_rank is None:
            self.q_proj = ColumnParallelLinear(H, N_all * cfg.qk_head_dim, tp_group, fp8_block=fp8)
        else:
            self.q_a_proj = ReplicatedLinear(H, self.q_lora_rank, fp8)
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, cfg.rms_norm_eps)
            self.q_b_proj = ColumnParallelLinear(self.q_lora_rank, N_all * cfg.qk_head_dim, tp_group, fp8_block=fp8)
        self.kv_a_proj_with_mqa = ReplicatedLinear(H, self.kv_lora_rank + self.rope_dim, fp8)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, cfg.rms_norm_eps)
        self.kv_b_proj = ColumnParallelLinear(self.kv_lora_rank, N_all * (self.nope_dim + self.v_dim), tp_group,
                                              fp8_block=fp8)
        self.o_proj = RowParallelLinear(N_all * self.v_dim, H, tp_group, fp8_block=fp8)
        # The absorbed form's per-head up-projections, from kv_b_proj after loading (`absorb_weights`):
        # W_UK transposed to [N, C, Dn] (a copy), W_UV [N, Dv, C] (a view of kv_b_proj's weight); FP8 with
        # their block scales when the checkpoint is.
        self.w_uk_NCD = self.w_uv_NVC = self.w_uk_scale = self.w_uv_scale = None

    def absorb_weights(self) -> None:
        N, Dn, Dv, C = self.num_heads, self.nope_dim, self.v_dim, self.kv_lora_rank
        w_NXC = self.kv_b_proj.weight.detach().view(N, Dn + Dv, C)
        self.w_uk_NCD = w_NXC[:, :Dn].transpose(1, 2).contiguous()
        self.w_uv_NVC = w_NXC[:, Dn:]
        scale = self.kv_b_proj.weight_scale_inv
        if scale is not None:  # square blocks that split heads at whole blocks (checked in __init__)
            b = self.fp8_block[0]
            s_NXc = scale.detach().view(N, (Dn + Dv) // b, -1)
            self.w_uk_scale = s_NXc[:, :Dn // b].transpose(1, 2).contiguous()
            self.w_uv_scale = s_NXc[:, Dn // b:]

    def forward(self, x_TH, cos_TR2, sin_TR2, kv_cache_NBD: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        T, N, C = x_TH.shape[0], self.num_heads, self.kv_lora_rank
        if self.q_lora_rank is None:
            q = self.q_proj(x_TH)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x_TH)))
        q_nope_TND, q_pe_TNR = q.view(T, N, self.nope_dim + self.rope_dim).split([self.nope_dim, self.rope_dim], dim=-1)
        # the new tokens' latents (normalised) and rotated rope keys, into the paged cache
        ops.mla_cache_write(self.kv_a_proj_with_mqa(x_TH), self.kv_a_layernorm.weight, self.kv_a_layernorm.eps,
                            cos_TR2, sin_TR2, self.rope.interleaved, kv_cache_NBD, meta.slot_mapping_T)
        q_pe_TNR = self.rope(q_pe_TNR, cos_TR2, sin_TR2)
        out_TNV = x_TH.new_empty(T, N, self.v_dim)
        if meta.num_decodes:
            idx_B = meta.decode_token_idx_B
            # Absorb W_UK: q_lat[b, n] = W_UK[n]^T q_nope[b, n]; attend in latent space; lift out with W_UV.
            q_lat_NBC = ops.bmm_wt(q_nope_TND[idx_B].transpose(0, 1), self.w_uk_NCD, self.w_uk_scale)
            q_BNK = torch.cat((q_lat_NBC.transpose(0, 1), q_pe_TNR[idx_B]), dim=-1)
            out_lat_BNC = ops.mla_decode(q_BNK, kv_cache_NBD, meta, C, self.scale)
            out_TNV[idx_B] = ops.bmm_wt(out_lat_BNC.transpose(0, 1), self.w_uv_NVC, self.w_uv_scale).transpose(0, 1)
        for seq in meta.prefills:
            rows = slice(seq.token_start, seq.token_start + seq.num_query)
            out_TNV[rows] = self._prefill(q_nope_TND[rows], q_pe_TNR[rows], kv_cache_NBD, seq)
        return self.o_proj(out_TNV.reshape(T, N * self.v_dim))

    def _prefill(self, q_nope_QND: torch.Tensor, q_pe_QNR: torch.Tensor, kv_cache_NBD: torch.Tensor,
                 seq: PrefillSeq) -> torch.Tensor:
        """A prompt chunk attends in the non-absorbed form: its context's latents are decompressed with
        kv_b_proj into per-head keys (nope dims + the shared rope key) and values, and attention runs over
        Dn + R = 192 key dims and Dv = 128 value dims per head instead of 576 and 512 in latent space."""
        L, N = seq.context_len, self.num_heads
        kv_LK = kv_cache_NBD.index_select(0, seq.block_table).view(-1, kv_cache_NBD.shape[-1])[:L].to(q_nope_QND.dtype)
        latent_LC, k_pe_LR = kv_LK.split([self.kv_lora_rank, self.rope_dim], dim=-1)
        kv_LNX = self.kv_b_proj(latent_LC).view(L, N, self.nope_dim + self.v_dim)
        k_nope_LND, v_LNV = kv_LNX.split([self.nope_dim, self.v_dim], dim=-1)
        k_NLK = torch.cat((k_nope_LND, k_pe_LR[:, None, :].expand(L, N, self.rope_dim)), dim=-1).transpose(0, 1)
        q_NQK = torch.cat((q_nope_QND, q_pe_QNR), dim=-1).transpose(0, 1)
        out_NQV = ops.prefill_attention(q_NQK, k_NLK, v_LNV.transpose(0, 1), self.scale, kv_cache_NBD.dtype)
        return out_NQV.transpose(0, 1)
