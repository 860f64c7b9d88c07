"""Bad requests get OpenAI error bodies (400, not FastAPI's 422) while other requests carry on; clients that
go away free their KV blocks; the engine loop survives a bad request; /health notices a dead engine."""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import pytest
import zmq
from api_server import httpx, running_server
from prometheus_client.parser import text_string_to_metric_families

pytestmark = pytest.mark.slow
MAX_MODEL_LEN = 512  # the tiny model's longest: long generations for the disconnect tests
CHAT = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def server(checkpoint):
    with running_server(checkpoint("v3"), "--max-model-len", str(MAX_MODEL_LEN), "--served-model-name", "tiny") as s:
        yield s


def metrics(server) -> dict:
    status, body = server.get("/metrics")
    assert status == 200
    out = {}
    for family in text_string_to_metric_families(body.decode()):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def aborted(m) -> float:
    return m[("moe_request_finished_total", (("finished_reason", "abort"),))]


def kv_usage(m) -> float:
    return m[("moe_kv_cache_usage_perc", ())]


BAD = [
    ("/v1/completions", b"{not json", None),
    ("/v1/completions", b"[1, 2]", None),
    ("/v1/completions", {}, "prompt"),
    ("/v1/completions", {"prompt": 5}, "prompt"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": "abc"}, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "temperature": "hot"}, "temperature"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": -1, "stream": True}, "max_tokens"),
    ("/v1/completions", {"prompt": [5] * (MAX_MODEL_LEN + 40)}, "prompt"),
    ("/v1/completions", {"prompt": "hi", "model": "no-such-model"}, "model"),
    ("/v1/completions", {"prompt": "hi", "top_p": 1.5}, "top_p"),
    ("/v1/completions", {"prompt": "hi", "temperature": -1}, "temperature"),
    ("/v1/completions", {"prompt": "hi", "n": 0}, "n"),
    ("/v1/completions", {"prompt": "hi", "logprobs": 50}, "logprobs"),
    ("/v1/completions", {"prompt": ""}, "prompt"),
    ("/v1/completions", {"prompt": []}, "prompt"),
    ("/v1/completions", {"prompt": [1, 10**6]}, "prompt"),
    ("/v1/completions", {"prompt": "hi", "stop": [""]}, "stop"),
    ("/v1/completions", {"prompt": "hi", "echo": True, "logprobs": 1}, "echo"),
    ("/v1/completions", {"prompt": "hi", "presence_penalty": 0.5}, "presence_penalty"),
    ("/v1/completions", {"prompt": "hi", "min_tokens": 20, "max_tokens": 4}, "min_tokens"),
    ("/v1/chat/completions", {"messages": "x"}, "messages"),
    ("/v1/chat/completions", {"messages": []}, "messages"),
    ("/v1/chat/completions", {"messages": CHAT, "max_completion_tokens": 0}, "max_completion_tokens"),
    ("/v1/chat/completions", {"messages": CHAT, "top_logprobs": 3}, "top_logprobs"),
    ("/v1/chat/completions", {"messages": CHAT, "logprobs": True, "top_logprobs": 30}, "top_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "word " * MAX_MODEL_LEN}]}, "messages"),
    ("/v1/chat/completions", {"messages": CHAT, "model": "gpt-4"}, "model"),
]


def test_bad_inputs_get_400_while_a_stream_finishes(server):
    done = {}

    def stream():
        with httpx.stream("POST", server.url + "/v1/completions", timeout=120, json={
                "prompt": "Once upon a time", "max_tokens": 40, "temperature": 0, "ignore_eos": True,
                "stream": True}) as r:
            chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
        done["text"] = "".join(c["choices"][0]["text"] for c in chunks)
        done["finish"] = chunks[-1]["choices"][0]["finish_reason"]

    t = threading.Thread(target=stream)
    t.start()
    for path, body, param in BAD:
        status, err = server.post(path, body)
        assert status == 400, (body, err)
        assert set(err["error"]) == {"message", "type", "param", "code"}, err
        assert err["error"]["type"] == "BadRequestError" and err["error"]["code"] == 400 and err["error"]["message"]
        assert err["error"]["param"] == param, (body, err)
    assert server.post("/v1/no-such-route", {})[0] == 404
    t.join(120)
    assert done["finish"] == "length" and done["text"]
    # the server still answers normally
    status, ok = server.post("/v1/completions", {"prompt": "hi", "max_tokens": 3, "temperature": 0})
    assert status == 200 and ok["usage"]["completion_tokens"] == 3


