"""Split a client's inter-token gaps into the engine's and the serving path's (not a test).

A streaming client stamps each token when it reads it: its gap between two tokens of a request is the gap
between the engine steps that made them plus the change in the delay from a step's end to the token's arrival
(the front end, the socket, the client itself). With the engine's step trace (`moe serve --step-trace FILE`,
server/core/step_trace.py) and the client's per-request times on the same clock (`vllm bench serve
--save-detailed`: start_times, ttfts, itls, all from time.perf_counter, CLOCK_MONOTONIC on Linux), each token is
put on the last step that ended before it arrived:

    .venv/bin/python -m moe_serve.server.tools.step_split out/peer/moe-steps.txt out/peer/vllm-client/moe-r0-16.json

Per client file: the client's inter-token p50 / p99 and their ratio, the same for the gaps between the tokens'
steps (what the engine alone made of them), and the delivery delay's p50 / p90 / p99.
"""

from __future__ import annotations

import argparse
import bisect
import json
from pathlib import Path

from moe_serve.server.core.step_trace import read_trace
from moe_serve.server.tools.bench import percentile


def _dist(values_s: list[float]) -> dict:
    p50, p99 = percentile(values_s, 50) * 1e3, percentile(values_s, 99) * 1e3
    return {"p50": p50, "p99": p99, "ratio": p99 / p50 if p50 > 0 else float("nan")}


def split_gaps(step_ends: list[float], requests: list[tuple[float, float, list[float]]]) -> dict:
    """`step_ends`: sorted end times of the engine's steps; `requests`: (start, ttft, itls) per request, seconds
    on the same clock. Returns {"client_ms", "engine_ms"}: p50 / p99 / ratio of the client's gaps and of the gaps
    between the steps that made the same tokens; "delivery_ms": p50 / p90 / p99 of token arrival - its step's
    end; "tokens", and "unmatched": tokens that arrived before any step ended (then left out)."""
    client, engine, delays, unmatched, tokens = [], [], [], 0, 0
    for start, ttft, itls in requests:
        t = start + ttft
        times = [t]
        for gap in itls:
            t += gap
            times.append(t)
        tokens += len(times)
        steps = [bisect.bisect_right(step_ends, x) - 1 for x in times]
        prev = None
        for x, k in zip(times, steps):
            if k < 0:
                unmatched += 1
                prev = None
                continue
            delays.append(x - step_ends[k])
            if prev is not None:
                client.append(x - prev[0])
                engine.append(step_ends[k] - step_ends[prev[1]])
            prev = (x, k)
    return {"client_ms": _dist(client), "engine_ms": _dist(engine),
            "delivery_ms": {f"p{q}": percentile(delays, q) * 1e3 for q in (50, 90, 99)},
            "tokens": tokens, "unmatched": unmatched}


def split_client_file(trace: Path, client_json: Path) -> dict:
    """split_gaps for a step trace and a `vllm bench serve --save-detailed` result file."""
    ends = sorted(end for _, end, *_ in read_trace(trace))
    res = json.loads(Path(client_json).read_text())
    errors = res.get("errors") or [""] * len(res["itls"])
    rows = zip(res["start_times"], res["ttfts"], res["itls"], errors)
    requests = [(start, ttft, itls) for start, ttft, itls, error in rows if not error and ttft]
    return split_gaps(ends, requests)


def describe(split: dict) -> str:
    c, e, d = split["client_ms"], split["engine_ms"], split["delivery_ms"]
    return (f"client ITL p50 {c['p50']:.1f} p99 {c['p99']:.1f} ms ({c['ratio']:.2f}); the same tokens' steps "
            f"p50 {e['p50']:.1f} p99 {e['p99']:.1f} ms ({e['ratio']:.2f}); step end -> token at the client "
            f"p50 {d['p50']:.2f} p90 {d['p90']:.2f} p99 {d['p99']:.2f} ms")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("trace", type=Path, help="the engine's step trace (moe serve --step-trace)")
    ap.add_argument("client_json", type=Path, nargs="+", help="vllm bench serve --save-detailed result files")
    args = ap.parse_args()
    for path in args.client_json:
        print(f"{path.name}: {describe(split_client_file(args.trace, path))}")


if __name__ == "__main__":
    main()
