"""Robustness: one request failing inside the engine fails alone (500 over HTTP), admission control
(503 + Retry-After past --max-waiting-requests; 400 when prompt + max_tokens cannot fit)."""

from __future__ import annotations

import textwrap
import threading
import time

import pytest
from api_server import httpx, running_server

import moe_serve.server.core.sampler as sampler_mod
from moe_serve.server import LLM, SamplingParams


def _fail_for(monkeypatch, bad_ids: set[str]) -> None:
    real = sampler_mod._choose

    def choose(row_V, req, generator):
        if req.request_id in bad_ids:
            raise RuntimeError(f"injected sampling failure for {req.request_id}")
        return real(row_V, req, generator)

    monkeypatch.setattr(sampler_mod, "_choose", choose)


def run_to_end(engine) -> tuple[dict, dict]:
    """Step the engine core until idle: (token ids per request, gathered from the deltas; last output of each)."""
    tokens, last = {}, {}
    for _ in range(100):
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            last[out.request_id] = out
        if not engine.has_unfinished_requests():
            break
    return tokens, last


def test_sampling_failure_fails_one_request(checkpoint, monkeypatch):
    llm = LLM(checkpoint("v3"), dtype="float32")
    params = SamplingParams(max_tokens=6, temperature=0.8, seed=7, ignore_eos=True)  # drawn: each row samples alone
    prompts = [[5, 6, 7], [8, 9, 10, 11], [12, 13]]
    expected = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]

    engine = llm.engine
    idle = engine.block_manager.usage
    _fail_for(monkeypatch, {"bad"})
    for rid, ids in zip(["a", "bad", "b"], prompts):
        engine.add_request(ids, params, request_id=rid)
    tokens, finished = run_to_end(engine)
    assert set(finished) == {"a", "bad", "b"} and all(out.finished for out in finished.values())
    assert "injected sampling failure for bad" in finished["bad"].error
    assert finished["bad"].finish_reason == "abort"
    assert finished["a"].error is None and tokens["a"] == expected[0]
    assert finished["b"].error is None and tokens["b"] == expected[2]
    assert engine.block_manager.usage == idle  # the failed request's blocks are freed
    assert not engine.requests and not engine.scheduler.has_unfinished()


def test_failure_after_sampling_fails_one_request(checkpoint, monkeypatch):
    """An exception in the engine's per-request bookkeeping (here: the stop check) also fails alone."""
    llm = LLM(checkpoint("v3"), dtype="float32")
    engine = llm.engine
    idle = engine.block_manager.usage
    real = engine._check_stop

    def check_stop(req, token_id):
        if req.request_id == "bad" and req.num_output_tokens == 2:
            raise ValueError("injected stop-check failure")
        return real(req, token_id)

    monkeypatch.setattr(engine, "_check_stop", check_stop)
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    engine.add_request([1, 2, 3], params, request_id="bad")
    engine.add_request([4, 5, 6], params, request_id="good")
    tokens, finished = run_to_end(engine)
    assert finished["bad"].error == "ValueError: injected stop-check failure"
    assert finished["good"].error is None and finished["good"].finished and len(tokens["good"]) == 4
    assert engine.block_manager.usage == idle and not engine.requests


# ---- over HTTP ------------------------------------------------------------------------------------
FAIL_SEED = 424242
SITECUSTOMIZE = f"""
# test-only: makes the sampler fail for requests with seed {FAIL_SEED} (loaded in the front end and engine)
import moe_serve.server.core.sampler as _s
_real = _s._choose
def _choose(row_V, req, generator):
    if req.sampling_params.seed == {FAIL_SEED}:
        raise RuntimeError("injected sampling failure")
    return _real(row_V, req, generator)
_s._choose = _choose
"""


@pytest.mark.slow
def test_engine_error_is_500_and_others_go_on(checkpoint, tmp_path, monkeypatch):
    (tmp_path / "sitecustomize.py").write_text(textwrap.dedent(SITECUSTOMIZE))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    with running_server(checkpoint("v3"), "--max-model-len", "256") as s:
        done = {}

        def good():
            done["good"] = s.post("/v1/completions", {"prompt": "Once upon a time", "max_tokens": 40,
                                                      "temperature": 0, "ignore_eos": True})

        t = threading.Thread(target=good)
        t.start()
        status, body = s.post("/v1/completions", {"prompt": "hi", "max_tokens": 5, "seed": FAIL_SEED})
        assert status == 500 and body["error"]["type"] == "InternalServerError"
        assert "injected sampling failure" in body["error"]["message"]
        with httpx.stream("POST", s.url + "/v1/chat/completions", timeout=60, json={
                "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "seed": FAIL_SEED,
                "stream": True}) as r:
            lines = [ln for ln in r.iter_lines() if ln.startswith("data: ")]
        assert '"InternalServerError"' in lines[-2] and lines[-1] == "data: [DONE]"
        t.join(60)
        status, body = done["good"]
        assert status == 200 and body["usage"]["completion_tokens"] == 40
        assert s.get("/health")[0] == 200


@pytest.mark.slow
def test_admission_control(checkpoint):
    with running_server(checkpoint("v3"), "--max-model-len", "256", "--max-num-seqs", "2",
                        "--max-waiting-requests", "3") as s:
        # prompt + max_tokens past max_model_len: 400 up front, naming the field
        status, body = s.post("/v1/completions", {"prompt": [1] * 200, "max_tokens": 100})
        assert status == 400 and body["error"]["param"] == "max_tokens" and "max_model_len 256" in body["error"]["message"]
        status, body = s.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                       "max_completion_tokens": 1000})
        assert status == 400 and body["error"]["param"] == "max_completion_tokens"
        status, body = s.post("/v1/completions", {"prompt": "hi", "n": 6, "max_tokens": 2})  # more than ever fits
        assert status == 400 and body["error"]["param"] == "n"

        # 12 long requests at once against room for 2 running + 3 waiting: 5 answered, 7 told to retry
        results = []
        lock = threading.Lock()

        def call(i):
            r = httpx.post(s.url + "/v1/completions", timeout=120, json={
                "prompt": f"request {i}", "max_tokens": 60, "temperature": 0, "ignore_eos": True})
            with lock:
                results.append(r)

        threads = [threading.Thread(target=call, args=(i,)) for i in range(12)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        ok = [r for r in results if r.status_code == 200]
        busy = [r for r in results if r.status_code == 503]
        assert len(ok) + len(busy) == 12 and len(ok) >= 5 and busy
        assert all(r.json()["usage"]["completion_tokens"] == 60 for r in ok)
        for r in busy:
            assert r.headers["Retry-After"] == "1"
            err = r.json()["error"]
            assert err["type"] == "ServiceUnavailableError" and "overloaded" in err["message"]
        deadline = time.monotonic() + 30  # and once the load is gone, requests are admitted again
        status, body = s.post("/v1/completions", {"prompt": "hi", "max_tokens": 2})
        while status == 503 and time.monotonic() < deadline:
            time.sleep(0.2)
            status, body = s.post("/v1/completions", {"prompt": "hi", "max_tokens": 2})
        assert status == 200


def test_edge_sampling_values_do_not_fail(checkpoint):
    """Values the fuzzers send: a temperature that would overflow the logits, stop ids past the vocabulary
    while min_tokens bans them."""
    llm = LLM(checkpoint("v3"), dtype="float32")
    greedy = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    edge = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4, temperature=1e-300, ignore_eos=True, min_tokens=2,
                                                    stop_token_ids=[10**12]))
    assert edge[0].error is None and edge[0].outputs[0].token_ids == greedy[0].outputs[0].token_ids
