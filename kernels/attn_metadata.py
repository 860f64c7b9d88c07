"""What a step's attention needs to know about the paged latent cache: where each new token goes, which
rows decode and over which blocks, which rows are prompt chunks. Built by the runner, read by every
layer and by the attention kernels of each backend.

Legend: T = tokens in the step, B = decode sequences, M = blocks per decode row, L = context length.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


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
