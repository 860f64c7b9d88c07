"""Step time while the balancer re-plans and moves expert weights during serving, against normal steps. Not a test.

Run under torchrun with expert parallelism (every rank prints nothing; rank 0 prints the table):
    OMP_NUM_THREADS=1 .venv/bin/python -m torch.distributed.run --nproc-per-node 4 \
        scripts/bench_rebalance_stall.py --layers-per-step 1
    ... --layers-per-step 5        # every MoE layer's weights in one step (what a stop-the-world move costs)
    ... --plan-steps 0             # the planner on the step path

Serves a fixed request set on a checkpoint whose routers prefer a few experts (as scripts/bench_eplb.py) with
EPLB on: every `--interval` steps the rebalancer sums the window's load over the EP group (an all-reduce on
the step path) and plans, in a background thread while `--plan-steps` more steps run (0: on the step path),
then moves `--layers-per-step` MoE layers' changed slots after each following step (an all-to-all of their
weights). "plan" steps are those from the all-reduce to the plan taken. Every engine step is timed on each rank (the step, its
collectives and the rebalancer's work after it); a step of the job lasts as long as its slowest rank. Steps
with prompt chunks on any rank are reported apart; the decode-only ones are classed as plan, move or normal
steps, and rank 0 prints p50 / p99 / max per class and the ratio of the rebalancing steps' p99 to the normal
p99.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time
from pathlib import Path

import torch  # noqa: E402

from bench_eplb import skewed_checkpoint  # noqa: E402  (scripts/ is on sys.path when run as a script)
from moe_serve.moe.tiny import ensure_checkpoint  # noqa: E402
from moe_serve.parallel import comm  # noqa: E402
from moe_serve.server import LLM, SamplingParams  # noqa: E402


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="bench")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--redundant", type=int, default=4)
    ap.add_argument("--hot", type=int, nargs="+", default=[3, 5, 11])
    ap.add_argument("--boost", type=float, default=0.6)
    ap.add_argument("--requests", type=int, default=16, help="per DP rank")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--interval", type=int, default=25, help="steps between plans")
    ap.add_argument("--layers-per-step", type=int, default=1)
    ap.add_argument("--plan-steps", type=int, default=2, help="steps the planner runs in the background (0: on the step)")
    ap.add_argument("--out", default=None, help="rank 0 writes the step times and summary here (JSON)")
    args = ap.parse_args()
    base = ensure_checkpoint(Path(f".cache/{args.preset}"), args.preset)
    ckpt = skewed_checkpoint(base, Path(f".cache/{args.preset}-skewed"), args.hot, args.boost)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    eplb = {"window": args.interval, "interval": args.interval, "layers_per_step": args.layers_per_step,
            "min_gain": 0.0, "plan_steps": args.plan_steps}
    llm = LLM(str(ckpt), dtype=args.dtype, data_parallel_size=world, enable_expert_parallel=world > 1,
              enable_eplb=True, num_redundant_experts=args.redundant, enable_prefix_caching=False,
              eplb_window=eplb["window"], eplb_interval=eplb["interval"], eplb_layers_per_step=eplb["layers_per_step"],
              eplb_min_gain=eplb["min_gain"], eplb_plan_steps=eplb["plan_steps"])
    engine, rebalancer = llm.engine, llm.engine.rebalancer
    rng = random.Random(engine.parallel.rank)
    vocab = engine.model_config.vocab_size
    prompts = [[rng.randrange(3, vocab) for _ in range(rng.randint(32, 96))] for _ in range(args.requests)]
    llm.generate(prompts[:2], SamplingParams(max_tokens=2))  # warm-up

    steps: list[tuple[str, float]] = []
    real_step = engine.step

    def timed_step():
        plans, moved, pending = rebalancer.num_rebalances, rebalancer.slots_moved, len(rebalancer.pending)
        prefill = any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.requests.values())
        planning_before = rebalancer._planning is not None
        t0 = time.perf_counter()
        out = real_step()
        ms = (time.perf_counter() - t0) * 1e3
        if rebalancer.slots_moved > moved or len(rebalancer.pending) < pending:
            kind = "move"
        elif rebalancer.num_rebalances > plans or (planning_before or rebalancer._planning is not None) \
                or (rebalancer.steps % args.interval == 0 and not pending):
            kind = "plan"  # the load summed, planned or waited on, or running beside the step in the background
        else:
            kind = "normal"
        steps.append((kind, prefill, ms))
        return out

    engine.step = timed_step
    t0 = time.perf_counter()
    llm.generate(prompts, SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True))
    seconds = time.perf_counter() - t0
    engine.step = real_step

    # every rank's steps, gathered on rank 0. Ranks step together, so step i is one step of the whole job: it
    # holds prompt chunks if any rank's does, and lasts as long as its slowest rank.
    kinds = {"normal": 0, "plan": 1, "move": 2}
    mine = torch.tensor([[kinds[k], float(p), ms] for k, p, ms in steps], dtype=torch.float64)
    group = engine.parallel.ep
    if world > 1:
        counts = comm.all_gather(torch.tensor([float(len(steps))], dtype=torch.float64), group, dim=0)
        if len(set(counts.tolist())) != 1:
            raise SystemExit(f"ranks ran different numbers of steps: {counts.tolist()}")
        every = comm.all_gather(mine[None], group, dim=0)  # [ranks, steps, 3]
    else:
        every = mine[None]
    if engine.parallel.rank != 0:
        return
    kind_S, prefill_S, ms_S = every[..., 0].amax(0), every[..., 1].amax(0) > 0, every[..., 2].amax(0)
    by_kind = {"prefill": [ms for ms, p in zip(ms_S.tolist(), prefill_S.tolist()) if p]}
    for k, i in kinds.items():
        by_kind[k] = [ms for ms, p, c in zip(ms_S.tolist(), prefill_S.tolist(), kind_S.tolist()) if not p and int(c) == i]
    rows = {k: {"steps": len(v), "p50_ms": round(statistics.median(v), 1) if v else None,
                "p99_ms": round(percentile(v, 0.99), 1) if v else None, "max_ms": round(max(v), 1) if v else None}
            for k, v in by_kind.items()}
    rebalancing = by_kind["plan"] + by_kind["move"]
    ratio = percentile(rebalancing, 0.99) / percentile(by_kind["normal"], 0.99) if rebalancing else None
    cfg = engine.model_config
    print(f"{ckpt}: {cfg.n_routed_experts} experts + {args.redundant} redundant slots, "
          f"{len(rebalancer.layers)} MoE layers, EP {world} (gloo), dtype {args.dtype}, {args.requests} requests x "
          f"{args.max_tokens} tokens per rank, plan every {args.interval} steps, {args.layers_per_step} layer(s) "
          f"moved per step; {rebalancer.num_rebalances} plans moved {rebalancer.slots_moved} slots in {seconds:.1f} s")
    print(f"{'steps':<8} {'count':>6} {'p50 ms':>8} {'p99 ms':>8} {'max ms':>8}")
    for k, r in rows.items():
        print(f"{k:<8} {r['steps']:>6} {r['p50_ms'] or float('nan'):>8.1f} {r['p99_ms'] or float('nan'):>8.1f} "
              f"{r['max_ms'] or float('nan'):>8.1f}")
    print(f"decode-only steps: p99 of plan + move steps / p99 of normal steps: {ratio:.2f}" if ratio
          else "no rebalancing step ran")
    summary = {"config": vars(args), "rows": rows, "p99_ratio": ratio, "plans": rebalancer.num_rebalances,
               "slots_moved": rebalancer.slots_moved, "seconds": seconds}
    print(json.dumps(summary))
    if args.out:
        Path(args.out).write_text(json.dumps({**summary, "steps": every.tolist()}) + "\n")


if __name__ == "__main__":
    main()
