"""Soak: a bounded overload run against a local `moe serve` (loopback only; stops by itself).

1. Starts the server (tiny checkpoint by default) on 127.0.0.1 and measures its saturation rate: a burst of
   --burst requests at once, completed requests per second.
2. Sends requests open-loop at --factor x that rate for --seconds (uniform arrivals; at most --max-outstanding
   in flight on the client side, beyond which an arrival is counted as "not sent", never queued).
3. Every request ends as one of: full answer (200 with max_tokens tokens), explicit rejection (503 with
   Retry-After), other explicit error (an OpenAI error body), or lost (no answer: timeout or dropped
   connection). Lost must be 0.
4. Samples VmRSS of the front end and the engine process every --sample-s; after the load, waits for the
   KV cache usage (`moe_kv_cache_usage_perc`) and the running/waiting gauges to return to idle.

Prints a JSON summary (and writes it to --out). Exit code 1 if a request was lost, memory grew more than
--max-rss-growth-mib, or the KV usage did not return to idle.

    python scripts/soak.py --seconds 180            # the figures in docs/reliability.md
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

from api_server import httpx, running_server  # noqa: E402


def rss_mib(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def gauges(url: str) -> dict:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(url + "/metrics", timeout=10).text
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples if not s.labels}


async def one(client, url: str, body: dict, outcomes: dict, timeout_s: float) -> None:
    try:
        r = await client.post(url + "/v1/completions", json=body, timeout=timeout_s)
    except Exception as exc:  # noqa: BLE001 - a request without an answer is lost
        outcomes["lost"] += 1
        outcomes.setdefault("lost_examples", []).append(repr(exc)[:200])
        return
    try:
        doc = r.json()
    except ValueError:
        outcomes["lost"] += 1  # an answer that is not an OpenAI body counts as lost
        return
    if r.status_code == 200 and doc["usage"]["completion_tokens"] == body["max_tokens"]:
        outcomes["full"] += 1
    elif r.status_code == 503 and r.headers.get("retry-after") and "error" in doc:
        outcomes["rejected_503"] += 1
    elif "error" in doc:
        outcomes["error"] += 1
        outcomes.setdefault("error_examples", []).append(f"{r.status_code} {doc['error']['message'][:160]}")
    else:
        outcomes["lost"] += 1


async def burst(url: str, n: int, body: dict) -> float:
    """Completed requests per second with n sent at once."""
    outcomes = {"full": 0, "rejected_503": 0, "error": 0, "lost": 0}
    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=n)) as client:
        t0 = time.perf_counter()
        await asyncio.gather(*(one(client, url, body, outcomes, 120) for _ in range(n)))
        wall = time.perf_counter() - t0
    if outcomes["full"] != n:
        raise RuntimeError(f"saturation burst did not complete: {outcomes}")
    return n / wall


async def load(url: str, rate: float, seconds: float, body: dict, max_outstanding: int, timeout_s: float,
               pids: dict[str, int], sample_s: float) -> tuple[dict, dict]:
    outcomes = {"sent": 0, "not_sent": 0, "full": 0, "rejected_503": 0, "error": 0, "lost": 0}
    rss: dict[str, list] = {name: [] for name in pids}
    tasks: set[asyncio.Task] = set()

    async def sampler():
        while True:
            for name, pid in pids.items():
                rss[name].append(rss_mib(pid))
            await asyncio.sleep(sample_s)

    sampling = asyncio.create_task(sampler())
    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=max_outstanding)) as client:
        t0 = time.monotonic()
        i = 0
        while (now := time.monotonic()) - t0 < seconds:
            due = t0 + i / rate
            if due > now:
                await asyncio.sleep(due - now)
            i += 1
            if len(tasks) >= max_outstanding:
                outcomes["not_sent"] += 1
                continue
            outcomes["sent"] += 1
            task = asyncio.create_task(one(client, url, body, outcomes, timeout_s))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        if tasks:
            await asyncio.wait(tasks, timeout=timeout_s + 10)
    await asyncio.sleep(sample_s)  # one more sample after the drain
    sampling.cancel()
    return outcomes, rss


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="checkpoint dir (default: a tiny DeepSeek-V3-style one)")
    ap.add_argument("--seconds", type=float, default=180.0)
    ap.add_argument("--factor", type=float, default=1.5, help="offered load / saturation rate")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--burst", type=int, default=48, help="requests sent at once to measure saturation")
    ap.add_argument("--max-num-seqs", type=int, default=16)
    ap.add_argument("--max-waiting-requests", type=int, default=32)
    ap.add_argument("--max-outstanding", type=int, default=512)
    ap.add_argument("--timeout-s", type=float, default=120.0, help="per request; past it the request is lost")
    ap.add_argument("--sample-s", type=float, default=5.0)
    ap.add_argument("--max-rss-growth-mib", type=float, default=64.0)
    ap.add_argument("--out", default=None, help="also write the JSON summary here")
    args = ap.parse_args(argv)
    assert args.seconds <= 3600, "a soak is bounded: --seconds at most 3600"

    model = args.model
    if model is None:
        from moe_serve.moe.tiny import make_checkpoint

        model = str(make_checkpoint(Path(tempfile.mkdtemp(prefix="soak-")), "v3"))
    body = {"prompt": "The quick brown fox jumps over the lazy dog", "max_tokens": args.max_tokens,
            "temperature": 0, "ignore_eos": True}
    with running_server(model, "--max-model-len", "256", "--max-num-seqs", str(args.max_num_seqs),
                        "--max-waiting-requests", str(args.max_waiting_requests)) as server:
        pids = {"front_end": server.proc.pid, **{f"engine_{i}": p for i, p in enumerate(server.engine_pids())}}
        idle = gauges(server.url)
        saturation = asyncio.run(burst(server.url, args.burst, body))
        rate = args.factor * saturation
        print(f"saturation {saturation:.1f} req/s; offering {rate:.1f} req/s for {args.seconds:.0f} s", flush=True)
        outcomes, rss = asyncio.run(load(server.url, rate, args.seconds, body, args.max_outstanding, args.timeout_s,
                                         pids, args.sample_s))
        deadline, end = time.monotonic() + 60, gauges(server.url)
        while time.monotonic() < deadline and (end["moe_kv_cache_usage_perc"] != idle["moe_kv_cache_usage_perc"]
                                               or end["moe_num_requests_running"] or end["moe_num_requests_waiting"]):
            time.sleep(0.5)
            end = gauges(server.url)
        alive = server.get("/health")[0] == 200

    summary = {"seconds": args.seconds, "saturation_req_s": round(saturation, 2), "offered_req_s": round(rate, 2),
               "max_tokens": args.max_tokens, "outcomes": outcomes, "health_after": alive,
               "kv_usage_idle_before": idle["moe_kv_cache_usage_perc"], "kv_usage_after": end["moe_kv_cache_usage_perc"],
               "running_after": end["moe_num_requests_running"], "waiting_after": end["moe_num_requests_waiting"],
               "rss_mib": {}}
    ok = outcomes["lost"] == 0 and alive and summary["kv_usage_after"] == summary["kv_usage_idle_before"]
    for name, samples in rss.items():
        xs = [x for x in samples if x is not None]
        if len(xs) < 4:
            continue
        q = max(1, len(xs) // 4)  # growth: mean of the last quarter minus mean of the first quarter
        growth = statistics.mean(xs[-q:]) - statistics.mean(xs[:q])
        summary["rss_mib"][name] = {"samples": len(xs), "first": round(xs[0], 1), "last": round(xs[-1], 1),
                                    "min": round(min(xs), 1), "max": round(max(xs), 1), "growth": round(growth, 1)}
        ok = ok and growth <= args.max_rss_growth_mib
    summary["ok"] = ok
    text = json.dumps(summary, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
