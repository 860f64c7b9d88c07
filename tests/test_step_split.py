"""The engine's step trace and the split of a client's inter-token gaps into the engine's and the delivery's."""

from __future__ import annotations

import json

import pytest

from moe_serve.server.core.step_trace import read_trace
from moe_serve.server.tools.step_split import split_client_file, split_gaps


def test_split_puts_each_token_on_the_last_step_that_ended_before_it():
    ends = [0.010, 0.020, 0.035, 0.045]
    # tokens at 10.5, 20.5, 36.5, 47.0 ms: steps 0, 1, 2, 3; then one before any step ended (left out)
    split = split_gaps(ends, [(0.0, 0.0105, [0.0100, 0.0160, 0.0105]), (0.0, 0.005, [])])
    assert split["tokens"] == 5 and split["unmatched"] == 1
    # client gaps 10, 16, 10.5 ms; the steps' gaps 10, 15, 10 ms
    assert split["client_ms"]["p50"] == pytest.approx(10.5)
    assert split["engine_ms"]["p50"] == pytest.approx(10.0)
    assert split["engine_ms"]["p99"] == pytest.approx(10.0 + 0.98 * 5.0)
    # delays 0.5, 0.5, 1.5, 2.0 ms
    assert split["delivery_ms"]["p50"] == pytest.approx(1.0)
    assert split["delivery_ms"]["p99"] == pytest.approx(1.5 + 0.97 * 0.5)


def test_the_engine_writes_a_line_per_step_that_accounts_for_every_token(checkpoint, tmp_path):
    from moe_serve.server import LLM, SamplingParams

    trace = tmp_path / "steps.txt"
    llm = LLM(checkpoint("v3"), dtype="float32", enable_prefix_caching=False, max_num_batched_tokens=8,
              step_trace=str(trace))
    prompts = [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15], [20, 21, 22]]
    outs = llm.generate(prompts, SamplingParams(max_tokens=4, ignore_eos=True))
    steps = read_trace(trace)
    assert steps and all(start < end for start, end, *_ in steps)
    assert all(a[1] <= b[0] for a, b in zip(steps, steps[1:]))  # one after the other
    # every token computed is in one step's decodes or prompt tokens (3 decodes a request after its prompt's
    # token), and every token generated is one output
    assert sum(p for *_, p, _ in steps) + sum(d for *_, d, _, _ in steps) == sum(map(len, prompts)) + 2 * 3
    assert sum(o for *_, o in steps) == sum(len(o.outputs[0].token_ids) for o in outs) == 8
    assert max(p for *_, p, _ in steps) <= 8


def test_split_of_a_client_file_skips_failed_requests(tmp_path):
    trace = tmp_path / "steps.txt"
    trace.write_text("0.000 0.010 1 0 1\n0.010 0.020 1 0 1\nnot a step line\n")
    client = tmp_path / "run.json"
    client.write_text(json.dumps({"start_times": [0.0, 0.0], "ttfts": [0.011, 0.0], "itls": [[0.010], []],
                                  "errors": ["", "HTTP 400"]}))
    split = split_client_file(trace, client)
    assert split["tokens"] == 2 and split["unmatched"] == 0
    assert split["engine_ms"]["p50"] == pytest.approx(10.0)
    assert split["delivery_ms"]["p50"] == pytest.approx(1.0)


def test_bench_peer_tables_the_split_per_rate(script):
    peer = script("bench_peer")
    run = {"client_ms": {"ratio": 1.6}, "engine_ms": {"ratio": 1.5}, "delivery_ms": {"p50": 1.2, "p99": 4.0}}
    slower = {**run, "engine_ms": {"ratio": 1.3}}
    doc = {"runs": [{"rate": 10.0, "step_split": run}, {"rate": 10.0, "step_split": slower},
                    {"rate": 16.0, "step_split": run}]}
    lines = peer.step_split_lines(doc)
    assert "| 10 | 1.60 | 1.40 | 1.2 / 4.0 |" in lines and "| 16 | 1.60 | 1.50 | 1.2 / 4.0 |" in lines
    assert peer.step_split_lines({"runs": [{"rate": 10.0}]}) == []


def test_step_trace_flag_and_per_rank_files():
    from moe_serve.server.cli import _engine_kwargs, build_parser
    from moe_serve.server.core.step_trace import trace_path

    args = build_parser().parse_args(["serve", "m", "--step-trace", "out/steps.txt"])
    assert _engine_kwargs(args)["step_trace"] == "out/steps.txt"
    assert _engine_kwargs(build_parser().parse_args(["serve", "m"]))["step_trace"] is None
    assert str(trace_path("t.txt", 0, 1)) == "t.txt" and str(trace_path("t.txt", 1, 2)) == "t.txt.rank1"
