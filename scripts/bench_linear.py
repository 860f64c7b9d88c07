"""bf16 linear on CPU: F.linear against the oneDNN-packed path of kernels/cpu_linear.py. Not a test.

    OMP_NUM_THREADS=1 .venv/bin/python scripts/bench_linear.py

Microseconds per call for one [out, in] weight at several row counts, cycling over --weights distinct
weights so they do not stay in cache (as in a decode step, which reads each weight once).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from kernels import cpu_linear  # noqa: E402


def per_call_us(fn, calls: int, repeats: int = 5) -> float:
    for _ in range(2):
        fn()
    t0 = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - t0) / repeats / calls * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", type=int, nargs=2, default=[512, 512], metavar=("OUT", "IN"))
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8, 64, 256])
    ap.add_argument("--weights", type=int, default=64)
    args = ap.parse_args()
    ws = [torch.randn(*args.shape, dtype=torch.bfloat16) for _ in range(args.weights)]
    packed = [cpu_linear.pack(w) for w in ws]
    if packed[0] is None:
        raise SystemExit("oneDNN packing is not available in this torch build")
    print(f"weight {args.shape[0]}x{args.shape[1]} bf16, {args.weights} weights, {torch.get_num_threads()} thread(s)")
    print(f"{'rows':>6} {'F.linear us':>12} {'packed us':>10} {'ratio':>6}")
    for m in args.rows:
        x = torch.randn(m, args.shape[1], dtype=torch.bfloat16)
        ref = per_call_us(lambda: [F.linear(x, w) for w in ws], len(ws))
        new = per_call_us(lambda: [cpu_linear.linear(x, w, p) for w, p in zip(ws, packed)], len(ws))
        print(f"{m:>6} {ref:>12.1f} {new:>10.1f} {ref / new:>5.2f}x")


if __name__ == "__main__":
    main()
