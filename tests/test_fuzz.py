"""Fuzzing the HTTP API: schemathesis from the server's own /openapi.json, and hypothesis request bodies
of random shapes for /v1/completions and /v1/chat/completions. Every answer must be a well-formed 2xx
or 4xx (JSON, or SSE whose chunks are JSON), never a 5xx, a hang or a dropped connection, while a
well-formed greedy stream runs alongside and keeps returning the same tokens.

The one other answer allowed is the admission control's 503 with Retry-After (a fuzzed call asking for
n x prompts near the bound while the parallel stream holds a slot). The server runs with a small
max_model_len so any accepted request finishes quickly. Bounded: about a minute in all.
"""

from __future__ import annotations

import json
import threading
import time

import pytest
from api_server import httpx, running_server

hypothesis = pytest.importorskip("hypothesis")
schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, Phase, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

pytestmark = pytest.mark.slow
MAX_MODEL_LEN = 48
FUZZ = settings(deadline=None, database=None, derandomize=True, suppress_health_check=list(HealthCheck),
                print_blob=False, phases=[Phase.explicit, Phase.generate])  # no shrinking: bounded time
STREAM = {"prompt": "Once upon a time", "max_tokens": 8, "temperature": 0, "ignore_eos": True, "stream": True}
tally: dict[str, dict[int, int]] = {}  # inputs tried per fuzzer and route, by status (docs/reliability.md)


@pytest.fixture(scope="module")
def server(checkpoint):
    with running_server(checkpoint("v3"), "--max-model-len", str(MAX_MODEL_LEN), "--max-num-seqs", "8",
                        "--max-waiting-requests", "24") as s:
        yield s


def stream_text(url: str) -> tuple[str, int]:
    text, usage = "", None
    with httpx.stream("POST", url + "/v1/completions", timeout=30,
                      json={**STREAM, "stream_options": {"include_usage": True}}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                assert "error" not in chunk, chunk
                text += "".join(c["text"] for c in chunk["choices"])
                usage = chunk.get("usage") or usage
    return text, usage["completion_tokens"]


class ParallelStream:
    """Runs well-formed streams back to back (bounded in count and time) while a fuzzer runs."""

    def __init__(self, url: str):
        self.url, self.reference = url, stream_text(url)
        self.stop, self.done, self.errors = threading.Event(), 0, []
        self.thread = threading.Thread(target=self.run, daemon=True)

    def run(self) -> None:
        deadline = time.monotonic() + 300
        while not self.stop.is_set() and self.done < 2000 and time.monotonic() < deadline:
            try:
                got = stream_text(self.url)
                if got != self.reference:
                    self.errors.append(f"stream returned {got}, expected {self.reference}")
                self.done += 1
            except Exception as exc:  # noqa: BLE001 - reported by the test
                self.errors.append(repr(exc))
                return

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join(60)
        assert not self.thread.is_alive(), "the parallel stream hung"
        assert not self.errors, self.errors
        assert self.done >= 1, "the parallel stream never finished while fuzzing"
        assert self.reference[1] == STREAM["max_tokens"]


def check_answer(key: str, status: int, headers, body: bytes, what: str) -> None:
    """2xx/4xx with a JSON (or SSE of JSON) body; 503 only as the admission control's answer."""
    counts = tally.setdefault(key, {})
    counts[status] = counts.get(status, 0) + 1
    assert status < 500 or (status == 503 and headers.get("retry-after")), (status, body[:500], what)
    ctype = headers.get("content-type", "")
    anthropic_api = "/v1/messages" in key  # Anthropic's shapes: named SSE events, {"type": "error", "error": ...}
    if ctype.startswith("text/event-stream"):
        lines = [ln for ln in body.decode().split("\n") if ln]
        if anthropic_api:
            events = [json.loads(ln.removeprefix("data: ")) for ln in lines if ln.startswith("data: ")]
            assert events and events[-1]["type"] in ("message_stop", "error"), (body[-300:], what)
            return
        assert lines and lines[-1] == "data: [DONE]", (body[-300:], what)
        for ln in lines[:-1]:
            chunk = json.loads(ln.removeprefix("data: "))
            assert "error" not in chunk or chunk["error"]["code"] < 500, (chunk, what)
    elif ctype.startswith("application/json"):
        doc = json.loads(body)
        if status >= 400 and anthropic_api:
            assert doc["type"] == "error" and set(doc["error"]) >= {"type", "message"}, doc
        elif status >= 400:
            assert set(doc["error"]) >= {"message", "type", "param", "code"} and doc["error"]["code"] == status, doc


def test_schemathesis_openapi(server):
    schema = schemathesis.openapi.from_url(server.url + "/openapi.json")
    examples = {"/v1/completions": 40, "/v1/chat/completions": 40}
    with ParallelStream(server.url), httpx.Client(timeout=30) as client:
        for result in schema.get_all_operations():
            op = result.ok()
            n = examples.get(op.path, 5)
            key = f"schemathesis {op.method.upper()} {op.path}"

            @settings(FUZZ, max_examples=n)
            @given(op.as_strategy(), st.booleans())
            def fuzz(case, served_model):
                if served_model and isinstance(case.body, dict):
                    case.body.pop("model", None)  # else nearly every case is 400 "model does not exist"
                kw = case.as_transport_kwargs(base_url=server.url)  # sent by httpx: schemathesis' own
                r = client.request(kw["method"], kw["url"], headers=kw.get("headers"),  # transport cuts SSE short
                                   params=kw.get("params"), json=kw.get("json"), content=kw.get("data"))
                check_answer(key, r.status_code, r.headers, r.content, case.as_curl_command())

            fuzz()
    print("inputs tried (by status):", tally)


# ---- hypothesis bodies of any shape -------------------------------------------------------------
anything = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats() | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=8)
small_ints = st.integers(-3, 60)
FIELDS = {
    "model": st.none() | st.text(max_size=10), "n": small_ints | anything, "max_tokens": small_ints | anything,
    "max_completion_tokens": small_ints | anything, "temperature": st.floats() | anything,
    "top_p": st.floats() | anything, "top_k": small_ints | anything, "min_tokens": small_ints | anything,
    "seed": st.integers() | anything, "stop": st.text(max_size=4) | st.lists(st.text(max_size=4), max_size=3) | anything,
    "stop_token_ids": st.lists(st.integers(-5, 2**65), max_size=3) | anything, "stream": st.booleans() | anything,
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}) | anything,
    "logprobs": small_ints | st.booleans() | anything, "top_logprobs": small_ints | anything,
    "echo": st.booleans() | anything, "ignore_eos": st.booleans() | anything,
    "include_stop_str_in_output": st.booleans() | anything, "presence_penalty": st.floats() | anything,
    "logit_bias": anything, "best_of": small_ints | anything, "suffix": anything, "tools": anything,
}
prompts = (st.text(max_size=60) | st.lists(st.integers(-5, 70000), max_size=60)
           | st.lists(st.text(max_size=10), max_size=3) | st.lists(st.lists(st.integers(-1, 1000), max_size=8), max_size=3)
           | anything)