def _wait_idle(server, idle_kv: float, timeout_s: float = 60.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        m = metrics(server)
        if kv_usage(m) == idle_kv and m[("moe_num_requests_running", ())] == 0 \
                and m[("moe_num_requests_waiting", ())] == 0:
            return m
        assert time.monotonic() < deadline, f"KV usage stuck at {kv_usage(m)} (idle {idle_kv})"
        time.sleep(0.2)


def test_disconnected_streams_free_kv_blocks(server):
    before = _wait_idle(server, 0.0)
    idle_kv = kv_usage(before)
    # all 20 requests go out together: a thread that starts late must find the others still streaming (each
    # finishes its max_tokens in a second or two on the tiny model)
    start, got_tokens, may_leave = threading.Barrier(20), threading.Barrier(21), threading.Event()
    seen: dict[int, list[str]] = {}  # per stream, the data lines it read (shown if the check below fails)

    def stream(i):
        start.wait(60)
        with httpx.stream("POST", server.url + "/v1/completions", timeout=120, json={
                "prompt": f"Request {i} streams for a long time", "max_tokens": MAX_MODEL_LEN - 64, "temperature": 0,
                "ignore_eos": True, "stream": True}) as r:
            lines = r.iter_lines()
            n = 0
            for line in lines:
                n += line.startswith("data: {")
                if line.startswith("data: "):
                    seen.setdefault(i, []).append(line[:200])
                if n == 2:
                    break
            got_tokens.wait(60)  # all 20 are mid-way ...
            may_leave.wait(60)  # ... and stay until the main thread has seen them running
        # leaving the `with` closes the connection mid-stream

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(20)]
    for t in threads:
        t.start()
    got_tokens.wait(60)
    deadline = time.monotonic() + 30  # the stats reply is taken between engine steps: allow it later steps
    while (mid := metrics(server))[("moe_num_requests_running", ())] != 20 and time.monotonic() < deadline:
        time.sleep(0.1)
    may_leave.set()
    assert kv_usage(mid) > idle_kv and mid[("moe_num_requests_running", ())] == 20, (mid, seen)
    for t in threads:
        t.join(60)
    after = _wait_idle(server, idle_kv)
    assert aborted(after) - aborted(before) == 20


def test_disconnected_non_streaming_request_is_aborted(server):
    before = _wait_idle(server, 0.0)
    with pytest.raises(httpx.TimeoutException):  # 32 samples x ~500 tokens: far longer than the timeout
        httpx.post(server.url + "/v1/completions", timeout=0.5, json={
            "prompt": "a long answer", "n": 32, "max_tokens": MAX_MODEL_LEN - 64, "temperature": 1.0, "ignore_eos": True})
    after = _wait_idle(server, kv_usage(before))
    assert aborted(after) - aborted(before) == 32


def test_engine_loop_survives_bad_request(checkpoint):
    """Requests the engine rejects get an error message each; the loop goes on with the good one."""
    from moe_serve.server.core.config import EngineConfig
    from moe_serve.server.core.engine import EngineCore
    from moe_serve.server.frontend.engine_loop import EngineLoop, pack, unpack

    engine = EngineCore(EngineConfig(model=checkpoint("v3"), dtype="float32", max_model_len=64))
    ctx = zmq.Context()
    to_engine, engine_in = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
    engine_out, from_engine = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
    to_engine.bind("inproc://in")
    engine_in.connect("inproc://in")
    engine_out.bind("inproc://out")
    from_engine.connect("inproc://out")
    loop = EngineLoop(engine, engine.enable_expert_load_recording(4), engine_in, engine_out)
    thread = threading.Thread(target=loop.run)
    thread.start()
    good = {"max_tokens": 3, "temperature": 0.0}
    for rid, ids, params in [("bad-params", [1, 2], {"max_tokens": -1}), ("bad-field", [1, 2], {"bogus": 1}),
                             ("too-long", [5] * 100, good), ("bad-id", [1, 10**6], good), ("good", [1, 2, 3], good),
                             ("good", [1, 2], good)]:  # the last one reuses a live id
        to_engine.send(pack({"type": "add", "request_id": rid, "prompt_token_ids": ids, "params": params}))
    errors, tokens = {}, []
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if not from_engine.poll(1000):
            continue
        msg = unpack(from_engine.recv())
        if msg["type"] == "error":
            errors[msg["request_id"]] = msg["message"]
        elif msg["type"] == "outputs":
            for item in msg["outputs"]:
                tokens += item["t"]
                if "finish" in item:
                    deadline = 0
    to_engine.send(pack({"type": "stats", "nonce": 7}))
    reply = unpack(from_engine.recv())
    while reply["type"] != "reply":
        reply = unpack(from_engine.recv())
    to_engine.send(pack({"type": "shutdown"}))
    thread.join(30)
    for s in (to_engine, engine_in, engine_out, from_engine):
        s.close(linger=0)
    ctx.term()
    assert set(errors) == {"bad-params", "bad-field", "too-long", "bad-id", "good"}
    assert "max_tokens" in errors["bad-params"] and "already in use" in errors["good"]
    assert len(tokens) == 3 and not thread.is_alive()
    assert reply["nonce"] == 7 and reply["data"]["num_running"] == 0 and "expert" in reply["data"]


def test_serve_rejects_parallel_flags(capsys, checkpoint):
    from moe_serve.server.cli import main

    for flag in ("-tp", "-pp", "-dp"):
        assert main(["serve", checkpoint("v3"), flag, "2"]) == 2
        assert "needs that many ranks; launch with torchrun" in capsys.readouterr().err


def test_health_503_when_engine_dies(server):
    """Last in the module: kills the engine process."""
    assert server.get("/health")[0] == 200
    pids = server.engine_pids()
    assert len(pids) == 1, pids
    os.kill(pids[0], signal.SIGKILL)
    deadline = time.monotonic() + 20
    while server.get("/health")[0] != 503:
        assert time.monotonic() < deadline, "/health still 200 after the engine died"
        time.sleep(0.2)
    status, body = server.get("/health")
    assert json.loads(body)["error"]["code"] == 503
    assert server.get("/ready")[0] == 503
    status, err = server.post("/v1/completions", {"prompt": "hi", "max_tokens": 2})
    assert status == 503 and err["error"]["type"] == "ServiceUnavailableError"
    assert metrics(server)[("moe_engine_alive", ())] == 0
