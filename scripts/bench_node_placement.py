"""Node-aware expert placement against DeepSeek's EPLB: cross-node dispatch per token and balancedness.

    .venv/bin/python scripts/bench_node_placement.py            # 58 layers, 3 windows per load (minutes)
    .venv/bin/python scripts/bench_node_placement.py --quick    # 6 layers, 2 windows: a smoke run
    .venv/bin/python scripts/bench_node_placement.py --rows 4,6 # only those table rows (0-based)

Loads are DeepSeek-V3-shaped: 256 experts in 8 groups of 32, and each token routed as V3 routes
(group-limited: the 4 groups with the best sum of their top-2 expert scores, then the top 8 experts
among them), with expert scores drawn as log(share) + Gumbel noise, the shares per layer as in
scripts/bench_balancer.py (uniform, Zipf 1 and 1.4 over a random ranking, three hot experts; drifting
between windows). Each window routes 8192 tokens to plan from (their per-expert counts, and for
"ours + coact" their co-activation counts) and 4096 fresh tokens to measure on, each token on node
t % N (tokens come evenly from every node).

Per plan: balancedness (mean GPU load / max GPU load, mean over layers) and remote nodes per token (the
distinct nodes other than its own that a token's 8 experts take it to: one cross-node row each; times
7168 x 2 bytes for V3's bf16 hidden state). EPLB's plans are measured with replicas chosen evenly (how
EPLB is meant to be served) and, for the global policy, also with the node-local rule (a replica on the
token's own node if there is one; balancer/locality.py); ours with the node-local rule, which the
serving engine uses when the EP group spans nodes. Target per row: ours reaches at most EPLB
hierarchical's remote nodes per token at a balancedness no worse than EPLB global's (even split) - 0.01.
"""

import argparse
import os
import platform
import statistics
import sys

import torch

from bench_balancer import base_shares
from eplb_peer import load_eplb
from moe_serve.balancer import balancedness, rebalance_experts, validate_plan
from moe_serve.balancer.locality import (coactivation, node_local_balancedness, remote_nodes_per_token,
                                         sample_routed_tokens)

NUM_EXPERTS, NUM_GROUPS, TOPK_GROUP, TOPK = 256, 8, 4, 8
PLAN_TOKENS, EVAL_TOKENS = 8192, 4096
HIDDEN_BYTES = 7168 * 2

DEPLOYMENTS = [("288 slots, 32 GPUs, 4 nodes", 288, 32, 4), ("320 slots, 64 GPUs, 8 nodes", 320, 64, 8),
               ("256 slots, 32 GPUs, 4 nodes (R=E)", 256, 32, 4)]
LOADS = {"uniform": ("uniform", 0.1), "zipf s=1": ("zipf1", 0.1), "zipf s=1.4": ("zipf1.4", 0.1),
         "hot experts": ("hot", 0.1)}


def windows(kind: str, sigma: float, num_windows: int, num_layers: int, seed: int):
    """Per window: (plan tokens [L] of topk_ids, eval tokens [L] of topk_ids), the shares drifting."""
    gen = torch.Generator().manual_seed(seed)
    shares_LE = base_shares(kind, num_layers, NUM_EXPERTS, gen)
    for _ in range(num_windows):
        yield tuple([sample_routed_tokens(s, n, TOPK, NUM_GROUPS, TOPK_GROUP, gen) for s in shares_LE]
                    for n in (PLAN_TOKENS, EVAL_TOKENS))
        shares_LE = shares_LE * torch.exp(sigma * torch.randn(shares_LE.shape, generator=gen, dtype=torch.float64))
        shares_LE = shares_LE / shares_LE.sum(1, keepdim=True)


def remote_per_token(phy2log_LR, eval_tokens, num_gpus, num_nodes, node_local: bool) -> float:
    src_T = torch.arange(EVAL_TOKENS) % num_nodes
    return statistics.mean(remote_nodes_per_token(ids_TK, src_T, phy2log_R, num_gpus, num_nodes, node_local)
                           .double().mean().item() for ids_TK, phy2log_R in zip(eval_tokens, phy2log_LR))


