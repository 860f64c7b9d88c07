"""Prometheus metrics: every documented metric is exposed, parses, and front-end counters add up.
(The live server's /metrics is checked in test_api.py::test_metrics_move_as_requests_complete.)"""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from moe_serve.server.frontend.engine_client import Sink
from moe_serve.server.frontend.metrics import Metrics

# family names as the parser reports them (counters without `_total`)
ALL_METRICS = [
    "moe_num_requests_running", "moe_num_requests_waiting", "moe_kv_cache_usage_perc", "moe_kv_cache_capacity_tokens",
    "moe_prefix_cache_queries", "moe_prefix_cache_hits", "moe_num_preemptions", "moe_prompt_tokens",
    "moe_generation_tokens", "moe_time_to_first_token_seconds", "moe_inter_token_latency_seconds",
    "moe_e2e_request_latency_seconds", "moe_request_finished", "moe_expert_balancedness", "moe_ep_rank_tokens",
    "moe_all_to_all_bytes", "moe_dispatch_cross_node_bytes", "moe_gpu_utilization_perc", "moe_gpu_memory_used_bytes", "moe_gpu_memory_total_bytes",
    "moe_engine_alive", "moe_startup_seconds",
]


def families(metrics: Metrics) -> dict:
    return {f.name: f for f in text_string_to_metric_families(generate_latest(metrics.registry).decode())}


def sample(fams, name, sample_name=None, **labels) -> float:
    for s in fams[name].samples:
        if s.name == (sample_name or name) and all(s.labels.get(k) == v for k, v in labels.items()):
            return s.value
    raise KeyError(name)


def test_every_metric_exposed_before_any_traffic():
    fams = families(Metrics())
    assert set(ALL_METRICS) <= set(fams), set(ALL_METRICS) - set(fams)
    assert all(name.startswith("moe_") for name in fams)
    assert sample(fams, "moe_request_finished", "moe_request_finished_total", finished_reason="abort") == 0


def test_every_metric_documented_in_readme():
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    documented = set(re.findall(r"`(moe_[a-z0-9_]+)", readme))
    exposed = {n + "_total" if n in ("moe_prefix_cache_queries", "moe_prefix_cache_hits", "moe_num_preemptions",
                                     "moe_prompt_tokens", "moe_generation_tokens", "moe_request_finished",
                                     "moe_ep_rank_tokens", "moe_all_to_all_bytes", "moe_dispatch_cross_node_bytes")
                else n for n in ALL_METRICS}
    assert exposed <= documented, exposed - documented


def test_request_lifecycle_counts():
    m = Metrics()
    sink = Sink(asyncio.Queue(), 0, prompt_len=5)
    t0 = sink.arrival
    m.on_tokens(sink, 1, t0 + 0.5)  # first token: TTFT 0.5, prompt tokens counted
    m.on_tokens(sink, 1, t0 + 0.6)
    m.on_tokens(sink, 2, t0 + 0.8)  # two tokens in one message: two inter-token gaps of 0.1
    m.on_finish(sink, "length", t0 + 0.8)
    other = Sink(asyncio.Queue(), 1, prompt_len=3)
    m.on_finish(other, "abort", other.arrival + 1.0)  # aborted before its first token
    f = families(m)
    assert sample(f, "moe_prompt_tokens", "moe_prompt_tokens_total") == 5
    assert sample(f, "moe_generation_tokens", "moe_generation_tokens_total") == 4
    assert sample(f, "moe_time_to_first_token_seconds", "moe_time_to_first_token_seconds_sum") == pytest.approx(0.5)
    assert sample(f, "moe_inter_token_latency_seconds", "moe_inter_token_latency_seconds_count") == 3
    assert sample(f, "moe_inter_token_latency_seconds", "moe_inter_token_latency_seconds_sum") == pytest.approx(0.3)
    assert sample(f, "moe_e2e_request_latency_seconds", "moe_e2e_request_latency_seconds_count") == 2
    assert sample(f, "moe_request_finished", "moe_request_finished_total", finished_reason="length") == 1
    assert sample(f, "moe_request_finished", "moe_request_finished_total", finished_reason="abort") == 1


def test_engine_stats_rendered():
    m = Metrics()
    m.engine.update({"num_running": 3, "num_waiting": 2, "kv_cache_usage": 0.25, "kv_cache_tokens_total": 4096,
                     "prefix_cache_query_tokens": 100, "prefix_cache_hit_tokens": 40, "num_preemptions": 1,
                     "expert": {"layer_ids": [1, 2], "balancedness": [0.5, 0.75], "rank_tokens_total": [120]}},
                    alive=True)
    f = families(m)
    assert sample(f, "moe_num_requests_running") == 3 and sample(f, "moe_num_requests_waiting") == 2
    assert sample(f, "moe_kv_cache_usage_perc") == 0.25
    assert sample(f, "moe_prefix_cache_hits", "moe_prefix_cache_hits_total") == 40
    assert sample(f, "moe_prefix_cache_queries", "moe_prefix_cache_queries_total") == 100
    assert sample(f, "moe_num_preemptions", "moe_num_preemptions_total") == 1
    assert sample(f, "moe_expert_balancedness", layer="2") == 0.75
    assert sample(f, "moe_ep_rank_tokens", "moe_ep_rank_tokens_total", rank="0") == 120
    assert sample(f, "moe_all_to_all_bytes", "moe_all_to_all_bytes_total") == 0
    assert sample(f, "moe_engine_alive") == 1
