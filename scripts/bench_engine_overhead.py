"""Engine overhead per decode step: the time a step spends outside the model's forward pass.

    .venv/bin/python scripts/bench_engine_overhead.py --running 1 64 256 --steps 30

With `--running N` requests all decoding (short prompts, prefilled before timing starts, `ignore_eos`), each
timed step is split into phases by wrapping the engine's own functions: schedule (the scheduler), prepare
(the runner's flat batch and paged-cache metadata), forward (the model and its logits: excluded from the
overhead), sample (the sampler), update (tokens recorded, stop checks, outputs). Overhead = step - forward.
Medians over the timed steps, with the 10th-90th percentile spread. One torch thread, the tiny random
checkpoint (preset v3, made in .cache/tiny-v3 if missing): the forward is small, the overhead is not.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

from moe_serve.moe.tiny import ensure_checkpoint
from moe_serve.server import LLM, SamplingParams
from moe_serve.server.core import runner as runner_module

REPO = Path(__file__).resolve().parents[1]
PHASES = ("schedule", "prepare", "forward", "sample", "update")


class PhaseClock:
    """Wall seconds per phase of the current step, filled by wrappers around the engine's functions."""

    def __init__(self):
        self.now: dict[str, float] = defaultdict(float)

    def wrap(self, phase: str, fn):
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.now[phase] += time.perf_counter() - t0
        return timed

    def take(self) -> dict[str, float]:
        got, self.now = dict(self.now), defaultdict(float)
        return got


def instrument(core, clock: PhaseClock) -> None:
    core.scheduler.schedule = clock.wrap("schedule", core.scheduler.schedule)
    core.runner._prepare = clock.wrap("prepare", core.runner._prepare)
    model = core.runner.model
    model.forward = clock.wrap("forward", model.forward)
    model.compute_logits = clock.wrap("forward", model.compute_logits)
    runner_module.sample = clock.wrap("sample", runner_module.sample)
    core._update = clock.wrap("update", core._update)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def run(llm: LLM, clock: PhaseClock, running: int, steps: int, prompt_len: int) -> dict:
    engine = llm.engine
    params = SamplingParams(max_tokens=steps + 4 * running + 8, temperature=0.0, ignore_eos=True)
    vocab = engine.model_config.vocab_size
    ids = [engine.add_request([(7 * r + 3 * i) % (vocab - 8) + 8 for i in range(prompt_len)], params)
           for r in range(running)]
    while any(not engine.requests[rid].output_token_ids for rid in ids):  # prefill everyone first
        engine.step()
    clock.take()
    rows = []
    for _ in range(steps):
        t0 = time.perf_counter()
        engine.step()
        total = time.perf_counter() - t0
        phases = clock.take()
        rows.append({"step": total, **{p: phases.get(p, 0.0) for p in PHASES}})
    for rid in ids:
        engine.abort_request(rid)
    out = {"running": running}
    for key in ("step", *PHASES, "overhead"):
        vals = [r["step"] - r["forward"] if key == "overhead" else r[key] for r in rows]
        out[key] = {"median_ms": statistics.median(vals) * 1e3, "p10_ms": percentile(vals, 0.1) * 1e3,
                    "p90_ms": percentile(vals, 0.9) * 1e3}
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--running", type=int, nargs="+", default=[1, 64, 256])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--prompt-len", type=int, default=8)
    ap.add_argument("--model", default=str(REPO / ".cache" / "tiny-v3"))
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args()
    torch.set_num_threads(1)
    ensure_checkpoint(args.model, "v3")
    most = max(args.running)
    llm = LLM(args.model, dtype="float32", max_num_seqs=most, max_num_batched_tokens=max(2048, most * args.prompt_len),
              kv_cache_tokens=most * (args.prompt_len + args.steps + 4 * most + 16) + 1024,
              enable_prefix_caching=False)
    clock = PhaseClock()
    instrument(llm.engine, clock)
    results = [run(llm, clock, n, args.steps, args.prompt_len) for n in args.running]
    print(f"python {platform.python_version()}, torch {torch.__version__}, 1 thread, {args.steps} steps each")
    print("| running | step (ms) | forward | overhead | schedule | prepare | sample | update |")
    print("|---|---|---|---|---|---|---|---|")
    for r in results:
        cell = {k: f"{r[k]['median_ms']:.2f}" for k in ("step", *PHASES, "overhead")}
        spread = f" ({r['overhead']['p10_ms']:.2f}-{r['overhead']['p90_ms']:.2f})"
        print(f"| {r['running']} | {cell['step']} | {cell['forward']} | **{cell['overhead']}**{spread} | "
              f"{cell['schedule']} | {cell['prepare']} | {cell['sample']} | {cell['update']} |")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
