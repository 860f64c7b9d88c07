"""Greedy float32 tokens and logprobs of the engine equal transformers' implementation of the same
checkpoint, for V3-style (YaRN, sigmoid + bias, noaux_tc), V2-Lite-style (no q_lora, softmax, greedy)
and V2 group-limited routing; in one mixed batch, under KV pressure (preemptions) and with shared
prefixes (prefix-cache hits); on the cpu and torch kernel backends."""

from __future__ import annotations

import functools

import pytest
import torch

from moe_serve.moe.tiny import load_reference_model
from moe_serve.server import LLM, SamplingParams

MAX_TOKENS = 12
PREFIX = "In a distant land, the council of experts met every morning to decide which tokens "
PROMPTS = [
    "Hello",
    "The quick brown fox jumps over the lazy dog.",
    PREFIX + "should travel first.",
    PREFIX + "would be left behind, and why.",
    "Once upon a time there was a little model that wanted to route every token to the best expert it "
    "could find, so it studied the load of each expert carefully before making a choice.",
    "1 2 3 4 5",
    PREFIX + "had waited longest.",
    "Why?",
]


@functools.lru_cache(maxsize=None)
def reference(ckpt: str, prompt_ids: tuple[tuple[int, ...], ...]):
    """transformers' greedy tokens and per-step log-softmax, one prompt at a time (no padding)."""
    model = load_reference_model(ckpt, torch.float32)
    model.generation_config.eos_token_id = None
    results = []
    for ids in prompt_ids:
        x = torch.tensor([ids])
        with torch.no_grad():
            g = model.generate(x, max_new_tokens=MAX_TOKENS, do_sample=False, output_logits=True,
                               return_dict_in_generate=True)
        tokens = g.sequences[0, x.shape[1]:].tolist()
        logprobs = [step[0].float().log_softmax(-1) for step in g.logits]
        results.append((tokens, logprobs))
    return results


def _run(ckpt: str, prompts=PROMPTS, **llm_kw):
    llm = LLM(ckpt, dtype="float32", **llm_kw)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, logprobs=3)
    outs = llm.generate(prompts, params)
    prompt_ids = tuple(tuple(o.prompt_token_ids) for o in outs)
    return llm, outs, reference(ckpt, prompt_ids)


def _assert_same(outs, ref):
    for out, (ref_tokens, _) in zip(outs, ref):
        assert out.outputs[0].token_ids == ref_tokens, f"prompt {out.prompt!r}"


def _backend(name: str) -> str:
    from moe_serve.kernels import cpu_build

    if name == "cpu" and not cpu_build.available():
        pytest.skip(f"CPU kernels: {cpu_build.unavailable_reason()}")
    return name


@pytest.mark.parametrize("backend", ["cpu", "torch"])
@pytest.mark.parametrize("preset", ["v3", "v2", "v2-group"])
def test_greedy_batch_matches_transformers(checkpoint, preset, backend):
    llm, outs, ref = _run(checkpoint(preset), kernel_backend=_backend(backend))
    _assert_same(outs, ref)
    for out, (_, ref_logprobs) in zip(outs, ref):
        for step, (chosen, ref_lp) in enumerate(zip(out.outputs[0].token_ids, ref_logprobs)):
            got = out.outputs[0].logprobs[step]
            assert chosen in got and len(got) >= 3
            for token, lp in got.items():
                assert abs(lp - ref_lp[token].item()) < 1e-4, (out.prompt, step, token)


