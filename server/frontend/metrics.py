"""Prometheus metrics of the server, in their own registry, every name prefixed `moe_`.

Two sources:
  * the front end measures what it sees per request: tokens, latencies (TTFT, inter-token, end-to-end),
    finished requests by reason (`Metrics.on_tokens` / `on_finish`, called as outputs arrive);
  * the engine's counters and gauges (running / waiting requests, KV cache, prefix cache, preemptions,
    expert load) are read from the latest `stats` reply of the engine process at scrape time
    (`EngineStatsCollector`); GPU utilisation and memory come from NVML where a GPU exists.
Each metric is documented in README.md ("Metrics").
"""

from __future__ import annotations

import logging
import os

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

log = logging.getLogger(__name__)

FINISH_REASONS = ("stop", "length", "abort")
_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
                    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0,
                960.0, 1920.0)


class Metrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.prompt_tokens = Counter("moe_prompt_tokens", "Prompt tokens of requests whose prefill finished.",
                                     registry=r)
        self.generation_tokens = Counter("moe_generation_tokens", "Generated tokens.", registry=r)
        self.request_finished = Counter("moe_request_finished", "Finished requests, by finish reason.",
                                        ["finished_reason"], registry=r)
        for reason in FINISH_REASONS:
            self.request_finished.labels(reason)
        self.ttft = Histogram("moe_time_to_first_token_seconds", "Time from arrival to the first generated token.",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("moe_inter_token_latency_seconds", "Time between two tokens of one request.",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("moe_e2e_request_latency_seconds", "Time from arrival to finish (or abort).",
                             buckets=_E2E_BUCKETS, registry=r)
        self.startup = Gauge("moe_startup_seconds", "Seconds per start-up phase, from process start to /ready "
                             "(phases in server/core/startup.py; total is the whole span).", ["phase"], registry=r)
        self.engine = EngineStatsCollector()
        r.register(self.engine)
        r.register(GpuCollector())

    def on_tokens(self, sink, num_tokens: int, now: float) -> None:
        if num_tokens == 0:
            return
        if sink.first_token is None:
            sink.first_token = now
            self.ttft.observe(now - sink.arrival)
            self.prompt_tokens.inc(sink.prompt_len)
        elif sink.last_token is not None:
            gap = (now - sink.last_token) / num_tokens
            for _ in range(num_tokens):
                self.itl.observe(gap)
        sink.last_token = now
        self.generation_tokens.inc(num_tokens)

    def on_finish(self, sink, reason: str | None, now: float) -> None:
        self.request_finished.labels(reason or "abort").inc()
        self.e2e.observe(now - sink.arrival)


class EngineStatsCollector:
    """Engine-side values from the latest `stats` reply (zeros until the first one)."""

    def __init__(self) -> None:
        self.stats: dict = {}
        self.engine_alive = False

    def update(self, stats: dict, alive: bool) -> None:
        self.stats, self.engine_alive = stats, alive

    def collect(self):
        s = self.stats
        yield GaugeMetricFamily("moe_engine_alive", "1 while the engine process answers heartbeats.",
                                value=float(self.engine_alive))
        yield GaugeMetricFamily("moe_num_requests_running", "Requests scheduled in the running batch.",
                                value=s.get("num_running", 0))
        yield GaugeMetricFamily("moe_num_requests_waiting", "Requests waiting to be scheduled.",
                                value=s.get("num_waiting", 0))
        yield GaugeMetricFamily("moe_kv_cache_usage_perc", "Fraction of KV cache blocks in use (0-1).",
                                value=s.get("kv_cache_usage", 0.0))
        yield GaugeMetricFamily("moe_kv_cache_capacity_tokens", "Tokens the KV cache holds.",
                                value=s.get("kv_cache_tokens_total", 0))
        yield CounterMetricFamily("moe_prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                                  value=s.get("prefix_cache_query_tokens", 0))
        yield CounterMetricFamily("moe_prefix_cache_hits", "Prompt tokens found in the prefix cache.",
                                  value=s.get("prefix_cache_hit_tokens", 0))
        yield CounterMetricFamily("moe_num_preemptions", "Requests preempted (KV blocks ran out).",
                                  value=s.get("num_preemptions", 0))
        expert = s.get("expert") or {}
        bal = GaugeMetricFamily("moe_expert_balancedness",
                                "Per MoE layer, mean / max load over EP ranks in the recent window (each expert "
                                "its own unit when EP size is 1); 1 = perfectly even.", labels=["layer"])
        for layer, value in zip(expert.get("layer_ids", []), expert.get("balancedness", [])):
            bal.add_metric([str(layer)], value)
        yield bal
        rank = CounterMetricFamily("moe_ep_rank_tokens", "Token-to-expert assignments handled by each EP rank, "
                                   "summed over MoE layers.", labels=["rank"])
        for r, value in enumerate(expert.get("rank_tokens_total", [])):
            rank.add_metric([str(r)], value)
        yield rank
        a2a = sum(s.get(f"dispatch_{k}", 0) for k in ("bytes_sent", "meta_bytes_sent", "combine_bytes_sent"))
        yield CounterMetricFamily("moe_all_to_all_bytes", "Bytes this engine sent to other EP ranks in all-to-all "
                                  "dispatch and combine (hidden states, ids, weights); 0 with a single rank.", value=a2a)
        yield CounterMetricFamily("moe_dispatch_cross_node_bytes", "Hidden-state bytes dispatch sent to EP ranks on "
                                  "other nodes (ranks mapped to nodes by torchrun's --nproc-per-node); 0 on one node.",
                                  value=s.get("dispatch_bytes_sent_cross_node", 0))


class GpuCollector:
    """GPU utilisation and memory through NVML; yields no samples where there is no GPU or no NVML."""

    def __init__(self) -> None:
        self.handles: list[tuple[str, object]] = []
        try:
            import pynvml

            pynvml.nvmlInit()
            visible = os.environ.get("CUDA_VISIBLE_DEVICES")
            count = pynvml.nvmlDeviceGetCount()
            indices = [int(i) for i in visible.split(",") if i.strip().isdigit()] if visible else range(count)
            self.handles = [(str(i), pynvml.nvmlDeviceGetHandleByIndex(i)) for i in indices if i < count]
            self.nvml = pynvml
        except Exception as exc:  # noqa: BLE001 - no driver, no GPU: the metrics stay empty
            log.info("NVML unavailable (%s): GPU metrics have no samples", exc)

    def collect(self):
        util = GaugeMetricFamily("moe_gpu_utilization_perc", "GPU utilisation (0-100) from NVML.", labels=["gpu"])
        used = GaugeMetricFamily("moe_gpu_memory_used_bytes", "GPU memory in use, from NVML.", labels=["gpu"])
        total = GaugeMetricFamily("moe_gpu_memory_total_bytes", "GPU memory in all, from NVML.", labels=["gpu"])
        for name, handle in self.handles:
            try:
                rates = self.nvml.nvmlDeviceGetUtilizationRates(handle)
                mem = self.nvml.nvmlDeviceGetMemoryInfo(handle)
            except Exception:  # noqa: BLE001 - a GPU that stops answering loses its samples
                continue
            util.add_metric([name], rates.gpu)
            used.add_metric([name], mem.used)
            total.add_metric([name], mem.total)
        yield from (util, used, total)
