"""The OpenAI-compatible server against the real `openai` client: greedy results equal the offline `LLM`,
streaming equals non-streaming, the sampling options reach the engine, /metrics moves, and the expert-load
endpoints count what the model routed. One server (float32, tiny V3 checkpoint) for the whole module."""

from __future__ import annotations

import json
import threading

import openai
import pytest
from api_server import httpx, running_server
from prometheus_client.parser import text_string_to_metric_families

from moe_serve.server import LLM, SamplingParams

pytestmark = pytest.mark.slow
KEY = "test-key"
MODEL = "tiny"
PROMPTS = ["The expert router sends each token to", "Once upon a time", "Hello, world!"]


@pytest.fixture(scope="module")
def server(checkpoint):
    with running_server(checkpoint("v3"), "--served-model-name", MODEL, "other-name", api_key=KEY) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def llm(checkpoint):
    return LLM(checkpoint("v3"), dtype="float32")


def offline(llm, prompts, **kw):
    return [o.outputs for o in llm.generate(prompts, SamplingParams(**kw))]


def chat_ids(llm, messages):
    return llm.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)


def test_models_health_version(server, client):
    assert [m.id for m in client.models.list().data] == [MODEL, "other-name"]
    assert server.get("/health")[0] == 200
    status, body = server.get("/ready")
    assert status == 200 and json.loads(body) == {"ready": True}
    assert "version" in json.loads(server.get("/version")[1])


def test_api_key_required(server):
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        r = httpx.post(server.url + "/v1/completions", json={"prompt": "x"}, headers=headers, timeout=30)
        assert r.status_code == 401, headers
        assert r.json()["error"]["code"] == 401 and r.json()["error"]["type"] == "AuthenticationError"
    assert httpx.get(server.url + "/v1/models", timeout=30).status_code == 401
    assert httpx.get(server.url + "/health", timeout=30).status_code == 200  # health and metrics stay open
    assert httpx.get(server.url + "/metrics", timeout=30).status_code == 200


def test_tokenize_detokenize_as_vllm(server, llm):
    """vLLM's /tokenize and /detokenize (its `vllm bench serve` asks for them): the engine's own token ids."""
    tok = llm.tokenizer
    status, body = server.post("/tokenize", {"model": MODEL, "prompt": PROMPTS[0], "return_token_strs": True})
    assert status == 200 and body["tokens"] == tok.encode(PROMPTS[0]) and body["count"] == len(body["tokens"])
    assert body["token_strs"] == tok.convert_ids_to_tokens(body["tokens"]) and body["max_model_len"] > 0
    messages = [{"role": "user", "content": "Hi there"}]
    status, body = server.post("/tokenize", {"messages": messages})
    assert status == 200 and body["tokens"] == chat_ids(llm, messages) and body["token_strs"] is None
    status, body = server.post("/detokenize", {"tokens": tok.encode(PROMPTS[1], add_special_tokens=False)})
    assert status == 200 and body == {"prompt": PROMPTS[1]}
    for path, bad, param in (("/detokenize", {"tokens": [10 ** 9]}, "tokens"),
                             ("/tokenize", {"prompt": "x", "messages": messages}, "prompt"),
                             ("/tokenize", {"prompt": "x", "model": "nope"}, "model")):
        status, body = server.post(path, bad)
        assert status == 400 and body["error"]["param"] == param, (path, bad, body)


def test_completions_greedy_equal_offline(client, llm):
    expected = offline(llm, PROMPTS, max_tokens=12, temperature=0.0)
    resp = client.completions.create(model=MODEL, prompt=PROMPTS, max_tokens=12, temperature=0)
    assert [c.index for c in resp.choices] == [0, 1, 2]
    assert [c.text for c in resp.choices] == [e[0].text for e in expected]
    assert [c.finish_reason for c in resp.choices] == [e[0].finish_reason for e in expected]
    prompt_tokens = sum(len(llm.tokenizer.encode(p)) for p in PROMPTS)
    assert resp.usage.prompt_tokens == prompt_tokens
    assert resp.usage.completion_tokens == sum(len(e[0].token_ids) for e in expected)
    assert resp.usage.total_tokens == prompt_tokens + resp.usage.completion_tokens