message = st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "system"]) | st.text(max_size=5) | anything},
                                optional={"content": st.text(max_size=40) | st.none() | anything
                                          | st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": st.text(max_size=10)}), max_size=2),
                                          "name": anything})
completion_body = st.fixed_dictionaries({}, optional={"prompt": prompts, **FIELDS})
chat_body = st.fixed_dictionaries({}, optional={"messages": st.lists(message, max_size=3) | anything, **FIELDS})

# well-typed bodies with random valid-range values: these reach the engine (and its sampler)
VALID = {
    "n": st.integers(1, 3), "max_tokens": st.integers(1, 12), "temperature": st.floats(0, 2),
    "top_p": st.floats(0.01, 1), "top_k": st.integers(-1, 50), "min_tokens": st.integers(0, 2),
    "seed": st.integers(-2**63, 2**63 - 1), "stop": st.lists(st.text(min_size=1, max_size=3), max_size=2),
    "stop_token_ids": st.lists(st.integers(0, 2**40), max_size=3), "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}), "ignore_eos": st.booleans(),
    "include_stop_str_in_output": st.booleans(),
}
valid_completion = st.fixed_dictionaries(
    {"prompt": st.text(min_size=1, max_size=30) | st.lists(st.integers(0, 1000), min_size=1, max_size=20)
     | st.lists(st.text(min_size=1, max_size=10), min_size=1, max_size=2)},
    optional={**VALID, "logprobs": st.integers(0, 5), "echo": st.booleans()})
valid_chat = st.fixed_dictionaries(
    {"messages": st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "system"]),
                                                 "content": st.text(max_size=30)}), min_size=1, max_size=3)},
    optional={**VALID, "logprobs": st.booleans(), "top_logprobs": st.integers(0, 5),
              "max_completion_tokens": st.integers(1, 12)})


def _encode(body) -> bytes:
    return json.dumps(body, allow_nan=True).encode()  # NaN / Infinity, as lenient clients send them


@pytest.mark.parametrize("path,bodies", [("/v1/completions", valid_completion | completion_body),
                                         ("/v1/chat/completions", valid_chat | chat_body)])
def test_hypothesis_bodies(server, path, bodies):
    raw = st.binary(max_size=40) | st.just(b"") | st.just(b"{") | st.just(b"[]") | st.just(b"null")
    key = f"hypothesis {path}"
    with ParallelStream(server.url), httpx.Client(timeout=30) as client:
        @settings(FUZZ, max_examples=70)
        @given(bodies.map(_encode) | raw)
        def fuzz(data):
            r = client.post(server.url + path, content=data, headers={"Content-Type": "application/json"})
            check_answer(key, r.status_code, r.headers, r.content, data[:300])

        fuzz()
    assert server.get("/health")[0] == 200
    print("inputs tried (by status):", tally)
