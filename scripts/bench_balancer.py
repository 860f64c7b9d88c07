"""Benchmark the expert balancer against DeepSeek's EPLB on synthetic DeepSeek-V3-scale loads.

    .venv/bin/python scripts/bench_balancer.py            # the full table (a few minutes on 2 CPU cores)
    .venv/bin/python scripts/bench_balancer.py --quick    # 8 layers, 3 windows: a smoke run

Each load is a series of windows of per-expert token counts, [W, L, E]: expected shares per layer that
drift between windows (log-normal steps) and Poisson sampling of 8192 tokens x 8 experts per window.
For every window we plan with EPLB's hierarchical and global policies and with ours from scratch (balance
alone: ours with num_nodes 1; scripts/bench_node_placement.py compares the node-aware plans); EPLB is
DeepSeek's, imported from vLLM's installed package or a checkout given with --eplb (scripts/eplb_peer.py;
the run prints which); "ours + previous" re-plans each window from the plan in service (chained from window
0), and "EPLB moved" is what EPLB's own choice of policy reloads from one window to the next.
Balancedness of a plan = mean over layers of mean GPU load / max GPU load; cells show mean / worst layer.
Checks per row, on every window: ours fresh >= max(EPLB hierarchical, EPLB global); ours + previous
within 0.02 of that while reloading at most 1/3 of the slots. Times are CPU time per call, single-threaded
(wall time on an idle machine; the shared machine's wall times are printed at the end, best of 7).
"""

import argparse
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass

import torch

from eplb_peer import Eplb, load_eplb
from moe_serve.balancer import balancedness, moved_slots, rebalance_experts, validate_plan

TOKENS_PER_WINDOW = 8192 * 8  # tokens x top-k routed per layer per window
MAX_MOVED = 1 / 3
MAX_GAP = 0.02


@dataclass(frozen=True)
class Deployment:
    name: str
    num_replicas: int
    num_gpus: int
    num_nodes: int
    num_experts: int
    num_groups: int = 8


DEPLOYMENTS = [
    Deployment("288 slots, 32 GPUs, 4 nodes", 288, 32, 4, 256),
    Deployment("320 slots, 64 GPUs, 8 nodes", 320, 64, 8, 256),
    Deployment("80 slots, 8 GPUs, 1 node, E=64", 80, 8, 1, 64),
    Deployment("256 slots, 32 GPUs, 4 nodes (R=E)", 256, 32, 4, 256),
]

# name -> (base shares, drift sigma per window)
LOADS = {
    "uniform": ("uniform", 0.1),
    "zipf s=1": ("zipf1", 0.1),
    "zipf s=1.4": ("zipf1.4", 0.1),
    "hot experts": ("hot", 0.1),
    "zipf, strong drift": ("zipf1", 0.3),
}


def base_shares(kind: str, num_layers: int, num_experts: int, gen: torch.Generator) -> torch.Tensor:
    """[L, E] expected share of each expert's load; every layer has its own random ranking."""
    if kind == "uniform":
        shares = torch.ones(num_layers, num_experts, dtype=torch.float64)
    elif kind.startswith("zipf"):
        ranks = torch.arange(1, num_experts + 1, dtype=torch.float64) ** -float(kind[4:])
        shares = torch.stack([ranks[torch.randperm(num_experts, generator=gen)] for _ in range(num_layers)])
    elif kind == "hot":  # three experts with 10%, 7% and 5% of the layer's tokens, the rest even
        shares = torch.full((num_layers, num_experts), 0.78 / (num_experts - 3), dtype=torch.float64)
        for layer in range(num_layers):
            hot = torch.randperm(num_experts, generator=gen)[:3]
            shares[layer, hot] = torch.tensor([0.10, 0.07, 0.05], dtype=torch.float64)
    else:
        raise ValueError(f"unknown load kind {kind!r}")
    return shares / shares.sum(1, keepdim=True)