def test_completions_stream_equal_offline_usage_last(client, llm):
    expected = offline(llm, PROMPTS, max_tokens=12, temperature=0.0)
    stream = client.completions.create(model=MODEL, prompt=PROMPTS, max_tokens=12, temperature=0, stream=True,
                                       stream_options={"include_usage": True})
    chunks = list(stream)
    texts, finish = ["", "", ""], [None] * 3
    for chunk in chunks[:-1]:
        assert chunk.usage is None
        for c in chunk.choices:
            texts[c.index] += c.text
            finish[c.index] = c.finish_reason or finish[c.index]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == sum(len(e[0].token_ids) for e in expected)
    assert texts == [e[0].text for e in expected]
    assert finish == [e[0].finish_reason for e in expected]


def test_completions_stream_a_chunk_per_token(client, llm):
    """Every generated token gets its chunk, also while its text is held back (here: it could still begin a
    stop string), as vLLM streams: clients such as `vllm bench serve` time each token from its chunk."""
    stop = "\x00" * 40  # never generated, so the first 39 characters wait for more text to rule it out
    expected = offline(llm, [PROMPTS[0]], max_tokens=12, temperature=0.0, stop=[stop])[0][0]
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=12, temperature=0, stream=True,
                                            stop=[stop]))
    texts = [c.choices[0].text for c in chunks]
    assert len(chunks) == len(expected.token_ids) and "".join(texts) == expected.text
    assert texts[0] == ""  # held back, yet sent
    messages = [{"role": "user", "content": "Hi there"}]
    expected = offline(llm, [chat_ids(llm, messages)], max_tokens=12, temperature=0.0, stop=[stop])[0][0]
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0,
                                                 stream=True, stop=[stop]))[1:]  # after the role's chunk
    assert len(chunks) == len(expected.token_ids)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected.text


def test_stream_without_include_usage_has_no_usage(client):
    chunks = list(client.completions.create(model=MODEL, prompt="Hello", max_tokens=3, temperature=0, stream=True))
    assert all(c.usage is None for c in chunks)


def test_chat_equal_offline(client, llm):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is the capital of France?"}]
    expected = offline(llm, [chat_ids(llm, messages)], max_tokens=10, temperature=0.0)[0][0]
    resp = client.chat.completions.create(model="other-name", messages=messages, max_tokens=10, temperature=0)
    assert resp.choices[0].message.role == "assistant"
    assert resp.choices[0].message.content == expected.text
    assert resp.choices[0].finish_reason == expected.finish_reason
    assert resp.usage.prompt_tokens == len(chat_ids(llm, messages))
    assert resp.usage.completion_tokens == len(expected.token_ids)
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=10, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == expected.finish_reason
    assert chunks[-1].usage.completion_tokens == len(expected.token_ids)
    assert all(c.usage is None for c in chunks[:-1])


def test_token_id_prompts_and_echo(client, llm):
    ids = [llm.tokenizer.encode(p) for p in PROMPTS[:2]]
    expected = offline(llm, ids, max_tokens=6, temperature=0.0)
    one = client.completions.create(model=MODEL, prompt=ids[0], max_tokens=6, temperature=0)
    assert one.choices[0].text == expected[0][0].text
    many = client.completions.create(model=MODEL, prompt=ids, max_tokens=6, temperature=0, echo=True)
    for c, e, i in zip(many.choices, expected, ids):
        assert c.text == llm.tokenizer.decode(i) + e[0].text
    echoed = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=6, temperature=0, echo=True)
    assert echoed.choices[0].text.startswith(PROMPTS[0])
    streamed = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=6, temperature=0, echo=True,
                                         stream=True)
    assert "".join(c.choices[0].text for c in streamed) == echoed.choices[0].text


def test_n_seed_top_p_equal_offline(client, llm):
    expected = offline(llm, [PROMPTS[1]], n=3, max_tokens=8, temperature=1.0, top_p=0.9, seed=7)[0]
    resp = client.completions.create(model=MODEL, prompt=PROMPTS[1], n=3, max_tokens=8, temperature=1.0, top_p=0.9,
                                     seed=7)
    assert [c.text for c in resp.choices] == [e.text for e in expected]
    again = client.completions.create(model=MODEL, prompt=PROMPTS[1], n=3, max_tokens=8, temperature=1.0, top_p=0.9,
                                      seed=7, stream=True)
    texts = ["", "", ""]
    for chunk in again:
        for c in chunk.choices:
            texts[c.index] += c.text
    assert texts == [e.text for e in expected]


