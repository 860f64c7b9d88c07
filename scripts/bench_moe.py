"""CPU benchmark: kernels.fused_moe (torch path) vs transformers' DeepseekV3MoE, same weights, same routing.

Both sides compute the whole MoE block: transformers' gate routes, the routed experts run (its per-expert
loop vs our sort + grouped GEMM), and the shared expert is added. The outputs are compared, then each
side is timed, interleaved repeat by repeat so a busy machine slows both alike; medians are reported.
--clock cpu times the calling thread's CPU time instead of wall time (with --threads 1, so all work runs
on that thread): other processes preempting this one then do not count, only their cache traffic does.

  .venv/bin/python scripts/bench_moe.py                      # bf16 and fp32, 16 / 256 / 2048 tokens
  .venv/bin/python scripts/bench_moe.py --dtype bf16 --tokens 256 --repeats 50
  .venv/bin/python scripts/bench_moe.py --clock cpu --threads 1
  .venv/bin/python scripts/bench_moe.py --dtype bf16w   # bf16 weights, float32 activations (AVX2 CPUs)

--dtype bf16w times the block as `--dtype bfloat16` computes on a CPU without bf16 arithmetic
(the cpu kernel backend, kernels/backend_cpu.py): bf16 weights, float32 activations, routed and shared experts in one C call
(kernels/cpu_moe.py). Transformers runs the same bf16 weights in bf16 (what it does with this checkpoint)
and, as a second baseline, the same values widened to float32.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path


import torch  # noqa: E402
import transformers  # noqa: E402
from transformers import DeepseekV3Config  # noqa: E402
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE  # noqa: E402

from moe_serve import kernels  # noqa: E402
from moe_serve.kernels import cpu_moe, fused_moe  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def build_moe(args, dtype) -> tuple[DeepseekV3MoE, torch.Tensor, torch.Tensor]:
    """A DeepseekV3MoE on random weights, and its routed experts stacked as w13 [E, 2I, H], w2 [E, H, I]."""
    cfg = DeepseekV3Config(
        hidden_size=args.hidden, moe_intermediate_size=args.intermediate, n_routed_experts=args.experts,
        num_experts_per_tok=args.topk, n_shared_experts=1, n_group=args.groups, topk_group=args.topk_groups,
        norm_topk_prob=True, routed_scaling_factor=2.5,
    )
    torch.manual_seed(0)
    moe = DeepseekV3MoE(cfg)
    with torch.no_grad():
        moe.gate.weight.normal_(0, args.hidden**-0.5)  # left uninitialised by the module
        moe.gate.e_score_correction_bias.normal_(0, 0.01)
    moe = moe.to(dtype).eval()
    moe.gate.float()  # DeepSeek routes in float32 whatever the model dtype
    w13_E2IH = torch.stack([torch.cat([e.gate_proj.weight, e.up_proj.weight]) for e in moe.experts]).contiguous()
    w2_EHI = torch.stack([e.down_proj.weight for e in moe.experts]).contiguous()
    return moe, w13_E2IH, w2_EHI


def fused_block(moe: DeepseekV3MoE, w13_E2IH, w2_EHI, x_TH: torch.Tensor) -> torch.Tensor:
    topk_ids_TK, topk_weights_TK = moe.gate(x_TH)
    return fused_moe(x_TH, w13_E2IH, w2_EHI, topk_weights_TK, topk_ids_TK) + moe.shared_experts(x_TH)


def bench_bf16w(args, clock) -> None:
    """bf16 weights with float32 activations (ours, as served on CPUs without bf16 arithmetic) against
    transformers' block in bf16 and in float32 on the same weight values."""
    if not cpu_moe.fits(torch.zeros(1, args.hidden), torch.zeros(1, 2, args.hidden, dtype=torch.bfloat16),
                        torch.zeros(1, args.hidden, 1, dtype=torch.bfloat16)):
        raise SystemExit("--dtype bf16w needs the CPU kernels (x86-64 with AVX2 + FMA and a C compiler)")
    moe16, w13_E2IH, w2_EHI = build_moe(args, torch.bfloat16)
    moe32, _, _ = build_moe(args, torch.bfloat16)
    moe32 = moe32.float()  # the same bf16 values, held and computed in float32
    mlp = moe16.shared_experts
    shared_w13 = torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]).contiguous()
    shared_w2 = mlp.down_proj.weight.contiguous()
    print("| weights | tokens | transformers bf16 ms | transformers fp32 ms | ours ms | speedup vs bf16 "
          "| vs fp32 | routed only: transformers bf16 ms | ours ms | speedup | max rel diff vs fp32 |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for T in args.tokens:
        x32 = torch.randn(T, args.hidden, generator=torch.Generator().manual_seed(T)).bfloat16().float()
        x16 = x32.bfloat16()
        with torch.inference_mode():
            ids_TK, weights_TK = moe32.gate(x32)

            def ours():
                ids, weights = moe32.gate(x32)
                return cpu_moe.fused_moe_bf16w(x32, w13_E2IH, w2_EHI, weights, ids, shared_w13, shared_w2)

            ref = moe32(x32)
            diff = ((ours() - ref).abs().max() / ref.abs().max()).item()
            ms = time_interleaved(
                {
                    "hf16": lambda: moe16(x16),
                    "hf32": lambda: moe32(x32),
                    "ours": ours,
                    "hf_routed": lambda: moe16.moe(x16, ids_TK, weights_TK),
                    "ours_routed": lambda: fused_moe(x32, w13_E2IH, w2_EHI, weights_TK, ids_TK),
                },
                args.warmup, args.repeats, clock,
            )
        print(f"| bf16, x float32 | {T} | {ms['hf16']:.2f} | {ms['hf32']:.2f} | {ms['ours']:.2f} "
              f"| {ms['hf16'] / ms['ours']:.1f}x | {ms['hf32'] / ms['ours']:.1f}x | {ms['hf_routed']:.2f} "
              f"| {ms['ours_routed']:.2f} | {ms['hf_routed'] / ms['ours_routed']:.1f}x | {diff:.1e} |", flush=True)


def time_interleaved(fns: dict, warmup: int, repeats: int, clock) -> dict[str, float]:
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    times = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = clock()
            fn()
            times[name].append(clock() - start)
    return {name: statistics.median(t) * 1e3 for name, t in times.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtype", choices=[*DTYPES, "both", "bf16w"], default="both",
                   help="bf16w: bf16 weights with float32 activations (see above)")
    p.add_argument("--tokens", type=int, nargs="+", default=[16, 256, 2048])
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--intermediate", type=int, default=256, help="moe_intermediate_size")
    p.add_argument("--experts", type=int, default=32)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--groups", type=int, default=4, help="n_group of the group-limited router")
    p.add_argument("--topk-groups", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--clock", choices=["wall", "cpu"], default="wall", help="cpu: thread CPU time, needs --threads 1")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--repeats", type=int, default=20)
    args = p.parse_args()
    assert Path(kernels.__file__).resolve().is_relative_to(Path(__file__).resolve().parents[1]), kernels.__file__
    if args.clock == "cpu" and args.threads != 1:
        p.error("--clock cpu counts only the calling thread's CPU time, so it needs --threads 1")
    torch.set_num_threads(args.threads)
    clock = time.perf_counter if args.clock == "wall" else time.thread_time

    print(f"torch {torch.__version__}, transformers {transformers.__version__}, {torch.get_num_threads()} threads, "
          f"{args.clock} clock, load average before: {os.getloadavg()[0]:.2f}")
    print(f"hidden {args.hidden}, moe_intermediate {args.intermediate}, {args.experts} routed experts, "
          f"top-{args.topk} ({args.groups} groups, top-{args.topk_groups}), 1 shared expert; "
          f"median of {args.repeats} interleaved repeats after {args.warmup} warm-up\n")
    if args.dtype == "bf16w":
        bench_bf16w(args, clock)
        print(f"\nload average after: {os.getloadavg()[0]:.2f}")
        return
    print("| dtype | tokens | transformers ms | fused_moe ms | speedup | routed only: transformers ms "
          "| fused_moe ms | speedup | max rel diff |")
    print("|---|---|---|---|---|---|---|---|---|")
    for dname in DTYPES if args.dtype == "both" else [args.dtype]:
        dtype = DTYPES[dname]
        moe, w13_E2IH, w2_EHI = build_moe(args, dtype)
        for T in args.tokens:
            x_TH = torch.randn(T, args.hidden, generator=torch.Generator().manual_seed(T)).to(dtype)
            with torch.inference_mode():
                ids_TK, weights_TK = moe.gate(x_TH)
                ref_TH, out_TH = moe(x_TH), fused_block(moe, w13_E2IH, w2_EHI, x_TH)
                diff = ((out_TH.float() - ref_TH.float()).abs().max() / ref_TH.float().abs().max()).item()
                ms = time_interleaved(
                    {
                        "hf": lambda: moe(x_TH),
                        "ours": lambda: fused_block(moe, w13_E2IH, w2_EHI, x_TH),
                        "hf_routed": lambda: moe.moe(x_TH, ids_TK, weights_TK),
                        "ours_routed": lambda: fused_moe(x_TH, w13_E2IH, w2_EHI, weights_TK, ids_TK),
                    },
                    args.warmup, args.repeats, clock,
                )
            print(f"| {dname} | {T} | {ms['hf']:.2f} | {ms['ours']:.2f} | {ms['hf'] / ms['ours']:.1f}x "
                  f"| {ms['hf_routed']:.2f} | {ms['ours_routed']:.2f} | {ms['hf_routed'] / ms['ours_routed']:.1f}x "
                  f"| {diff:.1e} |", flush=True)
    print(f"\nload average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