def make_windows(kind: str, sigma: float, num_windows: int, num_layers: int, num_experts: int, seed: int
                 ) -> torch.Tensor:
    """[W, L, E] token counts per expert, the shares drifting by a log-normal step of `sigma` per window."""
    gen = torch.Generator().manual_seed(seed)
    shares = base_shares(kind, num_layers, num_experts, gen)
    windows = []
    for _ in range(num_windows):
        windows.append(torch.poisson(shares * TOKENS_PER_WINDOW, generator=gen))
        shares = shares * torch.exp(sigma * torch.randn(shares.shape, generator=gen, dtype=torch.float64))
        shares = shares / shares.sum(1, keepdim=True)
    return torch.stack(windows)


def plan(fn, *args, **kwargs):
    """fn's plan and the CPU time it took (single-threaded, so wall time on an idle machine)."""
    start = time.process_time()
    phy2log, log2phy, logcnt = fn(*args, **kwargs)
    return phy2log, log2phy, logcnt, time.process_time() - start


def run_row(dep: Deployment, windows_WLE: torch.Tensor, eplb: Eplb) -> dict:
    args = (dep.num_replicas, dep.num_groups, dep.num_nodes, dep.num_gpus)
    ours_args = (dep.num_replicas, dep.num_groups, 1, dep.num_gpus)  # balance alone (nodes: bench_node_placement.py)
    bal = {k: [] for k in ("hier", "global", "fresh", "prev")}
    worst = {k: 1.0 for k in bal}
    moved_prev, moved_eplb, t_fresh, t_prev, t_eplb = [], [], [], [], []
    ok_fresh = ok_prev = True
    in_service = eplb_in_service = None
    for weight_LE in windows_WLE:
        results = {}
        for key, policy in (("hier", "hierarchical"), ("global", "global")):
            start = time.process_time()
            results[key] = eplb.plan(weight_LE, *args, policy=policy)
            t_eplb.append(time.process_time() - start)
        eplb_auto = results["hier" if dep.num_groups % dep.num_nodes == 0 else "global"]
        phy2log, log2phy, logcnt, dt = plan(rebalance_experts, weight_LE, *ours_args)
        validate_plan(phy2log, log2phy, logcnt, dep.num_experts)
        results["fresh"] = phy2log
        t_fresh.append(dt)
        if in_service is None:
            in_service = phy2log
        else:
            phy2log, log2phy, logcnt, dt = plan(rebalance_experts, weight_LE, *ours_args, previous=in_service)
            validate_plan(phy2log, log2phy, logcnt, dep.num_experts)
            moved_prev.append(moved_slots(in_service, phy2log) / phy2log.numel())
            moved_eplb.append(moved_slots(eplb_in_service, eplb_auto) / phy2log.numel())
            results["prev"] = in_service = phy2log
            t_prev.append(dt)
        eplb_in_service = eplb_auto
        per_layer = {k: balancedness(weight_LE, p, dep.num_gpus) for k, p in results.items()}
        for k, b in per_layer.items():
            bal[k].append(b.mean().item())
            worst[k] = min(worst[k], b.min().item())
        best_eplb = max(bal["hier"][-1], bal["global"][-1])
        ok_fresh &= bal["fresh"][-1] >= best_eplb - 1e-9
        if "prev" in per_layer:
            ok_prev &= bal["prev"][-1] >= best_eplb - MAX_GAP and moved_prev[-1] <= MAX_MOVED
    return dict(bal={k: statistics.mean(v) for k, v in bal.items()}, worst=worst, ok_fresh=ok_fresh,
                ok_prev=ok_prev, moved_prev=(statistics.mean(moved_prev), max(moved_prev)),
                moved_eplb=statistics.mean(moved_eplb), t_fresh=statistics.median(t_fresh),
                t_prev=statistics.median(t_prev), t_eplb=statistics.median(t_eplb))