def test_vllm_extras_equal_offline(client, llm):
    base = offline(llm, [PROMPTS[0]], max_tokens=10, temperature=0.0, ignore_eos=True)[0][0]
    stop_id = base.token_ids[4]
    kw = dict(max_tokens=10, temperature=0.7, top_k=1, min_tokens=2, ignore_eos=True, stop_token_ids=[stop_id])
    expected = offline(llm, [PROMPTS[0]], **kw)[0][0]
    resp = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=10, temperature=0.7, extra_body={
        "top_k": 1, "min_tokens": 2, "ignore_eos": True, "stop_token_ids": [stop_id]})
    c = resp.choices[0]
    assert (c.text, c.finish_reason) == (expected.text, "stop")
    assert resp.usage.completion_tokens == len(expected.token_ids) == base.token_ids.index(stop_id) + 1


@pytest.mark.parametrize("stream", [False, True])
def test_stop_strings_equal_offline(client, llm, stream):
    base = offline(llm, [PROMPTS[2]], max_tokens=16, temperature=0.0, ignore_eos=True)[0][0].text
    stop = base[6:9]  # a stop string from the middle of the greedy output (may span tokens)
    expected = offline(llm, [PROMPTS[2]], max_tokens=16, temperature=0.0, ignore_eos=True, stop=[stop])[0][0]
    assert expected.finish_reason == "stop"
    resp = client.completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=16, temperature=0, stop=[stop],
                                     stream=stream, extra_body={"ignore_eos": True})
    if stream:
        chunks = list(resp)
        text = "".join(c.choices[0].text for c in chunks)
        finish = chunks[-1].choices[0].finish_reason
    else:
        text, finish = resp.choices[0].text, resp.choices[0].finish_reason
    assert (text, finish) == (expected.text, "stop")
    assert stop not in text


