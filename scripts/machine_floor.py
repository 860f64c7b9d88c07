"""The machine's own unevenness: how much the same work varies in time from one run to the next, with nothing
else of ours running. No scheduler can make steps more even than this, so the benchmarks report it beside
inter-token p99 / p50 (bench_peer.py, bench_step.py --jitter). Not a test.

    OMP_NUM_THREADS=2 .venv/bin/python scripts/machine_floor.py --target-ms 5 --iterations 400
    .venv/bin/python scripts/machine_floor.py --threads 1 2 --rounds 3   # alternating thread counts

Two probes on torch's threads (as many as a serving step uses), each repeated `iterations` times:
- gemm: one float32 GEMM sized to take about `target_ms` (arithmetic that needs every thread, as a prompt step);
- read: a sum over a float32 buffer sized to take about `target_ms` (a stream from memory, as a decode step,
  which reads its weights once).

Each reports the median time, p99 / p50 (the statistic of the inter-token target) and p99 over the median of
each run's 21 neighbours (the same without slow drift).
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable

import torch

from moe_serve.server.tools.bench import percentile


def over_local_median(times: list[float], half: int = 10) -> list[float]:
    """Each time over the median of its 2 * half + 1 neighbours (which follows a slow drift)."""
    return [t / statistics.median(times[max(0, i - half):i + half + 1]) for i, t in enumerate(times)]


def timed(fn: Callable[[], object], iterations: int) -> list[float]:
    """Seconds each of `iterations` calls of fn took."""
    times = []
    for _ in range(iterations):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return times


def _sized(make: Callable[[int], Callable[[], object]], size: int, power: float,
           target_s: float) -> tuple[int, Callable]:
    """Grows or shrinks `size` (time ~ size ** power) until one call of make(size) takes about target_s."""
    fn = make(size)
    for _ in range(4):
        fn()
        took = max(statistics.median(timed(fn, 3)), 1e-6)
        size = max(64, round(size * (target_s / took) ** (1 / power)))
        fn = make(size)
    return size, fn


def gemm_probe(target_s: float) -> tuple[str, Callable[[], object]]:
    """(what it runs, a call of about target_s): one float32 GEMM"""
    def make(n: int):
        a, b = torch.randn(n, n), torch.randn(n, n)
        return lambda: torch.mm(a, b)
    n, fn = _sized(make, 256, 3, target_s)
    return f"GEMM {n}^3 float32", fn


def read_probe(target_s: float) -> tuple[str, Callable[[], object]]:
    """(what it runs, a call of about target_s): a sum over a float32 buffer"""
    def make(n: int):
        buf = torch.ones(n)
        return lambda: buf.sum()
    n, fn = _sized(make, 1 << 22, 1, target_s)
    return f"sum of {n * 4 / 1e6:.0f} MB", fn


def floor_stats(times: list[float]) -> dict:
    """Median (ms), p99 / p50 and p99 over the local median of one probe's times."""
    med = statistics.median(times)
    return {"median_ms": med * 1e3, "p99_over_p50": percentile(times, 99) / med,
            "p99_over_local": percentile(over_local_median(times), 99), "runs": len(times)}


def measure(target_s: float = 0.005, iterations: int = 400) -> dict:
    """{probe: floor_stats and what it ran} for the gemm and read probes, on torch's current threads."""
    out = {}
    for name, probe in (("gemm", gemm_probe), ("read", read_probe)):
        what, fn = probe(target_s)
        out[name] = {"what": what, "threads": torch.get_num_threads(), **floor_stats(timed(fn, iterations))}
    return out


def describe(floor: dict) -> str:
    """One line for `measure`'s result."""
    return "; ".join(f"{v['what']} ({v['threads']} threads, {v['median_ms']:.1f} ms): p99 / p50 "
                     f"{v['p99_over_p50']:.2f}, p99 over local median {v['p99_over_local']:.2f}"
                     for v in floor.values())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target-ms", type=float, default=5.0, help="about how long one run of each probe takes")
    ap.add_argument("--iterations", type=int, default=400)
    ap.add_argument("--rounds", type=int, default=1, help="measure this many times in a row")
    ap.add_argument("--threads", type=int, nargs="*", default=[],
                    help="torch thread counts to alternate within each round (default: torch's own)")
    args = ap.parse_args()
    for _ in range(args.rounds):
        for threads in args.threads or [torch.get_num_threads()]:
            torch.set_num_threads(threads)
            print(describe(measure(args.target_ms / 1e3, args.iterations)), flush=True)


if __name__ == "__main__":
    main()
