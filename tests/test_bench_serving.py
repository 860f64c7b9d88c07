"""Serving benchmark (`server/tools/bench.py`): arrival schedule, statistics, request sets, result JSON, and one
end-to-end run against a fake OpenAI-compatible SSE server started in-process on 127.0.0.1."""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import socket
import threading
import time
from contextlib import contextmanager

import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from moe_serve.server.tools import bench
from moe_serve.server.tools.bench import BenchRequest, RequestResult


# ---- arrivals ----------------------------------------------------------------------------------------
def test_arrivals_reproducible_by_seed_and_poisson_rate():
    a = bench.arrival_times(2000, 4.0, seed=1)
    assert a == bench.arrival_times(2000, 4.0, seed=1)
    assert a != bench.arrival_times(2000, 4.0, seed=2)
    assert all(x < y for x, y in zip(a, a[1:]))
    gaps = [y - x for x, y in zip([0.0] + a, a)]
    mean = sum(gaps) / len(gaps)
    assert mean == pytest.approx(0.25, rel=0.1)  # 1 / rate
    var = sum((g - mean) ** 2 for g in gaps) / len(gaps)
    assert math.sqrt(var) / mean == pytest.approx(1.0, rel=0.15)  # exponential: coefficient of variation 1


def test_arrivals_inf_rate_and_bad_input():
    assert bench.arrival_times(3, math.inf) == [0.0, 0.0, 0.0]
    bursty = bench.arrival_times(2000, 4.0, seed=0, burstiness=0.25)
    gaps = [y - x for x, y in zip([0.0] + bursty, bursty)]
    assert sum(gaps) / len(gaps) == pytest.approx(0.25, rel=0.25)  # same mean rate, burstier
    with pytest.raises(ValueError, match="rate"):
        bench.arrival_times(3, 0.0)


# ---- statistics ----------------------------------------------------------------------------------------
def test_percentile_matches_linear_interpolation():
    xs = [15.0, 20.0, 35.0, 40.0, 50.0]
    assert bench.percentile(xs, 50) == 35.0
    assert bench.percentile(xs, 90) == pytest.approx(46.0)  # pos 3.6: 40 + 0.6 * 10
    assert bench.percentile(xs, 99) == pytest.approx(49.6)
    assert bench.percentile(xs, 0) == 15.0 and bench.percentile(xs, 100) == 50.0
    assert bench.percentile([7.0], 99) == 7.0
    assert math.isnan(bench.percentile([], 50))


def _res(ttft, e2e, n, ok=True, error=""):
    return RequestResult(ok=ok, prompt_len=10, output_len=n if ok else 0, expected_output_len=n, ttft_s=ttft,
                         e2e_s=e2e, itl_s=[(e2e - ttft) / (n - 1)] * (n - 1) if ok else [], error=error)


def test_summarize_goodput_hand_example():
    # TPOT = (e2e - ttft) / (n - 1): 0.040, 0.040, 0.060, 0.020 s
    results = [_res(0.1, 0.1 + 0.04 * 10, 11),    # good
               _res(0.4, 0.4 + 0.04 * 10, 11),    # good (TTFT 400 <= 500)
               _res(0.2, 0.2 + 0.06 * 10, 11),    # TPOT 60 ms > 50: not good
               _res(0.6, 0.6 + 0.02 * 10, 11),    # TTFT 600 ms > 500: not good
               _res(0, 0, 11, ok=False, error="HTTP 503"),
               _res(0, 0, 11, ok=False, error="HTTP 503")]
    s = bench.summarize(results, duration_s=2.0, ttft_ms=500, tpot_ms=50)
    assert (s["completed"], s["failed"], s["errors"]) == (4, 2, {"HTTP 503": 2})
    assert s["good_requests"] == 2 and s["goodput"] == pytest.approx(1.0)
    assert s["request_throughput"] == pytest.approx(2.0)
    assert s["output_throughput"] == pytest.approx(44 / 2.0)
    assert s["ttft_ms"]["p50"] == pytest.approx(300.0)  # median of 100, 200, 400, 600
    assert s["tpot_ms"]["p50"] == pytest.approx(40.0)
    assert s["tpot_ms"]["mean"] == pytest.approx(40.0)
    assert s["ttft_ms"]["p99"] == pytest.approx(400 + 0.97 * 200)


# ---- request sets --------------------------------------------------------------------------------------
def test_generated_requests_lengths_prefix_and_seed(tmp_path):
    reqs = bench.generate_requests(50, 40, 16, 512, input_dist="uniform", range_ratio=0.5, prefix_fraction=0.5, seed=3)
    assert reqs == bench.generate_requests(50, 40, 16, 512, input_dist="uniform", range_ratio=0.5,
                                           prefix_fraction=0.5, seed=3)
    assert all(20 <= r.prompt_len <= 60 and r.prompt_len == len(r.prompt) for r in reqs)
    assert len({r.prompt_len for r in reqs}) > 5
    assert all(r.output_len == 16 for r in reqs)
    assert all(3 <= t < 512 for r in reqs for t in r.prompt)
    assert len({tuple(r.prompt[:20]) for r in reqs}) == 1  # the shared prefix
    assert len({tuple(r.prompt[20:]) for r in reqs}) == 50
    fixed = bench.generate_requests(4, 8, 4, 100, input_dist="fixed", seed=0)
    assert [r.prompt_len for r in fixed] == [8] * 4
    with pytest.raises(ValueError, match="prefix_fraction"):
        bench.generate_requests(1, 8, 4, 100, prefix_fraction=2)