def test_logprobs(client, llm):
    expected = offline(llm, [PROMPTS[0]], max_tokens=5, temperature=0.0, logprobs=3)[0][0]
    resp = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=5, temperature=0, logprobs=3)
    lp = resp.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    for got, want, tid in zip(lp.token_logprobs, expected.logprobs, expected.token_ids):
        assert got == pytest.approx(want[tid], abs=1e-4)
    # top 3 plus the chosen token, keyed by text (tokens that decode alike, e.g. to U+FFFD, share a key)
    assert all(1 <= len(top) <= 4 and max(top.values()) >= chosen for top, chosen in zip(lp.top_logprobs,
                                                                                         lp.token_logprobs))
    assert lp.text_offset[0] == 0 and "".join(lp.tokens).startswith(resp.choices[0].text[:1])
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
                                          temperature=0, logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    assert all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in content)
    assert content[0].top_logprobs[0].logprob == pytest.approx(content[0].logprob)  # greedy: chosen is the top
    streamed = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
                                              temperature=0, logprobs=True, top_logprobs=2, stream=True)
    entries = [t for c in streamed if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert [t.token for t in entries] == [t.token for t in content]


def _metrics(server) -> dict:
    status, body = server.get("/metrics")
    assert status == 200
    return {f.name: f for f in text_string_to_metric_families(body.decode())}


def _value(families, name, suffix="", **labels) -> float:
    for s in families[name].samples:
        if s.name == name + suffix and all(s.labels.get(k) == v for k, v in labels.items()):
            return s.value
    raise KeyError((name, suffix, labels))


def test_metrics_move_as_requests_complete(server, client):
    from test_metrics import ALL_METRICS

    before = _metrics(server)
    assert set(ALL_METRICS) <= set(before), set(ALL_METRICS) - set(before)
    resp = client.completions.create(model=MODEL, prompt=PROMPTS[:2], max_tokens=7, temperature=0,
                                     extra_body={"ignore_eos": True})
    after = _metrics(server)
    d = lambda name, suffix="", **kw: _value(after, name, suffix, **kw) - _value(before, name, suffix, **kw)  # noqa: E731
    assert d("moe_prompt_tokens", "_total") == resp.usage.prompt_tokens
    assert d("moe_generation_tokens", "_total") == resp.usage.completion_tokens == 14
    assert d("moe_request_finished", "_total", finished_reason="length") == 2
    assert d("moe_time_to_first_token_seconds", "_count") == 2
    assert d("moe_e2e_request_latency_seconds", "_count") == 2
    assert d("moe_inter_token_latency_seconds", "_count") == 12
    assert d("moe_prefix_cache_queries", "_total") >= resp.usage.prompt_tokens - 2
    assert d("moe_ep_rank_tokens", "_total", rank="0") > 0
    assert _value(after, "moe_engine_alive") == 1
    assert _value(after, "moe_num_requests_running") == 0
    assert _value(after, "moe_kv_cache_usage_perc") == 0
    assert 0 < _value(after, "moe_expert_balancedness", layer="1") <= 1


def test_startup_phases_exported_once_ready(server):
    """/ready has answered (the fixture waits for it): every start-up phase is a metric, none longer than the
    whole span from the front end's process start, and the loading phases took some time."""
    from moe_serve.server.core.startup import __doc__ as phases_doc

    got = {s.labels["phase"]: s.value for s in _metrics(server)["moe_startup_seconds"].samples}
    documented = {line.split()[0] for line in phases_doc.split("Phases")[1].splitlines()[1:] if line.startswith("  ")}
    assert set(got) == documented, set(got) ^ documented
    assert all(v >= 0 for v in got.values())
    assert 0 < got["weight_load"] < got["total"] and 0 < got["warmup"] < got["total"]
    assert got["frontend_import"] + got["warmup"] < got["total"]


def test_expert_load_counts_equal_direct_count(server, llm, monkeypatch):
    """The record endpoints count exactly the top-k ids the model routed (counted here by wrapping `route`)."""
    from moe_serve.moe import model as moe_model
    prompt = "Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 and the router"  # not used elsewhere: no prefix-cache hits
    routed: list = []
    real_route = moe_model.route

    def counting_route(*args, **kw):
        weights, ids = real_route(*args, **kw)
        routed.append(ids.flatten().bincount(minlength=llm.engine.model_config.n_routed_experts))
        return weights, ids

    monkeypatch.setattr(moe_model, "route", counting_route)
    llm.generate([prompt], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    moe_layers = [i for i, layer in enumerate(llm.engine.runner.model.model.layers)
                  if isinstance(layer.mlp, moe_model.MoEBlock)]
    direct = [sum(routed[j::len(moe_layers)]).tolist() for j in range(len(moe_layers))]

    assert server.post("/start_expert_distribution_record")[0] == 200
    status, _ = server.post("/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 6, "temperature": 0,
                                                "ignore_eos": True})
    assert status == 200
    assert server.post("/stop_expert_distribution_record") == (200, {"recording": False})
    status, dump = server.post("/dump_expert_distribution_record")
    assert status == 200
    assert dump["layer_ids"] == moe_layers and dump["logical_counts"] == direct
    assert dump["physical_counts"] == direct  # identity placement: slot i holds expert i

    status, body = server.get("/v1/expert_load")
    window = json.loads(body)
    E = window["num_experts"]
    assert window["placement"]["phy2log"] == [list(range(E))] * len(moe_layers)
    for counts, bal in zip(window["logical_counts"], window["balancedness"]):
        mean = sum(counts) / E
        assert bal == pytest.approx(mean / max(counts) if max(counts) else 1.0)
    assert all(w >= d for wl, dl in zip(window["logical_counts"], direct) for w, d in zip(wl, dl))
    assert server.get("/v1/expert_load?view=bogus")[0] == 400


def test_concurrent_streams_interleave(server):
    """Many concurrent streaming requests all finish, each with its own tokens."""
    results = {}

    def run(i):
        with httpx.stream("POST", server.url + "/v1/completions", headers=server.headers(), timeout=120, json={
                "model": MODEL, "prompt": PROMPTS[i % 3], "max_tokens": 5, "temperature": 0, "stream": True}) as r:
            results[i] = [line for line in r.iter_lines() if line.startswith("data: ")]

    threads = [threading.Thread(target=run, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 8 and all(lines[-1] == "data: [DONE]" for lines in results.values())
    texts = {i: "".join(json.loads(line[6:])["choices"][0]["text"] for line in lines[:-1]) for i, lines in results.items()}
    assert all(texts[i] == texts[i % 3] for i in texts)
