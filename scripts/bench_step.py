"""Time of one engine step: `LLMEngine.step()` medians over decode steps with N requests running. Not a test.

    OMP_NUM_THREADS=1 .venv/bin/python scripts/bench_step.py --running 1 12 64

Builds the benchmark checkpoint if missing (.cache/bench), adds N requests of random 64-192 token prompts,
prefills them all, then times --steps decode steps and prints the median and minimum per N.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from moe.tiny import ensure_checkpoint  # noqa: E402
from server import LLM, SamplingParams  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=".cache/bench")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--running", type=int, nargs="+", default=[1, 12, 64])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--seed", type=int, default=7)
    args = ap.parse_args()
    if args.model == ".cache/bench":
        ensure_checkpoint(Path(args.model), "bench")
    llm = LLM(args.model, dtype=args.dtype, max_num_seqs=max(args.running), max_num_batched_tokens=2048,
              kv_cache_tokens=65536)
    engine = llm.engine
    params = SamplingParams(max_tokens=10_000, temperature=0.0, ignore_eos=True)
    print(f"{args.model} {args.dtype}, {torch.get_num_threads()} thread(s), torch {torch.__version__}")
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
        for _ in range(args.steps):
            t0 = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - t0)
        for r in ids:
            engine.abort_request(r)
        print(f"{n:>8} {prefill * 1e3:>15.0f} {statistics.median(times) * 1e3:>15.1f} {min(times) * 1e3:>12.1f}")


if __name__ == "__main__":
    main()