@pytest.mark.parametrize("preset", ["v3", "v2"])
def test_preemption_and_prefix_cache_keep_tokens(checkpoint, preset):
    ckpt = checkpoint(preset)
    # 14 blocks of 8 tokens hold the longest sequence (86 + 12 tokens) but not all 8 at once (about 370
    # tokens): the newest get preempted and recomputed
    llm, outs, ref = _run(ckpt, kv_cache_tokens=112, block_size=8, max_num_batched_tokens=64)
    _assert_same(outs, ref)
    stats = llm.stats()
    assert stats["num_preemptions"] > 0
    assert stats["prefix_cache_hit_tokens"] > 0  # the shared PREFIX prompts reuse cached blocks
    assert stats["prefix_cache_query_tokens"] >= stats["prefix_cache_hit_tokens"]
    # a second round of the same prompts is served largely from the prefix cache, same tokens
    again = llm.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True))
    _assert_same(again, ref)


@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_chunked_prefill_with_tiny_budget(checkpoint, backend, monkeypatch):
    """Chunks of 7 tokens: the first of each prompt decompresses its context, the later ones (short for
    their context) attend in the absorbed form as decode rows, one per query."""
    from moe_serve.server.core import runner

    absorbed = []

    def spy(num_query, context_len, cfg):
        cheaper = runner_absorbed(num_query, context_len, cfg)
        absorbed.append(cheaper)
        return cheaper

    runner_absorbed = runner.absorbed_is_cheaper
    monkeypatch.setattr(runner, "absorbed_is_cheaper", spy)
    ckpt = checkpoint("v3")
    llm, outs, ref = _run(ckpt, max_num_batched_tokens=7, max_num_seqs=3, kernel_backend=_backend(backend))
    _assert_same(outs, ref)
    assert True in absorbed and False in absorbed  # both forms ran


@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_fp8_checkpoint_matches_dequantized_reference(checkpoint, backend):
    llm, outs, ref = _run(checkpoint("v3", fp8=True), kernel_backend=_backend(backend))
    _assert_same(outs, ref)


def test_mtp_layers_are_skipped(checkpoint, caplog):
    caplog.set_level("INFO")
    llm, outs, ref = _run(checkpoint("v3", mtp=True), prompts=PROMPTS[:3])
    _assert_same(outs, ref)
    assert any("MTP" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("dtype,nbytes", [("float32", 4), ("bfloat16", 2)])
def test_kv_cache_holds_only_the_latent(checkpoint, dtype, nbytes):
    llm = LLM(checkpoint("v3"), dtype=dtype)
    cfg = llm.engine.model_config
    assert llm.stats()["kv_cache_bytes_per_token"] == cfg.num_hidden_layers * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * nbytes
    out = llm.generate(["Hello there"], SamplingParams(max_tokens=4, temperature=0.0))
    assert len(out[0].outputs[0].token_ids) >= 1


@pytest.mark.parametrize("preset", ["v3", "v2"])
def test_prompt_logprobs_match_transformers(checkpoint, preset):
    """SamplingParams(prompt_logprobs=k): every prompt position's log-softmax equals transformers' forward, with
    prompts cut into chunks, and still computed (not skipped) when the prefix cache holds the prompt."""
    ckpt = checkpoint(preset)
    llm = LLM(ckpt, dtype="float32", max_num_batched_tokens=16, enable_prefix_caching=True)
    model = load_reference_model(ckpt, torch.float32)
    prompts = [llm.tokenizer.encode(p) for p in (PROMPTS[4], PREFIX + "went home.", PROMPTS[0])]
    params = SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=3)
    for attempt in range(2):  # the second time every prompt is in the prefix cache
        for ids, out in zip(prompts, llm.generate(prompts, params)):
            assert len(out.prompt_logprobs) == len(ids) and out.prompt_logprobs[0] is None
            with torch.no_grad():
                ref_TV = model(torch.tensor([ids])).logits[0].float().log_softmax(-1)
            for p, entry in enumerate(out.prompt_logprobs[1:], 1):
                assert ids[p] in entry and len(entry) <= 4
                for token, value in entry.items():
                    assert value == pytest.approx(ref_TV[p - 1, token].item(), abs=1e-4), (attempt, p, token)
                top3 = ref_TV[p - 1].topk(3).indices.tolist()
                assert set(top3) <= set(entry)
