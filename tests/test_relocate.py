"""Relocating expert slots moves everything a slot holds: bf16 weights, or FP8 weights with their block scales
(experts/relocate.py; here on one rank: the multi-rank exchange is in tests/test_eplb.py's workers)."""

from __future__ import annotations

import torch

from moe_serve.experts.relocate import relocate
from moe_serve.experts.weights import ExpertWeights


def _filled(fp8_block) -> ExpertWeights:
    experts = ExpertWeights([0, 1, 2, 3], hidden_size=32, intermediate_size=16, fp8_block=fp8_block)
    g = torch.Generator().manual_seed(0)
    for t in experts.slot_tensors():  # every slot distinct, every byte pattern a valid value
        t.copy_((torch.randn(t.shape, generator=g) * 4).to(t.dtype))
    return experts


def test_relocation_moves_fp8_weights_with_their_scales():
    experts = _filled((16, 16))
    assert [t.dtype for t in experts.slot_tensors()] == [torch.float8_e4m3fn] * 2 + [torch.float32] * 2
    before = [t.clone() for t in experts.slot_tensors()]
    old, new = [0, 1, 2, 3], [2, 1, 3, 2]  # expert 2 twice, expert 0 dropped
    assert relocate(experts.slot_tensors(), old, new, None) == 3
    for slot, expert in enumerate(new):
        for t, b in zip(experts.slot_tensors(), before):
            assert torch.equal(t[slot].view(torch.uint8), b[old.index(expert)].view(torch.uint8)), (slot, t.dtype)


def test_relocation_of_bf16_weights():
    experts = ExpertWeights([0, 1, 2], hidden_size=8, intermediate_size=4)
    with torch.no_grad():
        for t in experts.slot_tensors():
            t.copy_(torch.arange(t.numel(), dtype=torch.float32).view(t.shape))
    before = [t.clone() for t in experts.slot_tensors()]
    assert relocate(experts.slot_tensors(), [0, 1, 2], [1, 2, 0], None) == 3
    for slot, src in enumerate([1, 2, 0]):
        assert all(torch.equal(t[slot], b[src]) for t, b in zip(experts.slot_tensors(), before))
