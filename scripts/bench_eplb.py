"""Effect of expert replication in a serving run with skewed routing (not a test).

Run under torchrun with expert parallelism, e.g.
    .venv/bin/python -m torch.distributed.run --nproc-per-node 2 scripts/bench_eplb.py --redundant 4
Makes a checkpoint whose router strongly prefers a few experts (their e_score_correction_bias is
raised), generates a fixed request set with the default placement, rebalances from the recorded
load, and generates the same set again. Prints tokens per EP rank (max/mean over ranks, mean over
MoE layers) and output tokens/s before and after; rank 0 prints.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path


import torch  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

from moe_serve.moe.tiny import ensure_checkpoint  # noqa: E402
from moe_serve.server import LLM, SamplingParams  # noqa: E402


def skewed_checkpoint(base: Path, out: Path, hot: list[int], boost: float) -> Path:
    """A copy of `base` whose routers pick experts `hot` for most tokens (noaux_tc bias)."""
    if (out / "config.json").exists():
        return out
    out.mkdir(parents=True, exist_ok=True)
    for f in base.iterdir():
        if f.suffix == ".safetensors":
            tensors = load_file(f)
            for name, t in tensors.items():
                if name.endswith("e_score_correction_bias"):
                    t[hot] += boost
            save_file(tensors, out / f.name, metadata={"format": "pt"})
        else:
            (out / f.name).write_bytes(f.read_bytes())
    return out


def max_over_mean(load: dict) -> float:
    ranks_LG = torch.tensor(load["rank_tokens"], dtype=torch.float64)
    return (ranks_LG.max(1).values / ranks_LG.mean(1).clamp(min=1e-9)).mean().item()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="v3")
    ap.add_argument("--redundant", type=int, default=4)
    ap.add_argument("--hot", type=int, nargs="+", default=[3, 5])
    ap.add_argument("--boost", type=float, default=0.6)
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=32)
    args = ap.parse_args()
    base = ensure_checkpoint(Path(f".cache/{args.preset}"), args.preset)
    ckpt = skewed_checkpoint(base, Path(f".cache/{args.preset}-skewed"), args.hot, args.boost)
    world = int(__import__("os").environ.get("WORLD_SIZE", "1"))
    llm = LLM(str(ckpt), dtype="float32", data_parallel_size=world, enable_expert_parallel=world > 1,
              num_redundant_experts=args.redundant, eplb_window=10_000, enable_prefix_caching=False)
    rng = random.Random(0)
    vocab = llm.engine.model_config.vocab_size
    prompts = [[rng.randrange(3, vocab) for _ in range(rng.randint(8, 64))] for _ in range(args.requests)]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(max_tokens=2))  # warm-up
    rows = []
    for phase in ("default placement", "after rebalance"):
        if phase == "after rebalance":
            moved = llm.rebalance()
        rec = llm.engine.expert_load_recorder
        rec.start_record()
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params)
        seconds = time.perf_counter() - t0
        rec.stop_record()
        load = llm.expert_load("record")
        # every rank saw its own tokens; sum the per-rank loads over the EP group
        ep = llm.engine.parallel.ep
        ranks = torch.tensor(load["rank_tokens"], dtype=torch.float64)
        if ep.size > 1:
            from moe_serve.parallel import comm
            ranks = comm.all_reduce(ranks, ep)
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        rows.append({"phase": phase, "max_over_mean": max_over_mean({"rank_tokens": ranks.tolist()}),
                     "balancedness": (ranks.mean(1) / ranks.max(1).values).mean().item(),
                     "tokens_per_s": tokens / seconds, "rank_tokens_layer0": ranks[0].tolist()})
    if llm.engine.parallel.rank == 0:
        print(f"checkpoint {ckpt} (hot experts {args.hot}, bias +{args.boost}), EP {llm.engine.parallel.ep.size}, "
              f"{llm.engine.model_config.n_routed_experts} experts + {args.redundant} redundant slots, "
              f"{args.requests} requests x {args.max_tokens} tokens; slots moved by the rebalance: {moved}")
        print(f"{'phase':<18} {'max/mean tokens per EP rank':>28} {'balancedness':>13} {'tokens/s':>9}")
        for r in rows:
            print(f"{r['phase']:<18} {r['max_over_mean']:>28.3f} {r['balancedness']:>13.3f} {r['tokens_per_s']:>9.1f}")
        print(json.dumps(rows))


if __name__ == "__main__":
    main()
