"""Dispatch volume of expert parallelism: each token once per destination rank vs once per expert.

Part 1 (analytic, no processes): a synthetic batch routed like DeepSeek-V3 (256 experts in 8 groups,
top-4 groups, top-8 experts, sigmoid + noaux_tc through experts.router.route with a random gate), and the
same batch with unrestricted top-8 for contrast; EP 8 and 32 with contiguous slots (slot s on rank
s // slots_per_rank), tokens spread evenly over the EP ranks; hidden 7168 in bf16. Bytes are what leaves
each rank for OTHER ranks (a token's copy to its own rank is local and not counted); combine sends the
same rows back, so its volume equals dispatch's.
Part 2 (measured): a real 4-rank gloo run at small scale; the bytes DispatchStats counts, summed over
ranks, must equal the same formula applied to that run's routing.

    .venv/bin/python scripts/bench_comm.py [--tokens 8192] [--skip-real]
Prints a markdown section (docs/benchmarks.md, "Dispatch volume (expert parallelism)").
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch


from moe_serve.experts.permute import dispatch_volume  # noqa: E402
from moe_serve.experts.router import RouterConfig, route  # noqa: E402

V3 = dict(num_experts=256, top_k=8, num_groups=8, topk_group=4, hidden=7168, elem=2)  # bf16
REAL = dict(num_experts=64, top_k=8, num_groups=8, topk_group=4, hidden=256, tokens=[48, 0, 64, 40], world=4)


def synthetic_routing(num_tokens: int, num_experts: int, top_k: int, num_groups: int, topk_group: int, seed: int = 0):
    """topk_ids_TK from experts.router.route on random activations and a random gate (routing depends only on
    the scores, so a 64-wide gate input stands in for 7168)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, 64, generator=g)
    gate = torch.randn(num_experts, 64, generator=g) / 8
    bias = torch.randn(num_experts, generator=g) * 0.01
    rc = RouterConfig(num_experts, top_k, "noaux_tc", "sigmoid", num_groups, topk_group, True, 2.5)
    return route(x, gate, rc, bias)[1]


def analytic_rows(num_tokens: int) -> list[str]:
    e, k, h, b = V3["num_experts"], V3["top_k"], V3["hidden"], V3["elem"]
    routings = {
        "V3 group-limited (8 groups, top-4 groups)": synthetic_routing(num_tokens, e, k, V3["num_groups"], V3["topk_group"]),
        "unrestricted top-8": synthetic_routing(num_tokens, e, k, 1, 1),
    }
    rows = ["| routing | EP | slots/rank | remote ranks / token (dedup) | remote experts / token (naive) | "
            "dedup MiB / layer (all ranks) | naive MiB / layer (all ranks) | naive / dedup |", "|---|---|---|---|---|---|---|---|"]
    for name, ids in routings.items():
        for ep in (8, 32):
            spr = e // ep
            src = torch.arange(num_tokens) * ep // num_tokens  # even split over the EP ranks
            v = dispatch_volume(ids, src, spr, ep)
            dedup, naive = v["dedup_remote_rows"], v["naive_remote_rows"]
            rows.append(f"| {name} | {ep} | {spr} | {dedup / num_tokens:.2f} | {naive / num_tokens:.2f} | "
                        f"{dedup * h * b / 2**20:,.1f} | {naive * h * b / 2**20:,.1f} | {naive / dedup:.2f}x |")
    return rows


def _real_worker(out_dir: str) -> None:
    from moe_serve.experts.dispatch import combine, dispatch
    from moe_serve.parallel.config import ParallelConfig
    from moe_serve.parallel.state import init_parallel, shutdown

    W, H = REAL["world"], REAL["hidden"]
    state = init_parallel(ParallelConfig(data_parallel_size=W, enable_expert_parallel=True, collective_timeout_s=60))
    ids = synthetic_routing(sum(REAL["tokens"]), REAL["num_experts"], REAL["top_k"], REAL["num_groups"], REAL["topk_group"], seed=1)
    start = sum(REAL["tokens"][: state.rank])
    mine = slice(start, start + REAL["tokens"][state.rank])
    x = torch.randn(REAL["tokens"][state.rank], H).to(torch.bfloat16)
    recv_x, recv_ids, recv_w, handle = dispatch(x, ids[mine], torch.rand(len(x), REAL["top_k"]), REAL["num_experts"] // W, state.ep)
    out = combine(recv_x * (recv_ids >= 0).sum(1, keepdim=True), handle, state.ep)  # sum of copies = K x (up to rounding)
    ok = bool(torch.allclose(out.float(), x.float() * (ids[mine] >= 0).sum(1, keepdim=True), rtol=1e-2))
    (Path(out_dir) / f"rank{state.rank}.json").write_text(json.dumps(vars(handle.stats) | {"roundtrip_ok": ok}))
    shutdown(state)


def real_run() -> list[str]:
    from moe_serve.parallel.launch import spawn_ranks

    W, H = REAL["world"], REAL["hidden"]
    with tempfile.TemporaryDirectory() as d:
        codes = spawn_ranks(_real_worker, W, args=(d,), timeout_s=120, log_dir=d)
        if codes != [0] * W:
            raise SystemExit(f"real run failed, exit codes {codes}:\n" + (Path(d) / "rank0.log").read_text()[-3000:])
        stats = [json.loads((Path(d) / f"rank{r}.json").read_text()) for r in range(W)]
    ids = synthetic_routing(sum(REAL["tokens"]), REAL["num_experts"], REAL["top_k"], REAL["num_groups"], REAL["topk_group"], seed=1)
    src = torch.repeat_interleave(torch.arange(W), torch.tensor(REAL["tokens"]))
    v = dispatch_volume(ids, src, REAL["num_experts"] // W, W)
    measured = {k: sum(s[k] for s in stats) for k in ("bytes_sent", "naive_bytes_sent", "combine_bytes_sent", "meta_bytes_sent")}
    formula, formula_naive = v["dedup_remote_rows"] * H * 2, v["naive_remote_rows"] * H * 2
    match = measured["bytes_sent"] == formula == measured["combine_bytes_sent"] and measured["naive_bytes_sent"] == formula_naive
    if not match or not all(s["roundtrip_ok"] for s in stats):
        raise SystemExit(f"measured {measured} != formula {formula} / naive {formula_naive}, or combine wrong")
    return [
        f"Real gloo run, {W} ranks, {REAL['num_experts']} experts ({REAL['num_experts'] // W} per rank), top-{REAL['top_k']} "
        f"group-limited, hidden {H} bf16, tokens per rank {REAL['tokens']}: measured dispatch bytes (sum over ranks) "
        f"{measured['bytes_sent']:,} = formula {formula:,}; naive {measured['naive_bytes_sent']:,} = formula {formula_naive:,}; "
        f"combine sends back {measured['combine_bytes_sent']:,}; ids + weights + counts {measured['meta_bytes_sent']:,} bytes.",
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=8192, help="tokens in the synthetic batch (all EP ranks together)")
    ap.add_argument("--skip-real", action="store_true", help="only the analytic part")
    args = ap.parse_args()
    lines = [
        f"Synthetic batch of {args.tokens} tokens (spread evenly over the EP ranks), 256 experts, top-8, hidden 7168, "
        f"bf16; per MoE layer, dispatch only (combine sends the same rows back). Bytes count rows sent to other "
        f"ranks; a token's copy to its own rank is local and not counted. ids + weights add 64 bytes per row (0.4%).",
        "",
        *analytic_rows(args.tokens),
    ]
    if not args.skip_real:
        lines += ["", *real_run()]
    print("\n".join(lines))


if __name__ == "__main__":
    main()
