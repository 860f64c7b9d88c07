"""Time of one engine step: `EngineCore.step()` medians over decode steps with N requests running. Not a test.

    OMP_NUM_THREADS=1 .venv/bin/python scripts/bench_step.py --running 1 12 64
    OMP_NUM_THREADS=1 .venv/bin/python scripts/bench_step.py --running 4 --kernels   # time per C kernel
    OMP_NUM_THREADS=1 .venv/bin/python scripts/bench_step.py --running 4 --kernels --layer-by-layer

Builds the benchmark checkpoint if missing (.cache/bench), adds N requests of random 64-192 token prompts,
prefills them all, then times --steps decode steps and prints the median and minimum per N. --kernels
also times every call into the CPU kernel ops (kernels/cpu_build.py; the cpu kernel backend)
and prints each one's milliseconds per decode step; the rest of the step is torch ops and Python.
"""

from __future__ import annotations

import argparse
import collections
import statistics
import time
from pathlib import Path


import torch  # noqa: E402

from moe_serve.kernels import cpu_build  # noqa: E402
from moe_serve.moe.tiny import ensure_checkpoint  # noqa: E402
from moe_serve.server import LLM, SamplingParams  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=".cache/bench")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--kernel-backend", default="auto", choices=["auto", "torch", "cpu", "cuda"])
    ap.add_argument("--running", type=int, nargs="+", default=[1, 12, 64])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--kernels", action="store_true", help="also time each CPU kernel (ms per decode step)")
    ap.add_argument("--layer-by-layer", action="store_true",
                    help="decode steps call each kernel from Python, not one C call per layer (kernels/cpu_decode_layer.py): "
                         "with --kernels, the time of each kernel inside a layer")
    args = ap.parse_args()
    kernel_s = time_kernels() if args.kernels else None
    if args.model == ".cache/bench":
        ensure_checkpoint(Path(args.model), "bench")
    llm = LLM(args.model, dtype=args.dtype, kernel_backend=args.kernel_backend, max_num_seqs=max(args.running), max_num_batched_tokens=2048,
              kv_cache_tokens=65536)
    engine = llm.engine
    if args.layer_by_layer:
        for layer in engine.runner.model.model.layers:
            layer.fast_decode = None
    params = SamplingParams(max_tokens=10_000, temperature=0.0, ignore_eos=True)
    print(f"{args.model} {args.dtype}, kernel backend {args.kernel_backend}, {torch.get_num_threads()} thread(s), torch {torch.__version__}")
    print(f"{'running':>8} {'prefill all ms':>15} {'step median ms':>15} {'step min ms':>12}")
    for n in args.running:
        g = torch.Generator().manual_seed(args.seed)
        ids = []
        for i in range(n):
            length = int(torch.randint(64, 193, (1,), generator=g))
            prompt = torch.randint(0, engine.model_config.vocab_size, (length,), generator=g).tolist()
            ids.append(engine.add_request(prompt, params, request_id=f"step-{n}-{i}"))
        t0 = time.perf_counter()
        while any(engine.requests[r].num_output_tokens == 0 for r in ids):
            engine.step()
        prefill = time.perf_counter() - t0
        times = []
        if kernel_s is not None:
            kernel_s.clear()
        for _ in range(args.steps):
            t0 = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - t0)
        for r in ids:
            engine.abort_request(r)
        print(f"{n:>8} {prefill * 1e3:>15.0f} {statistics.median(times) * 1e3:>15.1f} {min(times) * 1e3:>12.1f}")
        if kernel_s is not None:
            per_step = {name: s / args.steps * 1e3 for name, s in kernel_s.items()}
            rest = sum(times) / args.steps * 1e3 - sum(per_step.values())
            print("         kernels, ms per step: " + ", ".join(f"{k} {v:.2f}" for k, v in
                                                          sorted(per_step.items(), key=lambda kv: -kv[1]))
                  + f"; the rest (torch ops, Python) {rest:.2f}")


def time_kernels() -> collections.Counter:
    """Wrap every CPU kernel op (torch.ops.moe_serve.*) in a timer; returns the seconds spent per op."""
    if not cpu_build.available():
        raise SystemExit(f"--kernels: the CPU kernels cannot run here: {cpu_build.unavailable_reason()}")
    spent = collections.Counter()
    ops = torch.ops.moe_serve
    for name in cpu_build.OPS:
        def timed(*args, _fn=getattr(ops, name), _name=name):
            t0 = time.perf_counter()
            out = _fn(*args)
            spent[_name] += time.perf_counter() - t0
            return out
        setattr(ops, name, timed)  # the wrappers look the op up on every call
    return spent

if __name__ == "__main__":
    main()
