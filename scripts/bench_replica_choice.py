"""Per-batch balancedness of the EP ranks: each token's replica chosen from the batch's load (ReplicaChooser)
against the even split over an expert's replicas (logical_to_physical), on synthetic DeepSeek-V3-scale batches.

    .venv/bin/python scripts/bench_replica_choice.py --batches 20

Placement: 256 experts in 288 slots over 32 EP ranks, planned by balancer.rebalance_experts from the expected
shares (Zipf s over a random ranking, per layer). Batches of 64, 512 and 8192 tokens draw top-8 experts per
token from those shares. Balancedness of a batch = mean / max tokens per rank; mean and 10th percentile over
--batches batches x --layers layers.
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch

from moe_serve.balancer import ReplicaChooser, build_log2phy, logical_to_physical, rebalance_experts


def batch_balance(slots_N: torch.Tensor, per_rank: int, ranks: int) -> float:
    load = (slots_N // per_rank).bincount(minlength=ranks).double()
    return (load.mean() / load.max()).item()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, default=20)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--zipf", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    E, R, G, K = 256, 288, 32, 8
    gen = torch.Generator().manual_seed(args.seed)
    ranks_by_share = torch.arange(1, E + 1, dtype=torch.float64) ** -args.zipf
    shares_LE = torch.stack([ranks_by_share[torch.randperm(E, generator=gen)] for _ in range(args.layers)])
    phy2log_LR, _, _ = rebalance_experts(shares_LE * 1e6, R, 8, 1, G)  # balance alone, as the figures were taken
    log2phy_LEX, logcnt_LE = build_log2phy(phy2log_LR, E)
    print(f"{E} experts, {R} slots, {G} EP ranks, top-{K}, Zipf s={args.zipf}; {args.batches} batches x "
          f"{args.layers} layers per size")
    print("| tokens per batch | even split: mean / p10 | per-batch choice: mean / p10 |")
    print("|---|---|---|")
    for tokens in (64, 512, 8192):
        even, chosen = [], []
        for layer in range(args.layers):
            chooser = ReplicaChooser(log2phy_LEX[layer], logcnt_LE[layer], G)
            for _ in range(args.batches):
                ids = torch.multinomial(shares_LE[layer].expand(tokens, -1), K, generator=gen)
                even.append(batch_balance(logical_to_physical(ids, log2phy_LEX[layer], logcnt_LE[layer]).flatten(),
                                          R // G, G))
                chosen.append(batch_balance(chooser(ids).flatten(), R // G, G))
        p10 = lambda v: sorted(v)[len(v) // 10]  # noqa: E731
        print(f"| {tokens} | {statistics.mean(even):.3f} / {p10(even):.3f} | "
              f"{statistics.mean(chosen):.3f} / {p10(chosen):.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
