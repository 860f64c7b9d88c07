"""The kernel backend is chosen once per process (kernels/select.py) and the model's weights are held as the
checkpoint stores them: bf16 weights bf16, block-FP8 weights FP8 with their scales. The CPU backend computes
in float32 on them, through its C kernels, and gives the torch reference's greedy tokens."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from moe_serve.kernels import cpu_build, cpu_decode_layer, cpu_mla, cpu_moe
from moe_serve.kernels.backend_cpu import CpuBackend
from moe_serve.kernels.backend_torch import TorchBackend
from moe_serve.kernels.select import select_backend
from moe_serve.moe.tiny import make_checkpoint
from moe_serve.server import LLM, SamplingParams
from moe_serve.server.core.config import EngineConfig

PROMPTS = ["Hello", "The quick brown fox jumps over the lazy dog.", "1 2 3 4 5"]
needs_kernels = pytest.mark.skipif(not cpu_build.available(), reason=f"CPU kernels: {cpu_build.unavailable_reason()}")


def test_select_backend(monkeypatch):
    auto = select_backend("auto", "cpu")
    assert isinstance(auto, CpuBackend if cpu_build.available() else TorchBackend)
    assert type(select_backend("torch", "cpu")) is TorchBackend
    with pytest.raises(ValueError, match="--kernel-backend must be one of auto, torch, cpu, cuda, got 'triton'"):
        select_backend("triton", "cpu")
    if not torch.cuda.is_available():
        monkeypatch.delenv("TRITON_INTERPRET")  # (tests set it: Triton kernels then run on CPU tensors)
        with pytest.raises(ValueError, match="--kernel-backend cuda: this machine has no CUDA GPU; use --kernel-backend"):
            select_backend("cuda", "cpu")
    if cpu_build.available():
        assert select_backend("cpu", "cpu", (16, 16)).fp8_block == (16, 16)
        with pytest.raises(ValueError, match=r"cpu takes FP8 blocks of multiples of 8, this checkpoint's "
                                             r"weight_block_size is \[12, 12\]; use --kernel-backend torch"):
            select_backend("cpu", "cpu", (12, 12))
    with pytest.raises(ValueError, match="kernel_backend must be one of"):
        EngineConfig(model="m", kernel_backend="fast")


def _count_kernel_calls(monkeypatch) -> dict[str, int]:
    calls = {"mla": 0, "moe": 0, "layer": 0}
    for module, name, key in ((cpu_mla, "mla_decode_into", "mla"), (cpu_moe, "fused_moe_bf16w", "moe"),
                              (cpu_decode_layer.DecodeLayerKernel, "forward", "layer")):
        def counted(*args, _fn=getattr(module, name), _key=key, **kw):
            calls[_key] += 1
            return _fn(*args, **kw)
        monkeypatch.setattr(module, name, counted)
    return calls


def _same_greedy(got, want, max_logprob_diff: float) -> None:
    for a, b in zip(got, want):
        a, b = a.outputs[0], b.outputs[0]
        assert a.token_ids == b.token_ids
        for t, step_a, step_b in zip(a.token_ids, a.logprobs, b.logprobs):
            assert abs(step_a[t] - step_b[t]) < max_logprob_diff


@needs_kernels
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_cpu_backend_on_narrow_weights(tmp_path, monkeypatch, caplog, float32_products, fp8):
    """A bf16 checkpoint (bf16 or block-FP8 weights): the CPU backend holds the weights as stored (norm weights
    and the router in float32), a bf16 KV cache, and runs steps with prompt chunks through its MLA and experts
    kernels and all-decode steps one layer per call. The torch backend in float32 on the same values is the
    reference: the bf16 cache rounding and the kernels' summation order separate them, so the same greedy
    tokens with logprobs close (measured up to 0.014). Float32 products throughout: on random weights the
    bf16 products' rounding of activations (AMX or AVX512-BF16) reorders near-tied logits
    (tests/test_trained_model.py checks them on the trained model)."""
    caplog.set_level("INFO")
    ckpt = make_checkpoint(tmp_path / "ckpt", "v3", dtype="bfloat16", fp8=fp8)
    llm = LLM(ckpt, dtype="bfloat16", kernel_backend="cpu", max_num_batched_tokens=16)  # chunked prefill + decode
    assert any("kernel backend: cpu" in r.getMessage() for r in caplog.records)
    runner = llm.engine.runner
    assert (runner.decode_rows_limit, runner.decode_context_limit) == (256, 3072)  # prompt chunks this short, or
    runner.decode_rows_limit = runner.decode_context_limit = 0  # this early, go through the whole-layer path too:
    # off here, so that the chunks of 16 run the op-by-op MLA and experts kernels
    assert all(c.dtype == torch.bfloat16 for c in runner.kv_caches)
    weights = dict(runner.model.named_parameters())
    narrow = torch.float8_e4m3fn if fp8 else torch.bfloat16
    products = {n for n in weights if n.endswith(("proj.weight", "proj_with_mqa.weight", ".w13", ".w2"))}
    assert products and all(weights[n].dtype == narrow for n in products)
    assert all(p.dtype == torch.float32 for n, p in weights.items() if p.dim() == 1 or ".gate." in n
               or n.endswith("scale_inv"))
    calls = _count_kernel_calls(monkeypatch)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=1)
    got = llm.generate(PROMPTS, params)
    assert calls["mla"] > 0 and calls["moe"] > 0 and calls["layer"] > 0, calls
    reference = LLM(ckpt, dtype="float32", kernel_backend="torch", max_num_batched_tokens=16)
    _same_greedy(got, reference.generate(PROMPTS, params), 0.05)


def _stored_bytes(ckpt: Path) -> int:
    total = 0
    for shard in ckpt.glob("*.safetensors"):
        with safe_open(shard, "pt") as f:
            total += sum(f.get_tensor(k).nbytes for k in f.keys())
    return total


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_fp8_checkpoint_served_as_shipped(checkpoint, backend):
    """Every byte of an FP8 checkpoint stays as stored: the model holds exactly the checkpoint's bytes (FP8
    weights, their scales, the float32 rest), and both backends give the same greedy tokens."""
    if backend == "cpu" and not cpu_build.available():
        pytest.skip(f"CPU kernels: {cpu_build.unavailable_reason()}")
    ckpt = Path(checkpoint("v3", fp8=True))
    llm = LLM(ckpt, dtype="float32", kernel_backend=backend)
    model = llm.engine.runner.model
    held = sum(p.numel() * p.element_size() for p in model.parameters())
    assert held == _stored_bytes(ckpt)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=1)
    if backend == "cpu":
        reference = LLM(ckpt, dtype="float32", kernel_backend="torch")
        _same_greedy(llm.generate(PROMPTS, params), reference.generate(PROMPTS, params), 1e-3)


def test_fp8_tensor_without_its_scale_fails_before_loading(checkpoint, tmp_path):
    import json
    import shutil

    src = Path(checkpoint("v3", fp8=True))
    dst = tmp_path / "noscale"
    shutil.copytree(src, dst)
    index = json.loads((dst / "model.safetensors.index.json").read_text())
    name = "model.layers.1.mlp.experts.2.down_proj.weight_scale_inv"
    del index["weight_map"][name]
    (dst / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match=f"missing tensor {name} \\(the block scales of FP8 weight "
                                         r"model.layers.1.mlp.experts.2.down_proj.weight in model-"):
        LLM(dst, dtype="float32")


def test_cpu_linear_row_limit_routes_many_rows_to_mkl():
    """Past the row limit measured at load (cpu_bf16w.kernel_row_limit), a bf16 linear runs MKL on a widened
    copy (the torch reference, bit for bit); up to it, the C kernel (equal to float32 rounding)."""
    if not cpu_build.available():
        pytest.skip(f"CPU kernels: {cpu_build.unavailable_reason()}")
    from moe_serve.kernels import cpu_bf16w

    limit = cpu_bf16w.kernel_row_limit([(48, 32)], candidates=(4, 8))
    assert limit in (4, 8, cpu_bf16w.MAX_ROWS)
    backend = CpuBackend()
    backend.linear_row_limit = 4
    w = torch.randn(48, 32).to(torch.bfloat16)
    many, few = torch.randn(9, 32), torch.randn(3, 32)
    assert torch.equal(backend.linear(many, w), torch.nn.functional.linear(many, w.float()))
    torch.testing.assert_close(backend.linear(few, w), torch.nn.functional.linear(few, w.float()), rtol=1e-5, atol=1e-5)
