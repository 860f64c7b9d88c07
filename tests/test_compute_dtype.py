"""bf16 on a CPU without bf16 arithmetic computes in float32 on bf16-rounded weights (server/core/runner.py)."""

from __future__ import annotations

import pytest
import torch

from moe_serve.kernels import cpu_build, cpu_decode_layer, cpu_mla, cpu_moe
from moe_serve.kernels.cpu_linear import bf16_supported
from moe_serve.moe.tiny import make_checkpoint
from moe_serve.server import LLM, SamplingParams
from moe_serve.server.core.runner import compute_dtype

PROMPTS = ["Hello", "The quick brown fox jumps over the lazy dog.", "1 2 3 4 5"]


def test_compute_dtype_follows_the_cpu():
    cpu = torch.device("cpu")
    assert compute_dtype(torch.float32, cpu) == torch.float32
    assert compute_dtype(torch.float16, cpu) == torch.float16
    assert compute_dtype(torch.bfloat16, cpu) == (torch.bfloat16 if bf16_supported() else torch.float32)


def test_compute_dtype_can_be_chosen(monkeypatch):
    cpu = torch.device("cpu")
    monkeypatch.setenv("MOE_CPU_BF16_COMPUTE", "float32")
    assert compute_dtype(torch.bfloat16, cpu) == torch.float32
    assert compute_dtype(torch.float16, cpu) == torch.float16  # only bf16 is widened
    monkeypatch.setenv("MOE_CPU_BF16_COMPUTE", "bfloat16")
    assert compute_dtype(torch.bfloat16, cpu) == torch.bfloat16
    monkeypatch.setenv("MOE_CPU_BF16_COMPUTE", "fp32")
    with pytest.raises(ValueError, match="MOE_CPU_BF16_COMPUTE must be auto, float32 or bfloat16"):
        compute_dtype(torch.bfloat16, cpu)


def test_bf16_without_bf16_arithmetic(tmp_path, monkeypatch, caplog):
    """As on an AVX2-only CPU (whatever this one has): float32 compute, linear and expert weights held in
    bf16, the others in float32 with bf16 values, a bf16 KV cache. On a bf16 checkpoint the weights are
    those of the float32 engine (but the router bias), so the rounding of the cache and that bias (and the
    kernels' summation order) separate the two: same greedy tokens, logprobs within bf16 rounding."""
    from moe_serve.server.core import runner as server_runner
    caplog.set_level("INFO")
    monkeypatch.setattr(server_runner, "bf16_supported", lambda: False)
    ckpt = make_checkpoint(tmp_path / "bf16", "v3", dtype="bfloat16")
    llm = LLM(ckpt, dtype="bfloat16", max_num_batched_tokens=16)  # chunked prefill as well as decode
    runner = llm.engine.runner
    assert runner.compute_dtype == torch.float32
    assert any("no bf16 arithmetic" in r.getMessage() for r in caplog.records)
    assert all(c.dtype == torch.bfloat16 for c in runner.kv_caches)
    full = LLM(ckpt, dtype="float32", max_num_batched_tokens=16)
    weights = dict(runner.model.named_parameters())
    held_bf16 = {n for n, p in weights.items() if p.dtype == torch.bfloat16}
    linears = ("proj.weight", "proj_with_mqa.weight", "lm_head.weight", ".w13", ".w2")
    assert held_bf16 == {n for n in weights if n.endswith(linears)}
    assert all(p.dtype == torch.float32 for n, p in weights.items() if n not in held_bf16)
    for name, q in full.engine.runner.model.named_parameters():
        if "e_score_correction_bias" in name:  # float32 in the checkpoint (as DeepSeek's): rounded to bf16
            assert torch.equal(weights[name], q.to(torch.bfloat16).float())
        else:
            assert torch.equal(weights[name].float(), q), name

    # where the kernels can be built, steps must run through them: all-decode steps one layer per call
    # (cpu_decode_layer), steps with prompt chunks through the MLA and experts kernels
    calls = {"mla": 0, "moe": 0, "layer": 0}
    for module, name, key in ((cpu_mla, "mla_decode_into", "mla"), (cpu_moe, "fused_moe_bf16w", "moe"),
                              (cpu_decode_layer.DecodeLayerKernel, "forward", "layer")):
        def counted(*args, _fn=getattr(module, name), _key=key):
            calls[_key] += 1
            return _fn(*args)
        monkeypatch.setattr(module, name, counted)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=1)
    outputs = llm.generate(PROMPTS, params)
    assert (calls["mla"] > 0 and calls["moe"] > 0 and calls["layer"] > 0) == (cpu_build.lib() is not None), calls
    for a, b in zip(outputs, full.generate(PROMPTS, params)):
        a, b = a.outputs[0], b.outputs[0]
        assert a.token_ids == b.token_ids
        for t, step_a, step_b in zip(a.token_ids, a.logprobs, b.logprobs):
            assert abs(step_a[t] - step_b[t]) < 0.05  # measured up to 0.014


def test_fp32_checkpoint_rounded_to_bf16(checkpoint, monkeypatch):
    """--dtype bfloat16 on a float32 checkpoint holds the bf16 values of its weights, not the float32 ones."""
    from moe_serve.server.core import runner as server_runner
    monkeypatch.setattr(server_runner, "bf16_supported", lambda: False)
    ckpt = checkpoint("v3")
    weights = [p.float() for p in LLM(ckpt, dtype="bfloat16").engine.runner.model.parameters() if p.numel() > 1]
    assert all(torch.equal(p, p.to(torch.bfloat16).float()) for p in weights)
    full = [p for p in LLM(ckpt, dtype="float32").engine.runner.model.parameters() if p.numel() > 1]
    assert not all(torch.equal(p, q) for p, q in zip(weights, full))
