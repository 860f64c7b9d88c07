"""Decode attention in length-sorted groups (each padded only to its own longest context) gives the same
output as one group padded to the longest context of the step."""

from __future__ import annotations

import torch

from moe_serve.moe.attention import AttentionMetadata, MLAttention
from moe_serve.moe.config import ModelConfig
from moe_serve.moe.layers import RotaryEmbedding
from moe_serve.server.core.runner import decode_group_bounds


def test_group_bounds_cover_rows_once():
    assert decode_group_bounds(0) == []
    assert decode_group_bounds(5) == [(0, 5)]
    assert decode_group_bounds(40, 16) == [(0, 16), (16, 32), (32, 40)]
    assert decode_group_bounds(36, 16) == [(0, 16), (16, 36)]  # a remainder under half a group joins the last


def test_grouped_decode_equals_one_padded_group(checkpoint):
    torch.manual_seed(0)
    cfg = ModelConfig.from_dir(checkpoint("v3"))
    attn = MLAttention(cfg, RotaryEmbedding(cfg))
    for p in attn.parameters():
        p.data.normal_(0, 0.2)
    attn.absorb_weights()
    block_size, B = 4, 37
    lens = sorted(torch.randint(1, 40, (B,)).tolist())  # rows sorted by context length, as the runner sends them
    tables, next_block = [], 0
    for n in lens:
        blocks = -(-n // block_size)
        tables.append(list(range(next_block, next_block + blocks)))
        next_block += blocks
    cache = torch.randn(next_block, block_size, cfg.kv_cache_dim)
    width = max(map(len, tables))
    padded = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    slots = torch.tensor([t[(n - 1) // block_size] * block_size + (n - 1) % block_size for t, n in zip(tables, lens)])
    x = torch.randn(B, cfg.hidden_size)
    cos, sin = attn.rope.cos_sin(torch.tensor(lens) - 1)

    def run(groups):
        meta = AttentionMetadata(slot_mapping_T=slots, decode_token_idx_B=torch.arange(B), decode_block_tables_BM=padded,
                                 decode_context_lens_B=torch.tensor(lens), decode_groups=groups)
        with torch.no_grad():
            return attn(x, cos, sin, cache.clone(), meta)

    groups = [(g0, g1, len(tables[g1 - 1])) for g0, g1 in decode_group_bounds(B, 8)]
    assert len(groups) == 5 and groups[0][2] < width
    torch.testing.assert_close(run(groups), run([]), rtol=1e-5, atol=1e-5)