def test_jsonl_round_trip_and_text_prompts(tmp_path):
    reqs = bench.generate_requests(5, 8, 4, 100, seed=0)
    path = tmp_path / "set.jsonl"
    bench.save_jsonl(reqs, path)
    assert bench.load_jsonl(path) == reqs
    assert bench.load_jsonl(path, num=2) == reqs[:2]
    text = tmp_path / "text.jsonl"
    text.write_text('{"prompt": "hello there world", "max_tokens": 7}\n\n{"prompt": "hi"}\n')
    loaded = bench.load_jsonl(text, default_output_len=3)
    assert loaded == [BenchRequest("hello there world", 3, 7), BenchRequest("hi", 1, 3)]
    with pytest.raises(ValueError, match="output_len"):
        bench.load_jsonl(text)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"output_len": 3}\n')
    with pytest.raises(ValueError, match="prompt"):
        bench.load_jsonl(bad)


def test_loopback_only():
    bench.check_loopback("http://127.0.0.1:8000")
    bench.check_loopback("http://localhost:1")
    with pytest.raises(ValueError, match="loopback"):
        bench.check_loopback("http://10.0.0.1:8000")


# ---- end to end against a fake server -------------------------------------------------------------------
def _fake_app() -> FastAPI:
    app = FastAPI()

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": "fake-model", "object": "model"}]}

    @app.get("/version")
    async def version():
        return {"version": "fake-1"}

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await request.json()
        assert body["stream"] and body["ignore_eos"] and body["model"] == "fake-model"
        prompt, n = body["prompt"], body["max_tokens"]
        if prompt[0] == 1:  # the overload case
            return JSONResponse({"error": {"message": "overloaded"}}, status_code=503)

        async def gen():
            await asyncio.sleep(0.02)
            sent = n - 2 if prompt[0] == 2 else n  # 2: a stream that stops early
            for i in range(sent):
                yield "data: " + json.dumps({"choices": [{"index": 0, "text": f"t{i}", "finish_reason": None}]}) + "\n\n"
                await asyncio.sleep(0.002)
            if prompt[0] == 2:
                return
            yield "data: " + json.dumps({"choices": [], "usage": {"completion_tokens": n}}) + "\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(gen(), media_type="text/event-stream")

    return app


@contextmanager
def fake_server():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(_fake_app(), host="127.0.0.1", port=port, log_level="error"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline, "fake server did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)


def _args(**kw) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    bench.add_arguments(p)
    args = p.parse_args([])
    for k, v in kw.items():
        setattr(args, k, v)
    return args


def test_end_to_end_against_fake_server(tmp_path, capsys):
    reqs = bench.generate_requests(12, 6, 5, 64, input_dist="fixed", seed=0, min_token_id=3)
    reqs[3].prompt[0] = 1  # answered 503
    reqs[7].prompt[0] = 2  # stream cut short
    out = tmp_path / "res.json"
    with fake_server() as url:
        args = _args(base_url=url, request_rates=[50.0, math.inf], result_json=str(out), label="fake",
                     no_progress=True, warmup_requests=1, max_seconds_per_rate=20)
        doc = bench.run_benchmark(args, reqs)
        # a dead endpoint: every request fails, nothing raises
        dead = bench.run_benchmark(_args(base_url=url.rsplit(":", 1)[0] + ":9", model="fake-model",
                                         request_rates=[math.inf], no_progress=True, warmup_requests=0), reqs[:3])
    assert dead["rates"][0]["summary"]["failed"] == 3 and dead["rates"][0]["summary"]["completed"] == 0
    assert doc["model"] == "fake-model" and doc["server_info"] == {"version": "fake-1"}
    for row in doc["rates"]:
        s = row["summary"]
        assert (s["num_requests"], s["completed"], s["failed"]) == (12, 10, 2)
        assert s["errors"] == {"HTTP 503": 1, "stream ended without [DONE]": 1}
        assert s["output_tokens"] == 50
        assert 0 < s["ttft_ms"]["p50"] < 2000 and s["tpot_ms"]["p50"] > 0
        assert s["goodput"] <= s["request_throughput"]
    saved = json.loads(out.read_text())  # strict JSON: inf written as a string
    assert saved["schema"] == "moe-bench-serve/1"
    assert [r["rate"] for r in saved["rates"]] == [50.0, "inf"]
    assert set(saved["environment"]) >= {"project_version", "git_commit", "torch", "triton", "cpu", "cpu_flags", "cpu_count"}
    assert saved["config"]["request_rates"] == [50.0, "inf"] and "api_key" not in saved["config"]
    assert saved["slo"] == {"ttft_ms": 500.0, "tpot_ms": 50.0}
    assert len(saved["rates"][0]["requests"]) == 12
    assert set(saved["rates"][0]["summary"]["ttft_ms"]) == {"mean", "p50", "p90", "p99"}
    print(bench.format_table(doc["rates"]))
    assert "goodput" in capsys.readouterr().out


def test_time_limit_cuts_and_counts():
    reqs = bench.generate_requests(4, 6, 400, 64, input_dist="fixed", seed=0)  # 400 chunks x 2 ms: ~0.8 s each
    with fake_server() as url:
        results, duration = asyncio.run(bench.run_rate(url + "/v1/completions", "fake-model", reqs, math.inf,
                                                       max_seconds=0.3, progress=False))
    assert duration <= 0.5
    assert [r.error for r in results] == ["time limit"] * 4


def test_cli_registration():
    from moe_serve.server.cli import build_parser

    args = build_parser().parse_args(["bench", "serve", "--request-rates", "1", "inf", "--num-prompts", "3"])
    assert args.func is bench.run_cli and args.request_rates == [1.0, math.inf] and args.num_prompts == 3
