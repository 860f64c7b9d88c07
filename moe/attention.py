"""Multi-head latent attention (MLA) in the absorbed form over a paged latent cache.

The cache of one layer is `kv_cache_NBD [num_blocks, block_size, C + R]`: per token, the normalised
compressed latent (C = kv_lora_rank) followed by the rotated shared rope key (R = qk_rope_head_dim).
Nothing per head is cached. Decode queries are absorbed into latent space with W_UK, scores are taken
against the latent directly, and the attention output is lifted back out with W_UV. Prompt chunks, whose
many queries share one context, decompress that context's latents into per-head keys and values instead
and attend over those (fewer FLOPs there than in the absorbed form).

Legend: T = tokens in the step, N = (local) heads, C = kv_lora_rank, R = qk_rope_head_dim,
Dn = qk_nope_head_dim, Dv = v_head_dim, L = context length, B = decode sequences, H = hidden size.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from moe_serve.kernels import cpu_bf16w, cpu_mla, cpu_ops
from moe_serve.moe.config import ModelConfig
from moe_serve.moe.layers import RMSNorm, RotaryEmbedding
from moe_serve.moe.parallel_linear import ColumnParallelLinear, ReplicatedLinear, RowParallelLinear, group_rank_size


@dataclass
class PrefillSeq:
    """One sequence computing more than one token this step (a prompt chunk)."""

    token_start: int  # index of its first query token in the step's flat token array
    num_query: int
    context_len: int  # tokens in the cache once this step's tokens are written
    block_table: torch.Tensor  # [ceil(context_len / block_size)] block ids


@dataclass
class AttentionMetadata:
    """Where this step's tokens live in the paged cache. Built by the runner, read by every layer."""

    slot_mapping_T: torch.Tensor  # [T] flat cache slot for each new token
    decode_token_idx_B: torch.Tensor  # [B] positions in the flat token array of single-token queries
    decode_block_tables_BM: torch.Tensor  # [B, M] block ids, padded with 0
    decode_context_lens_B: torch.Tensor  # [B]
    prefills: list[PrefillSeq] = field(default_factory=list)
    # Decode rows attend in groups (row start, row end, blocks per row): with rows sorted by context length,
    # each group pads only to its own longest context. Empty: one group of all rows, padded to M.
    decode_groups: list[tuple[int, int, int]] = field(default_factory=list)
    # Per step, shared by every layer (each layer's gather overwrites the last one's, which it no longer needs)
    _gather_buf: torch.Tensor | None = field(default=None, repr=False)
    _decode_pad: dict[int, torch.Tensor] = field(default_factory=dict, repr=False)
    _decode_i64: tuple | None = field(default=None, repr=False)

    @property
    def all_decode(self) -> bool:
        """Every token of the step is a decode query (no prompt chunk)."""
        return not self.prefills and self.num_decodes == self.slot_mapping_T.numel()

    def decode_i64(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
        """(token rows, block tables, context lengths) as contiguous int64, and the longest context: what
        the CPU decode kernel takes, made once per step."""
        if self._decode_i64 is None:
            lens_B = self.decode_context_lens_B.to(torch.int64).contiguous()
            self._decode_i64 = (self.decode_token_idx_B.to(torch.int64).contiguous(),
                                self.decode_block_tables_BM.to(torch.int64).contiguous(), lens_B,
                                int(lens_B.max()) if lens_B.numel() else 0)
        return self._decode_i64

    def gather_blocks(self, kv_cache_NBD: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
        """kv_cache_NBD rows `block_ids` (flattened), copied into this step's scratch buffer:
        [len(block_ids), block_size, D]. index_select into a reused buffer is ~3x faster on CPU than
        advanced indexing into a new tensor."""
        shape = (block_ids.numel(), *kv_cache_NBD.shape[1:])
        numel = block_ids.numel() * kv_cache_NBD[0].numel()
        if self._gather_buf is None or self._gather_buf.dtype != kv_cache_NBD.dtype or self._gather_buf.numel() < numel:
            self._gather_buf = kv_cache_NBD.new_empty(shape)
        out = self._gather_buf.view(-1)[:numel].view(shape)
        return torch.index_select(kv_cache_NBD, 0, block_ids.reshape(-1), out=out)

    def groups(self) -> list[tuple[int, int, int]]:
        return self.decode_groups or [(0, self.num_decodes, self.decode_block_tables_BM.shape[1])]

    def decode_padding_B1L(self, start: int, end: int, L: int) -> torch.Tensor:
        """True where a decode row's padded context (rows start..end, L slots) holds no token; the same
        for every layer, so made once per step."""
        if start not in self._decode_pad:
            lens_B = self.decode_context_lens_B[start:end]
            self._decode_pad[start] = (torch.arange(L, device=lens_B.device)[None, :] >= lens_B[:, None])[:, None, :]
        return self._decode_pad[start]

    @property
    def num_decodes(self) -> int:
        return int(self.decode_token_idx_B.numel())


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
        H, N_all = cfg.hidden_size, cfg.num_attention_heads
        if self.q_lora_rank is None:
            self.q_proj = ColumnParallelLinear(H, N_all * cfg.qk_head_dim, tp_group)
        else:
            self.q_a_proj = ReplicatedLinear(H, self.q_lora_rank)
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, cfg.rms_norm_eps)
            self.q_b_proj = ColumnParallelLinear(self.q_lora_rank, N_all * cfg.qk_head_dim, tp_group)
        self.kv_a_proj_with_mqa = ReplicatedLinear(H, self.kv_lora_rank + self.rope_dim)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, cfg.rms_norm_eps)
        self.kv_b_proj = ColumnParallelLinear(self.kv_lora_rank, N_all * (self.nope_dim + self.v_dim), tp_group)
        self.o_proj = RowParallelLinear(N_all * self.v_dim, H, tp_group)
        self.w_uk_NDC: torch.Tensor | None = None
        self.w_uv_NVC: torch.Tensor | None = None
        self.w_uk_NCD: torch.Tensor | None = None  # set by hold_absorbed_in: narrower weights, widened as used

    def hold_absorbed_in(self, dtype: torch.dtype) -> None:
        """Keep W_UK (as [N, C, Dn]) and W_UV in `dtype` for the CPU kernels that widen them as they compute
        (kernels/cpu_bf16w.py), with the latent attention through kernels/cpu_mla.py."""
        self.w_uk_NCD = self.w_uk_NDC.transpose(1, 2).to(dtype).contiguous()
        self.w_uv_NVC = self.w_uv_NVC.to(dtype)
        self.w_uk_NDC = None

    def absorb_weights(self) -> None:
        """Split kv_b_proj into the per-head up-projections used in the absorbed form (after loading)."""
        w = self.kv_b_proj.weight.detach().view(self.num_heads, self.nope_dim + self.v_dim, self.kv_lora_rank)
        self.w_uk_NDC = w[:, : self.nope_dim].contiguous()
        self.w_uv_NVC = w[:, self.nope_dim :].contiguous()

    def forward(self, x_TH, cos_TR2, sin_TR2, kv_cache_NBD: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        T, N, C = x_TH.shape[0], self.num_heads, self.kv_lora_rank
        if self.q_lora_rank is None:
            q = self.q_proj(x_TH)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x_TH)))
        q_TNK = q.view(T, N, self.nope_dim + self.rope_dim)
        q_nope_TND, q_pe_TNR = q_TNK.split([self.nope_dim, self.rope_dim], dim=-1)
        kv_TD = self.kv_a_proj_with_mqa(x_TH)
        if self.w_uk_NCD is not None:  # CPU kernels (bf16 weights computing in float32)
            cpu_ops.mla_cache_write(kv_TD, self.kv_a_layernorm.weight, self.kv_a_layernorm.eps, cos_TR2, sin_TR2,
                                    self.rope.interleaved, kv_cache_NBD, meta.slot_mapping_T)
            if meta.all_decode and cpu_mla.fits(q_TNK, kv_cache_NBD):
                return self.o_proj(self._decode_cpu(q_nope_TND, q_pe_TNR, cos_TR2, sin_TR2, kv_cache_NBD, meta)
                                   .view(T, N * self.v_dim))
        else:
            latent_TC, k_pe_TR = kv_TD.split([C, self.rope_dim], dim=-1)
            latent_TC = self.kv_a_layernorm(latent_TC)
            k_pe_TR = self.rope(k_pe_TR[:, None, :], cos_TR2, sin_TR2)[:, 0]
            flat_cache = kv_cache_NBD.view(-1, kv_cache_NBD.shape[-1])
            flat_cache.index_copy_(0, meta.slot_mapping_T, torch.cat((latent_TC, k_pe_TR), dim=-1).to(flat_cache.dtype))
        q_pe_TNR = self.rope(q_pe_TNR, cos_TR2, sin_TR2)

        out_TNV = x_TH.new_empty(T, N, self.v_dim)
        if meta.num_decodes:
            idx_B = meta.decode_token_idx_B
            # Absorb W_UK: q_lat[b, n] = W_UK[n]^T q_nope[b, n]; attend in latent space; lift out with W_UV.
            q_BNK = torch.cat((self._absorb_uk(q_nope_TND[idx_B]), q_pe_TNR[idx_B]), dim=-1)
            if self.w_uk_NCD is not None and cpu_mla.fits(q_BNK, kv_cache_NBD):
                _, tables_BM, lens_B, max_len = meta.decode_i64()
                out_lat_BNC = q_BNK.new_empty(q_BNK.shape[0], N, C)
                cpu_mla.mla_decode_into(q_BNK, kv_cache_NBD, tables_BM, lens_B, C, self.scale, None, max_len,
                                        out_lat_BNC)
            else:
                out_lat_BNC = torch.cat([self._decode(q_BNK[start:end], kv_cache_NBD, meta, start, end, blocks)
                                         for start, end, blocks in meta.groups()])
            out_TNV[idx_B] = self._absorb_uv(out_lat_BNC)
        for seq in meta.prefills:
            rows = slice(seq.token_start, seq.token_start + seq.num_query)
            out_TNV[rows] = self._prefill(q_nope_TND[rows], q_pe_TNR[rows], kv_cache_NBD, seq)
        return self.o_proj(out_TNV.reshape(T, N * self.v_dim))

    def _absorb_uk(self, q_nope_BND: torch.Tensor) -> torch.Tensor:
        """W_UK[n]^T q_nope[b, n] for every head: [B, N, C]."""
        if self.w_uk_NCD is None:
            return torch.bmm(q_nope_BND.transpose(0, 1), self.w_uk_NDC).transpose(0, 1)
        return cpu_bf16w.bmm(q_nope_BND.transpose(0, 1), self.w_uk_NCD).transpose(0, 1)

    def _absorb_uv(self, out_lat_BNC: torch.Tensor) -> torch.Tensor:
        """W_UV[n] out_lat[b, n] for every head: [B, N, Dv]."""
        if self.w_uk_NCD is None:
            return torch.bmm(out_lat_BNC.transpose(0, 1), self.w_uv_NVC.transpose(1, 2)).transpose(0, 1)
        return cpu_bf16w.bmm(out_lat_BNC.transpose(0, 1), self.w_uv_NVC).transpose(0, 1)

    def _decode_cpu(self, q_nope_TND: torch.Tensor, q_pe_TNR: torch.Tensor, cos_TR2: torch.Tensor,
                    sin_TR2: torch.Tensor, kv_cache_NBD: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """A step of decode queries only, through the CPU kernels, every product written in place:
        q = [W_UK^T q_nope, rope(q_pe)] per head, latent attention over the paged cache, W_UV out."""
        T, N, C = q_nope_TND.shape[0], self.num_heads, self.kv_lora_rank
        q_TNK = q_nope_TND.new_empty(T, N, C + self.rope_dim)
        cpu_bf16w.bmm_into(q_nope_TND.transpose(0, 1), self.w_uk_NCD, q_TNK[:, :, :C].transpose(0, 1))
        cpu_ops.rope_into(q_pe_TNR, cos_TR2, sin_TR2, self.rope.interleaved, q_TNK[:, :, C:])
        rows_B, tables_BM, lens_B, max_len = meta.decode_i64()
        out_lat_TNC = q_TNK.new_empty(T, N, C)
        cpu_mla.mla_decode_into(q_TNK, kv_cache_NBD, tables_BM, lens_B, C, self.scale, rows_B, max_len, out_lat_TNC)
        out_TNV = q_TNK.new_empty(T, N, self.v_dim)
        cpu_bf16w.bmm_into(out_lat_TNC.transpose(0, 1), self.w_uv_NVC, out_TNV.transpose(0, 1))
        return out_TNV

    def _decode(self, q_BNK: torch.Tensor, kv_cache_NBD: torch.Tensor, meta: AttentionMetadata, start: int,
                end: int, blocks: int) -> torch.Tensor:
        """Decode rows start..end of the step, whose contexts fit in `blocks` blocks."""
        B = end - start
        tables_BM = meta.decode_block_tables_BM[start:end, :blocks]
        kv_BLK = meta.gather_blocks(kv_cache_NBD, tables_BM).view(B, -1, kv_cache_NBD.shape[-1]).to(q_BNK.dtype)
        scores_BNL = torch.bmm(q_BNK, kv_BLK.transpose(1, 2)).float() * self.scale
        scores_BNL.masked_fill_(meta.decode_padding_B1L(start, end, kv_BLK.shape[1]), float("-inf"))
        probs_BNL = scores_BNL.softmax(dim=-1).to(q_BNK.dtype)
        # The values are the latent part of each cached row. Multiplying by whole rows and dropping the rope
        # columns after is faster than a bmm on the strided latent slice (which copies it first).
        return torch.bmm(probs_BNL, kv_BLK)[..., : self.kv_lora_rank]

    def _prefill(self, q_nope_QND: torch.Tensor, q_pe_QNR: torch.Tensor, kv_cache_NBD: torch.Tensor,
                 seq: PrefillSeq) -> torch.Tensor:
        """A prompt chunk attends in the non-absorbed form: its context's latents are decompressed with
        kv_b_proj into per-head keys (nope dims + the shared rope key) and values, and attention runs over
        Dn + R = 192 key dims and Dv = 128 value dims per head instead of 576 and 512 in latent space."""
        Q, L, N = seq.num_query, seq.context_len, self.num_heads
        kv_LK = kv_cache_NBD.index_select(0, seq.block_table).view(-1, kv_cache_NBD.shape[-1])[:L].to(q_nope_QND.dtype)
        latent_LC, k_pe_LR = kv_LK.split([self.kv_lora_rank, self.rope_dim], dim=-1)
        kv_LNX = self.kv_b_proj(latent_LC).view(L, N, self.nope_dim + self.v_dim)
        k_nope_LND, v_LNV = kv_LNX.split([self.nope_dim, self.v_dim], dim=-1)
        k_NLK = torch.cat((k_nope_LND, k_pe_LR[:, None, :].expand(L, N, self.rope_dim)), dim=-1).transpose(0, 1)
        q_NQK = torch.cat((q_nope_QND, q_pe_QNR), dim=-1).transpose(0, 1)
        # matmul, float32 softmax, matmul: at these sizes (8 heads, chunks of <= a few hundred tokens, one
        # thread) ~2x faster on CPU than torch's scaled_dot_product_attention with or without a mask.
        scores_NQL = torch.matmul(q_NQK, k_NLK.transpose(1, 2)).float() * self.scale
        # query i sits at position L - Q + i and sees keys 0..L - Q + i
        dev = q_NQK.device
        future_QL = torch.arange(L, device=dev)[None, :] > (torch.arange(Q, device=dev) + (L - Q))[:, None]
        scores_NQL.masked_fill_(future_QL[None], float("-inf"))
        out_NQV = torch.matmul(scores_NQL.softmax(dim=-1).to(q_NQK.dtype), v_LNV.transpose(0, 1))
        return out_NQV.transpose(0, 1)
