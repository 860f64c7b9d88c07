"""A request re-submitted after a lost engine job (its outputs so far appended to the prompt, `num_prior_outputs`
= how many) goes on exactly as it would have: the same tokens, greedy and seeded, the same length and the same
stop; a seeded draw depends on (seed, output index) only. Meanwhile a stream gets keep-alive comments."""

from __future__ import annotations

import asyncio

import pytest

from moe_serve.server.core.config import EngineConfig
from moe_serve.server.core.engine import EngineCore
from moe_serve.server.core.request import Request
from moe_serve.server.core.sampler import draw_seed
from moe_serve.server.core.sampling_params import SamplingParams

PROMPT = [5, 17, 42, 8, 99]


def run(engine: EngineCore, prompt: list[int], params: SamplingParams, rid: str, prior: int = 0) -> tuple[list, str]:
    engine.add_request(prompt, params, request_id=rid, num_prior_outputs=prior)
    tokens, finish = [], None
    for _ in range(200):
        for out in engine.step():
            tokens += out.new_token_ids
            finish = out.finish_reason or finish
        if not engine.has_unfinished_requests():
            return tokens, finish
    raise AssertionError("the request did not finish")


@pytest.fixture(scope="module")
def engine(checkpoint):
    return EngineCore(EngineConfig(model=checkpoint("v3"), dtype="float32", kernel_backend="torch"))


@pytest.mark.parametrize("params", [
    SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True),
    SamplingParams(max_tokens=8, temperature=0.9, top_p=0.8, top_k=20, seed=123, min_tokens=6),
], ids=["greedy", "seeded-min-tokens"])
def test_resubmission_continues_the_same_tokens(engine, params):
    full, finish = run(engine, PROMPT, params, f"whole-{params.seed}")
    assert finish in ("length", "stop") and len(full) <= 8
    for k in (1, len(full) - 2):
        rest, rest_finish = run(engine, PROMPT + full[:k], params, f"resumed-{k}", prior=k)
        assert full[:k] + rest == full, k
        assert rest_finish == finish


def test_draw_seed_mixes_seed_and_index():
    seeds = {draw_seed(s, i) for s in range(8) for i in range(8)}
    assert len(seeds) == 64  # seed + j for sample j never meets another sample's draw
    assert all(0 <= s < 2**64 for s in seeds) and draw_seed(7, 3) == draw_seed(7, 3)
    assert draw_seed(-1, 0) != draw_seed(2**63 - 1, 0)


def test_prior_outputs_must_leave_a_prompt():
    with pytest.raises(ValueError, match=r"num_prior_outputs must be in \[0, 3\)"):
        Request("r", [1, 2, 3], SamplingParams(), num_prior_outputs=3)


def test_stream_keeps_alive_while_no_engine_is_attached():
    from moe_serve.server.frontend.protocol import APIError
    from moe_serve.server.frontend.serving import OpenAIServing

    class Client:
        alive = False

    serving = OpenAIServing(Client(), None, ["m"], 64, 100)
    serving.KEEP_ALIVE_S = 0.05

    async def chunks(fail: bool):
        yield "data: 1\n\n"
        await asyncio.sleep(0.3)  # the outage
        if fail:
            raise APIError("the engine job did not re-attach", status=503)
        yield "data: 2\n\n"

    async def collect(fail: bool) -> list[str]:
        return [c async for c in serving._keep_alive(chunks(fail))]

    got = asyncio.run(collect(False))
    assert got[0] == "data: 1\n\n" and got[-1] == "data: 2\n\n"
    assert 3 <= got.count(": waiting for the engine job to re-attach\n\n") == len(got) - 2
    got = asyncio.run(collect(True))
    assert '"code": 503' in got[-2] and got[-1] == "data: [DONE]\n\n"
    Client.alive = True  # an engine attached but slow: no comments
    assert asyncio.run(collect(False)) == ["data: 1\n\n", "data: 2\n\n"]

    async def broken():
        yield "data: 1\n\n"
        raise RuntimeError("the stream broke")

    async def collect_broken() -> list[str]:
        return [c async for c in serving._keep_alive(broken())]

    with pytest.raises(RuntimeError, match="the stream broke"):  # any other error reaches the response
        asyncio.run(collect_broken())
