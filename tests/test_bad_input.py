"""Bad input gets a clear ValueError naming the field; the engine stays usable afterwards."""

from __future__ import annotations

import subprocess
import sys

import pytest

from moe_serve.server import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm(checkpoint):
    return LLM(checkpoint("v3"), dtype="float32", max_model_len=64)


def test_prompt_longer_than_max_model_len(llm):
    with pytest.raises(ValueError, match="prompt has 80 tokens; the maximum is 63"):
        llm.generate([[5] * 80], SamplingParams(max_tokens=4))


@pytest.mark.parametrize("prompt", ["", []])
def test_empty_prompt(llm, prompt):
    with pytest.raises(ValueError, match="prompt is empty"):
        llm.generate([prompt], SamplingParams(max_tokens=4))


def test_token_ids_out_of_vocab(llm):
    with pytest.raises(ValueError, match="prompt token ids"):
        llm.generate([[1, 10**6]], SamplingParams(max_tokens=4))


@pytest.mark.parametrize("kw,field", [({"max_tokens": -1}, "max_tokens"), ({"top_p": 1.5}, "top_p"),
                                      ({"top_p": 0.0}, "top_p"), ({"temperature": -1.0}, "temperature")])
def test_bad_sampling_params(kw, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kw)


def test_unknown_dtype(checkpoint):
    with pytest.raises(ValueError, match="dtype 'float13'"):
        LLM(checkpoint("v3"), dtype="float13")


def test_not_a_checkpoint(tmp_path):
    with pytest.raises(ValueError, match="not a checkpoint directory"):
        LLM(str(tmp_path))


def test_missing_tensor_names_tensor_and_file(checkpoint, tmp_path):
    import json
    import shutil

    src = checkpoint("v3")
    dst = tmp_path / "broken"
    shutil.copytree(src, dst)
    index = json.loads((dst / "model.safetensors.index.json").read_text())
    name = "model.layers.1.self_attn.kv_b_proj.weight"
    file = index["weight_map"].pop(name)
    (dst / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match=f"missing tensor {name}"):
        LLM(str(dst), dtype="float32")
    assert file  # the index named the file it was in


def test_engine_still_works_after_bad_input(llm):
    with pytest.raises(ValueError):
        llm.generate(["ok", ""], SamplingParams(max_tokens=4))
    out = llm.generate(["still serving"], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 3
    assert not llm.engine.has_unfinished_requests()


def test_cli_generate_and_error(checkpoint):
    ok = subprocess.run([sys.executable, "-m", "moe_serve.server", "generate", checkpoint("v3"), "--prompt", "Hi",
                         "--max-tokens", "4", "--dtype", "float32"], capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0, ok.stderr
    assert "tokens/s" in ok.stdout
    bad = subprocess.run([sys.executable, "-m", "moe_serve.server", "generate", checkpoint("v3"), "--dtype", "float13"],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2
    assert bad.stderr.strip().splitlines() == ["moe: error: dtype 'float13' is not supported; expected one of "
                                               "['float32', 'bfloat16', 'float16', 'auto']"]