def print_timing(num_layers: int, repeats: int = 7) -> None:
    """Wall time of one call, best and median of `repeats` (the best is the least disturbed by other work),
    and the best CPU time (what the call itself used, whatever else the machine runs)."""
    for dep in DEPLOYMENTS[:3]:
        args = (dep.num_replicas, dep.num_groups, 1, dep.num_gpus)
        windows_WLE = make_windows("zipf1", 0.1, 2, num_layers, dep.num_experts, seed=1)
        in_service = rebalance_experts(windows_WLE[0], *args)[0]
        cells = []
        for label, kwargs in (("fresh", {}), ("with previous", {"previous": in_service})):
            wall, cpu = [], []
            for _ in range(repeats):
                wall_start = time.perf_counter()
                cpu.append(plan(rebalance_experts, windows_WLE[1], *args, **kwargs)[3])
                wall.append(time.perf_counter() - wall_start)
            wall.sort()
            cells.append(f"{label} {wall[0] * 1e3:.0f} ms (median {wall[repeats // 2] * 1e3:.0f}, "
                         f"CPU {min(cpu) * 1e3:.0f})")
        print(f"time per call, {num_layers} x {dep.num_experts} on {dep.name}: {', '.join(cells)}")
    print()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=58)
    parser.add_argument("--windows", type=int, default=5, help="windows per load (the first is planned fresh)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="8 layers, 3 windows")
    parser.add_argument("--eplb", metavar="PATH", help="a checkout of deepseek-ai/EPLB (default: vLLM's package)")
    parser.add_argument("--vllm-venv", help="the vLLM venv to import EPLB from (default: .cache/vllm-venv)")
    opts = parser.parse_args()
    eplb = load_eplb(opts.eplb, opts.vllm_venv)
    if opts.quick:
        opts.layers, opts.windows = 8, 3
    torch.set_num_threads(1)  # as rebalance_experts does internally; many small ops gain nothing from threads
    print(f"python {platform.python_version()}, torch {torch.__version__}, {os.cpu_count()} CPUs, "
          f"load average {os.getloadavg()[0]:.1f}, {opts.layers} layers, {opts.windows} windows, seed {opts.seed}")
    print(f"EPLB: {eplb.source}")
    print()
    print("| deployment | load | EPLB hierarchical | EPLB global | ours (fresh) | ours + previous "
          "| moved: ours + previous | moved: EPLB | CPU per call: ours fresh / + previous / EPLB | targets |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    all_ok = True
    for d, dep in enumerate(DEPLOYMENTS):
        for l, (load, (kind, sigma)) in enumerate(LOADS.items()):
            windows_WLE = make_windows(kind, sigma, opts.windows, opts.layers, dep.num_experts,
                                       seed=opts.seed * 1000 + d * 10 + l)
            r = run_row(dep, windows_WLE, eplb)
            cell = {k: f"{r['bal'][k]:.4f} / {r['worst'][k]:.4f}" for k in r["bal"]}
            ok = r["ok_fresh"] and r["ok_prev"]
            all_ok &= ok
            verdict = "met" if ok else ("MISSED: fresh < EPLB" if not r["ok_fresh"] else "MISSED: previous")
            print(f"| {dep.name} | {load} | {cell['hier']} | {cell['global']} | {cell['fresh']} | {cell['prev']} "
                  f"| {r['moved_prev'][0]:.1%} (max {r['moved_prev'][1]:.1%}) | {r['moved_eplb']:.1%} "
                  f"| {r['t_fresh'] * 1e3:.0f} / {r['t_prev'] * 1e3:.0f} / {r['t_eplb'] * 1e3:.0f} ms | {verdict} |",
                  flush=True)
    print()
    print_timing(opts.layers)
    print("all targets met" if all_ok else "SOME TARGETS MISSED")
    sys.exit(0 if all_ok else 1)


if __name__ == "__main__":
    main()
