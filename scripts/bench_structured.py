"""The cost of constrained decoding: decode step time with 0%, 50% and 100% of a batch of 32 constrained.

    .venv/bin/python scripts/bench_structured.py --batch 32 --steps 20 --repeats 3

Constrained requests follow a JSON schema (an object with one string of up to 400 characters, so none ends
inside the timed steps); the others are free. All are prefilled before timing (16-token prompts), sample with
temperature 1 and a seed, and the median engine step over `--steps` decode steps is reported per share,
repeats alternating the shares. Model: the bench-shaped checkpoint (`moe make-checkpoint --preset bench`,
bf16), made in .cache/bench if missing. The grammar masks are filled in a worker thread while the forward
pass runs (server/core/runner.py), so only what is left of that after the forward, and the masking itself,
adds to the step.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from moe_serve.moe.tiny import ensure_checkpoint
from moe_serve.server import LLM, SamplingParams

REPO = Path(__file__).resolve().parents[1]
SCHEMA = {"type": "object", "properties": {"text": {"type": "string", "maxLength": 400}}, "required": ["text"]}


def median_step_ms(llm: LLM, batch: int, constrained: int, steps: int) -> float:
    engine = llm.engine
    vocab = engine.model_config.vocab_size
    ids = []
    for r in range(batch):
        params = SamplingParams(max_tokens=steps + 64, temperature=1.0, seed=r, ignore_eos=r >= constrained,
                                structured_output={"json": SCHEMA} if r < constrained else None)
        ids.append(engine.add_request([(13 * r + 5 * i) % (vocab - 8) + 8 for i in range(16)], params))
    while any(not engine.requests[rid].output_token_ids for rid in ids):
        engine.step()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        engine.step()
        times.append((time.perf_counter() - t0) * 1e3)
    for rid in ids:
        engine.abort_request(rid)
    return statistics.median(times)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(REPO / ".cache" / "bench"))
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    ensure_checkpoint(args.model, "bench")
    llm = LLM(args.model, max_num_seqs=args.batch, enable_prefix_caching=False)
    shares = [0, args.batch // 2, args.batch]
    median_step_ms(llm, args.batch, args.batch, 3)  # warm-up: compiles the grammar, starts the mask worker
    runs = {s: [] for s in shares}
    for rep in range(args.repeats):
        for s in (shares if rep % 2 == 0 else shares[::-1]):
            runs[s].append(median_step_ms(llm, args.batch, s, args.steps))
    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs, threads {torch.get_num_threads()}, batch {args.batch}, "
          f"{args.steps} decode steps x {args.repeats} repeats (median step of each; median and range of repeats)")
    print("| constrained | step (ms) | range | vs unconstrained |")
    print("|---|---|---|---|")
    base = statistics.median(runs[0])
    for s in shares:
        m = statistics.median(runs[s])
        print(f"| {s} of {args.batch} | {m:.1f} | {min(runs[s]):.1f}-{max(runs[s]):.1f} | {m / base:.3f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
