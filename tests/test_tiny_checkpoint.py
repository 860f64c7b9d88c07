"""The tiny random checkpoints: HF layout, tokenizer, FP8 and MTP tensors, and decisive greedy decoding."""

from __future__ import annotations

import json
import re

import pytest
import torch
from safetensors import safe_open
from transformers import AutoTokenizer

from moe_serve.moe.tiny import (
    PRESETS,
    dequantize_fp8_block,
    ensure_checkpoint,
    load_reference_model,
    make_checkpoint,
    shipped_layout,
    quantize_fp8_block,
)

PROMPTS = ["The quick brown fox", "Once upon a time", "def add(a, b):", "What is the capital of France?",
           "Numbers: 1 2 3"]
MIN_GREEDY_GAP = 1e-3  # measured minima are 2e-3..2e-2; float32 cache-vs-no-cache noise is ~3e-5


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """Tiny matmuls run far faster on one thread; two spin-waiting threads crawl on a busy 2-core box."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _build(factory, name, preset, **kw):
    return make_checkpoint(factory.mktemp(name), preset, **kw)


@pytest.fixture(scope="module")
def v3(tmp_path_factory):
    return _build(tmp_path_factory, "v3", "v3")


@pytest.fixture(scope="module")
def v2(tmp_path_factory):
    return _build(tmp_path_factory, "v2", "v2")


@pytest.fixture(scope="module")
def v2_group(tmp_path_factory):
    return _build(tmp_path_factory, "v2g", "v2-group")


@pytest.fixture(scope="module")
def v3_fp8_mtp(tmp_path_factory):
    return _build(tmp_path_factory, "v3fp8", "v3", fp8=True, mtp=True, num_shards=3)


def _tensors(ckpt) -> dict[str, torch.Tensor]:
    index = json.loads((ckpt / "model.safetensors.index.json").read_text())
    out = {}
    for fname in sorted(set(index["weight_map"].values())):
        with safe_open(str(ckpt / fname), framework="pt") as f:
            out.update({k: f.get_tensor(k) for k in f.keys()})
    assert set(out) == set(index["weight_map"])
    return out


def test_files_and_shards(v3):
    for name in ["config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                 "model.safetensors.index.json"]:
        assert (v3 / name).exists(), name
    index = json.loads((v3 / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert files == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    assert all((v3 / f).exists() for f in files)
    sizes = {k: t.numel() * t.element_size() for k, t in _tensors(v3).items()}
    assert index["metadata"]["total_size"] == sum(sizes.values())


def test_config_keys(v3, v2, v2_group):
    for ckpt, preset in [(v3, "v3"), (v2, "v2"), (v2_group, "v2-group")]:
        cfg = json.loads((ckpt / "config.json").read_text())
        want = PRESETS[preset]
        for key in ["model_type", "topk_method", "scoring_func", "torch_dtype", "n_routed_experts",
                    "num_experts_per_tok", "n_group", "topk_group", "routed_scaling_factor", "q_lora_rank"]:
            assert cfg[key] == want[key], key
        tok = AutoTokenizer.from_pretrained(ckpt)
        assert cfg["vocab_size"] == len(tok)
        assert (cfg["bos_token_id"], cfg["eos_token_id"], cfg["pad_token_id"]) == (
            tok.bos_token_id, tok.eos_token_id, tok.pad_token_id)
        assert cfg["num_nextn_predict_layers"] == 0 and "quantization_config" not in cfg
    cfg = json.loads((v3 / "config.json").read_text())
    assert cfg["rope_scaling"]["type"] == "yarn" and cfg["rope_interleave"] is True


def test_deepseek_key_layout(v3, v2):
    for ckpt in (v3, v2):
        cfg = json.loads((ckpt / "config.json").read_text())
        keys = set(_tensors(ckpt))
        assert {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"} <= keys
        assert "model.layers.0.mlp.gate_proj.weight" in keys  # dense first layer
        last = cfg["num_hidden_layers"] - 1
        for e in range(cfg["n_routed_experts"]):
            for proj in ("gate_proj", "up_proj", "down_proj"):
                assert f"model.layers.{last}.mlp.experts.{e}.{proj}.weight" in keys
        assert f"model.layers.{last}.mlp.shared_experts.down_proj.weight" in keys
        assert f"model.layers.{last}.mlp.gate.weight" in keys
        assert f"model.layers.{last}.self_attn.kv_a_proj_with_mqa.weight" in keys
        assert not any(re.match(rf"model\.layers\.{cfg['num_hidden_layers']}\.", k) for k in keys)
    v3_keys = set(_tensors(v3))
    assert "model.layers.1.mlp.gate.e_score_correction_bias" in v3_keys
    assert "model.layers.1.self_attn.q_a_proj.weight" in v3_keys
    assert "model.layers.1.self_attn.q_proj.weight" in set(_tensors(v2))  # V2-Lite: no q LoRA


def test_score_bias_nonzero(v3):
    bias = _tensors(v3)["model.layers.1.mlp.gate.e_score_correction_bias"]
    assert bias.dtype == torch.float32 and (bias != 0).all() and bias.abs().max() < 0.5


def test_tokenizer(v3):
    tok = AutoTokenizer.from_pretrained(v3)
    text = "Hello world! The router picks 4 experts; x * y = 25."
    ids = tok(text).input_ids
    assert ids[0] == tok.bos_token_id
    assert tok.decode(ids, skip_special_tokens=True) == text
    assert tok.chat_template
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    prompt = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert prompt == "<|bos|><|system|>\nBe brief.<|eos|>\n<|user|>\nHi<|eos|>\n<|assistant|>\n"
    chat_ids = tok.apply_chat_template(msgs, add_generation_prompt=True, return_dict=False)
    assert chat_ids[0] == tok.bos_token_id and chat_ids.count(tok.bos_token_id) == 1


def test_same_seed_same_weights(v3, tmp_path):
    again = make_checkpoint(tmp_path / "again", "v3", num_shards=1)
    assert (again / "model.safetensors").exists()
    with safe_open(str(again / "model.safetensors"), framework="pt") as f:
        again_tensors = {k: f.get_tensor(k) for k in f.keys()}
    first = _tensors(v3)
    assert set(again_tensors) == set(first)
    assert all(torch.equal(first[k], again_tensors[k]) for k in first)
    assert (again / "tokenizer.json").read_text() == (v3 / "tokenizer.json").read_text()


def _greedy(model, tok, prompt, n=16):
    ids = tok(prompt, return_tensors="pt").input_ids
    out = model.generate(ids, max_new_tokens=n, do_sample=False, output_logits=True,
                         return_dict_in_generate=True)
    return ids, out.sequences, torch.stack(out.logits, 1)[0]


@pytest.mark.parametrize("name", ["v3", "v2", "v2_group"])
def test_greedy_decisive_and_deterministic(name, request):
    ckpt = request.getfixturevalue(name)
    tok = AutoTokenizer.from_pretrained(ckpt)
    model = load_reference_model(ckpt)
    gaps = []
    for i, prompt in enumerate(PROMPTS):
        ids, seq, logits_TV = _greedy(model, tok, prompt)
        if i == 0:
            assert torch.equal(seq, _greedy(model, tok, prompt)[1])  # deterministic
        top2_T2 = logits_TV.topk(2, dim=-1).values
        gaps.append((top2_T2[:, 0] - top2_T2[:, 1]).min().item())
        # decoding with the KV cache and one full forward pass choose the same tokens
        with torch.no_grad():
            full_TV = model(seq).logits[0, ids.shape[1] - 1:-1]
        assert torch.equal(full_TV.argmax(-1), seq[0, ids.shape[1]:])
        assert (full_TV - logits_TV).abs().max() < 1e-3
    assert min(gaps) > MIN_GREEDY_GAP, gaps


def test_load_reference_matches_from_pretrained(v2_group):
    from transformers import AutoModelForCausalLM

    ref = load_reference_model(v2_group)
    hf = AutoModelForCausalLM.from_pretrained(v2_group)
    assert ref.state_dict().keys() == hf.state_dict().keys()
    assert all(torch.equal(a, b) for a, b in zip(ref.state_dict().values(), hf.state_dict().values()))


def test_dequantize_round_trip():
    w = torch.randn(300, 200) * torch.linspace(0.01, 3.0, 200)  # 3x2 blocks, partial at the edges
    w_fp8, scale_inv = quantize_fp8_block(w)
    assert w_fp8.dtype == torch.float8_e4m3fn and scale_inv.shape == (3, 2) and scale_inv.dtype == torch.float32
    deq = dequantize_fp8_block(w_fp8, scale_inv)
    assert deq.shape == w.shape and deq.dtype == torch.float32
    assert ((deq - w).norm() / w.norm()) < 0.05
    block = w[256:, 128:]  # the partial corner block maps its max magnitude to 448
    assert torch.isclose(scale_inv[2, 1], block.abs().max() / 448.0)
    with pytest.raises(ValueError, match="scale_inv shape"):
        dequantize_fp8_block(w_fp8, scale_inv[:2])


def test_fp8_and_mtp_checkpoint(v3_fp8_mtp, v3):
    cfg = json.loads((v3_fp8_mtp / "config.json").read_text())
    # blocks of 16: the largest that splits the tiny model's 16-dim heads into whole blocks (DeepSeek-V3: 128)
    assert cfg["quantization_config"] == {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                          "weight_block_size": [16, 16]}
    assert cfg["num_nextn_predict_layers"] == 1
    index = json.loads((v3_fp8_mtp / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) == 3
    tensors, plain = _tensors(v3_fp8_mtp), _tensors(v3)
    fp8_keys = [k for k, t in tensors.items() if t.dtype == torch.float8_e4m3fn]
    assert "model.layers.1.mlp.experts.3.up_proj.weight" in fp8_keys
    assert "model.layers.0.self_attn.kv_b_proj.weight" in fp8_keys
    for k in ["model.embed_tokens.weight", "lm_head.weight", "model.layers.1.mlp.gate.weight",
              "model.layers.1.input_layernorm.weight"]:
        assert tensors[k].dtype == torch.float32, k
    for k in fp8_keys:
        w, s = tensors[k], tensors[k + "_scale_inv"]
        assert s.dtype == torch.float32
        assert tuple(s.shape) == (-(-w.shape[0] // 16), -(-w.shape[1] // 16))
        if k in plain:  # same seed: FP8 weights are the plain ones, quantized
            deq = dequantize_fp8_block(w, s, (16, 16))
            assert ((deq - plain[k]).norm() / plain[k].norm()) < 0.05, k
    n = cfg["num_hidden_layers"]
    for k in ["embed_tokens.weight", "enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight",
              "shared_head.head.weight", "self_attn.kv_b_proj.weight", "mlp.experts.0.up_proj.weight",
              "mlp.gate.e_score_correction_bias"]:
        assert f"model.layers.{n}.{k}" in tensors, k
    assert tensors[f"model.layers.{n}.eh_proj.weight"].shape == (cfg["hidden_size"], 2 * cfg["hidden_size"])


def test_reference_model_fp8_mtp(v3_fp8_mtp):
    model = load_reference_model(v3_fp8_mtp)
    assert len(model.model.layers) == json.loads((v3_fp8_mtp / "config.json").read_text())["num_hidden_layers"]
    assert getattr(model.config, "quantization_config", None) is None
    tensors = _tensors(v3_fp8_mtp)
    key = "model.layers.2.mlp.experts.5.down_proj.weight"
    want = dequantize_fp8_block(tensors[key], tensors[key + "_scale_inv"], (16, 16))  # the tiny model's blocks
    assert torch.equal(shipped_layout(model.state_dict())[key], want)
    tok = AutoTokenizer.from_pretrained(v3_fp8_mtp)
    _, seq, _ = _greedy(model, tok, "Once upon a time", n=8)
    assert len(tok("Once upon a time").input_ids) < seq.shape[1] <= len(tok("Once upon a time").input_ids) + 8


def test_reference_model_rejects_unknown_keys(v2, tmp_path):
    import shutil

    from safetensors.torch import save_file

    bad = tmp_path / "bad"
    shutil.copytree(v2, bad)
    index_path = bad / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    save_file({"model.layers.0.mlp.bogus.weight": torch.zeros(2, 2)}, bad / "extra.safetensors")
    index["weight_map"]["model.layers.0.mlp.bogus.weight"] = "extra.safetensors"
    index_path.write_text(json.dumps(index))
    with pytest.raises(ValueError, match="unexpected"):
        load_reference_model(bad)


def test_ensure_checkpoint_and_errors(v2, tmp_path):
    stamp = (v2 / "config.json").stat().st_mtime_ns
    assert ensure_checkpoint(v2, "v2") == v2
    assert (v2 / "config.json").stat().st_mtime_ns == stamp
    with pytest.raises(ValueError, match="unknown preset"):
        make_checkpoint(tmp_path / "x", "v4")
    with pytest.raises(ValueError, match="num_shards"):
        make_checkpoint(tmp_path / "y", "v2", num_shards=0)


def test_bfloat16_and_overrides(tmp_path):
    ckpt = make_checkpoint(tmp_path / "bf16", "v2", dtype="bfloat16", overrides={"num_hidden_layers": 2})
    cfg = json.loads((ckpt / "config.json").read_text())
    assert cfg["torch_dtype"] == "bfloat16" and cfg["num_hidden_layers"] == 2
    tensors = _tensors(ckpt)
    assert tensors["model.layers.1.mlp.experts.0.up_proj.weight"].dtype == torch.bfloat16
    model = load_reference_model(ckpt, dtype=torch.bfloat16)
    assert model.dtype == torch.bfloat16 and len(model.model.layers) == 2


def test_fp8_block_fits_the_model():
    from types import SimpleNamespace

    from moe_serve.moe.tiny import fp8_block_for

    dims = dict(qk_nope_head_dim=128, v_head_dim=128, moe_intermediate_size=256, intermediate_size=1024)
    assert fp8_block_for(SimpleNamespace(**dims)) == (128, 128)  # DeepSeek-V3's, where whole blocks fit
    assert fp8_block_for(SimpleNamespace(**{**dims, "moe_intermediate_size": 64})) == (32, 32)  # 32 per TP rank
    assert fp8_block_for(SimpleNamespace(**{**dims, "qk_nope_head_dim": 16})) == (16, 16)
    with pytest.raises(ValueError, match="no FP8 block"):
        fp8_block_for(SimpleNamespace(**{**dims, "v_head_dim": 8}))