def run_row(dep, kind, sigma, num_windows, num_layers, seed, eplb) -> dict:
    _, num_slots, num_gpus, num_nodes = dep
    sums: dict[str, list[float]] = {}

    def add(key, value):
        sums.setdefault(key, []).append(value)

    for plan_tokens, eval_tokens in windows(kind, sigma, num_windows, num_layers, seed):
        weight_LE = torch.stack([torch.bincount(t.flatten(), minlength=NUM_EXPERTS) for t in plan_tokens]).double()
        coact_LEE = torch.stack([coactivation(t, NUM_EXPERTS) for t in plan_tokens]).double()
        args = (num_slots, NUM_GROUPS, num_nodes, num_gpus)
        hier = eplb.plan(weight_LE, *args, policy="hierarchical")
        glob = eplb.plan(weight_LE, *args, policy="global")
        routing = {"topk": TOPK, "topk_group": TOPK_GROUP}
        ours = rebalance_experts(weight_LE, *args, **routing)
        ours_co = rebalance_experts(weight_LE, *args, coactivation=coact_LEE, **routing)
        for plan in (ours, ours_co):
            validate_plan(*plan, NUM_EXPERTS)
        add("hier bal", balancedness(weight_LE, hier, num_gpus).mean().item())
        add("global bal", balancedness(weight_LE, glob, num_gpus).mean().item())
        add("global local bal", node_local_balancedness(weight_LE, glob, num_gpus, num_nodes).mean().item())
        add("ours bal", node_local_balancedness(weight_LE, ours[0], num_gpus, num_nodes).mean().item())
        add("ours co bal", node_local_balancedness(weight_LE, ours_co[0], num_gpus, num_nodes).mean().item())
        add("hier remote", remote_per_token(hier, eval_tokens, num_gpus, num_nodes, False))
        add("global remote", remote_per_token(glob, eval_tokens, num_gpus, num_nodes, False))
        add("global local remote", remote_per_token(glob, eval_tokens, num_gpus, num_nodes, True))
        add("ours remote", remote_per_token(ours[0], eval_tokens, num_gpus, num_nodes, True))
        add("ours co remote", remote_per_token(ours_co[0], eval_tokens, num_gpus, num_nodes, True))
    return {k: statistics.mean(v) for k, v in sums.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=58)
    parser.add_argument("--windows", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="6 layers, 2 windows")
    parser.add_argument("--rows", help="only these table rows, 0-based and comma-separated (0-11: deployment x load "
                                       "in table order), e.g. 4,6 for the 8-node uniform and Zipf 1.4 rows")
    parser.add_argument("--eplb", metavar="PATH", help="a checkout of deepseek-ai/EPLB (default: vLLM's package)")
    parser.add_argument("--vllm-venv", help="the vLLM venv to import EPLB from (default: .cache/vllm-venv)")
    opts = parser.parse_args()
    if opts.quick:
        opts.layers, opts.windows = 6, 2
    eplb = load_eplb(opts.eplb, opts.vllm_venv)
    torch.set_num_threads(1)
    print(f"python {platform.python_version()}, torch {torch.__version__}, {os.cpu_count()} CPUs, {opts.layers} layers, "
          f"{opts.windows} windows, seed {opts.seed}; EPLB: {eplb.source}")
    print()
    print("| deployment | load | balancedness: EPLB hier / EPLB global / ours / ours + coact "
          "| remote nodes per token: EPLB hier / EPLB global / EPLB global, node-local / ours / ours + coact "
          "| cross-node KB per token: EPLB hier / ours | target |")
    print("|---|---|---|---|---|---|")
    all_ok = True
    rows = None if opts.rows is None else {int(r) for r in opts.rows.split(",")}
    for d, dep in enumerate(DEPLOYMENTS):
        for i, (load, (kind, sigma)) in enumerate(LOADS.items()):
            if rows is not None and d * len(LOADS) + i not in rows:
                continue
            r = run_row(dep, kind, sigma, opts.windows, opts.layers, opts.seed * 1000 + d * 10 + i, eplb)
            ok = r["ours remote"] <= r["hier remote"] + 1e-9 and r["ours bal"] >= r["global bal"] - 0.01
            all_ok &= ok
            print(f"| {dep[0]} | {load} | {r['hier bal']:.4f} / {r['global bal']:.4f} / {r['ours bal']:.4f} / "
                  f"{r['ours co bal']:.4f} | {r['hier remote']:.3f} / {r['global remote']:.3f} / "
                  f"{r['global local remote']:.3f} / {r['ours remote']:.3f} / {r['ours co remote']:.3f} | "
                  f"{r['hier remote'] * HIDDEN_BYTES / 1024:.1f} / {r['ours remote'] * HIDDEN_BYTES / 1024:.1f} | "
                  f"{'met' if ok else 'MISSED'} |", flush=True)
    print()
    print("all targets met" if all_ok else "SOME TARGETS MISSED")
    sys.exit(0 if all_ok else 1)


if __name__ == "__main__":
    main()
