"""The oneDNN-packed bf16 linear (kernels/cpu_linear.py) equals its torch reference, F.linear, and the
model's layers use it only where it applies."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from moe_serve.kernels import cpu_linear
from moe_serve.moe.parallel_linear import ColumnParallelLinear


@pytest.mark.parametrize("rows", [1, 3, 8, 64, 257])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_equals_reference(rows, bias):
    torch.manual_seed(rows)
    w = torch.randn(96, 80, dtype=torch.bfloat16)
    b = torch.randn(96, dtype=torch.bfloat16) if bias else None
    x = torch.randn(rows, 80, dtype=torch.bfloat16)
    packed = cpu_linear.pack(w)
    if packed is None:
        pytest.skip("oneDNN bf16 is not available on this CPU (needs AVX512 or AVX-NE-CONVERT)")
    torch.testing.assert_close(cpu_linear.linear(x, w, packed, b), F.linear(x, w, b), rtol=1.6e-2, atol=1e-2)
    x3 = x.view(1, rows, 80).transpose(0, 1)  # leading dims and a non-contiguous input
    torch.testing.assert_close(cpu_linear.linear(x3, w, packed, b), F.linear(x3, w, b), rtol=1.6e-2, atol=1e-2)


def test_only_bf16_cpu_weights_are_packed():
    assert cpu_linear.pack(torch.randn(8, 8)) is None  # float32 keeps F.linear (parity tests run there)
    layer = ColumnParallelLinear(16, 32)
    layer.weight.data = torch.randn(32, 16, dtype=torch.bfloat16)
    layer.pack_weight()
    x = torch.randn(5, 16, dtype=torch.bfloat16)
    assert (layer.packed is not None) == cpu_linear.can_pack(layer.weight)
    torch.testing.assert_close(layer(x), F.linear(x, layer.weight), rtol=1.6e-2, atol=1e-2)


def test_bf16_engine_same_tokens_with_and_without_packing(checkpoint, monkeypatch):
    """The packed path changes the speed of a bf16 model on CPU, not its output: greedy tokens and logprobs
    equal those of the same engine with every layer on F.linear."""
    from moe_serve.server import LLM, SamplingParams

    ckpt = checkpoint("v3")
    prompts = ["Hello", "The quick brown fox jumps over the lazy dog.", "1 2 3 4 5"]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=2)

    def run():
        llm = LLM(ckpt, dtype="bfloat16", max_num_batched_tokens=16)  # chunked prefill as well as decode
        packed = [m.packed is not None for m in llm.engine.runner.model.modules() if hasattr(m, "pack_weight")]
        return llm.generate(prompts, params), packed

    with_packing, packed = run()
    assert all(packed) == cpu_linear.can_pack(torch.empty(2, 2, dtype=torch.bfloat16))
    monkeypatch.setattr(cpu_linear, "pack", lambda weight: None)
    without, unpacked = run()
    assert not any(unpacked)
    for a, b in zip(with_packing, without):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for step_a, step_b in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert step_a.keys() == step_b.keys()
            assert all(abs(step_a[k] - step_b[k]) < 1e-2 for k in step_a)
