"""Tune the Triton fused-MoE block sizes on this GPU and write a table to kernels/configs/.

For each token count M it times every candidate config of the two grouped GEMMs (fused_moe_triton with
config=...), keeps the fastest that also matches the torch path, and writes
kernels/configs/E=..,N=..,K=..,device_name=..,dtype=..[,block_shape=[..]].json (see kernels/moe_configs.py).

  .venv/bin/python scripts/tune_moe.py --experts 256 --intermediate 2048 --hidden 7168 --topk 8 --dtype fp8_w8a8
  .venv/bin/python scripts/tune_moe.py --experts 64 --intermediate 1408 --hidden 2048 --topk 6 --dtype bf16 \\
      --search full --batch-sizes 1 16 256 4096

With expert parallelism pass the experts per rank (--experts 32 for 256 over 8 ranks).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import sys
import time
from pathlib import Path


import torch  # noqa: E402

DEFAULT_BATCHES = [1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 256, 512, 1024, 1536, 2048, 3072, 4096]
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, "fp8_w8a8": torch.bfloat16}
SEARCH = {  # BLOCK_SIZE_M, BLOCK_SIZE_N, BLOCK_SIZE_K, GROUP_SIZE_M, num_warps, num_stages
    "quick": ([16, 64, 128], [64, 128], [64, 128], [1, 16], [4, 8], [3, 4]),
    "full": ([16, 32, 64, 128], [32, 64, 128, 256], [64, 128, 256], [1, 16, 32, 64], [4, 8], [2, 3, 4, 5]),
}


def candidates(search: str, fp8_block_k: int | None):
    for bm, bn, bk, gm, warps, stages in itertools.product(*SEARCH[search]):
        if fp8_block_k is not None and fp8_block_k % bk:
            continue  # one activation scale and one weight scale per K step
        yield dict(BLOCK_SIZE_M=bm, BLOCK_SIZE_N=bn, BLOCK_SIZE_K=bk, GROUP_SIZE_M=gm, num_warps=warps,
                   num_stages=stages)


def quant_weight_fp8(w_EOD: torch.Tensor, block: tuple[int, int]):
    """Block-quantize float weights the way DeepSeek-V3 stores them: real = fp8 * scale."""
    from moe_serve.kernels.reference import FP8_DTYPE, FP8_MAX

    E, O, D = w_EOD.shape
    ob, db = math.ceil(O / block[0]), math.ceil(D / block[1])
    padded = torch.zeros(E, ob * block[0], db * block[1], device=w_EOD.device)
    padded[:, :O, :D] = w_EOD
    scale = padded.view(E, ob, block[0], db, block[1]).abs().amax(dim=(2, 4)).clamp(min=1e-12) / FP8_MAX
    full = scale.repeat_interleave(block[0], 1).repeat_interleave(block[1], 2)[:, :O, :D]
    return (w_EOD / full).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale


def bench_ms(fn, iters: int) -> float:
    """Mean milliseconds per call, replaying a CUDA graph so launch overhead does not hide kernel time."""
    fn()  # compile and warm up
    torch.cuda.synchronize()
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        run = graph.replay
    except RuntimeError as e:  # not capturable on this torch: time plain launches instead
        print(f"  (no CUDA graph: {e}; timing eager launches)")
        run = fn
    run()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        run()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--experts", type=int, required=True, help="experts on one rank")
    p.add_argument("--intermediate", type=int, required=True, help="moe_intermediate_size (N in the file name)")
    p.add_argument("--hidden", type=int, required=True, help="hidden_size (K in the file name)")
    p.add_argument("--topk", type=int, required=True)
    p.add_argument("--dtype", choices=DTYPES, default="bf16")
    p.add_argument("--block-shape", type=int, nargs=2, default=[128, 128], help="fp8 weight scale block")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=DEFAULT_BATCHES)
    p.add_argument("--search", choices=SEARCH, default="quick")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--out-dir", type=Path, default=None, help="default: kernels/configs")
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("scripts/tune_moe.py times Triton kernels and needs a CUDA GPU; none is visible here. "
                 "Run it on the serving GPU (the kernels fall back to default block sizes until then).")
    if os.environ.get("TRITON_INTERPRET") == "1":
        sys.exit("unset TRITON_INTERPRET: tuning the CPU interpreter would measure nothing useful")

    from moe_serve.kernels.fused_moe import fused_moe
    from moe_serve.kernels.fused_moe_triton import fused_moe_triton
    from moe_serve.kernels.moe_configs import CONFIG_DIR, config_file_name, device_name

    E, I, H, K = args.experts, args.intermediate, args.hidden, args.topk
    fp8 = args.dtype == "fp8_w8a8"
    dtype, dev = DTYPES[args.dtype], torch.device("cuda")
    torch.manual_seed(0)
    w13 = torch.randn(E, 2 * I, H, device=dev) / math.sqrt(H)
    w2 = torch.randn(E, H, I, device=dev) / math.sqrt(I)
    scales = {}
    if fp8:
        (w13, w13_s), (w2, w2_s) = quant_weight_fp8(w13, args.block_shape), quant_weight_fp8(w2, args.block_shape)
        scales = dict(w13_scale=w13_s, w2_scale=w2_s, block_shape=args.block_shape)
    else:
        w13, w2 = w13.to(dtype), w2.to(dtype)

    table = {}
    for M in args.batch_sizes:
        x = torch.randn(M, H, device=dev).to(dtype)
        ids = torch.rand(M, E, device=dev).topk(K, dim=-1).indices  # uniform routing
        weights = torch.rand(M, K, device=dev)
        ref = fused_moe(x, w13, w2, weights, ids, backend="torch", **scales).float()
        best, best_ms, started = None, float("inf"), time.time()
        for cfg in candidates(args.search, args.block_shape[1] if fp8 else None):
            run = lambda: fused_moe_triton(x, w13, w2, weights, ids, config=cfg, **scales)  # noqa: E731
            try:
                err = ((run().float() - ref).abs().max() / ref.abs().max().clamp(min=1e-6)).item()
                ms = bench_ms(run, args.iters)
            except Exception as e:  # too much shared memory, too many registers, ...
                print(f"  M={M} skip {cfg}: {type(e).__name__}")
                continue
            if err > (0.1 if fp8 else 0.03):
                print(f"  M={M} reject {cfg}: rel err {err:.1e}")
            elif ms < best_ms:
                best, best_ms = cfg, ms
        if best is None:
            sys.exit(f"no candidate config ran for M={M}; try --search full")
        table[str(M)] = best
        print(f"M={M}: {best_ms * 1e3:.1f} us with {best} ({time.time() - started:.0f} s)", flush=True)

    name = config_file_name(E, I, H, device_name(dev), args.dtype, args.block_shape if fp8 else None)
    path = (args.out_dir or CONFIG_DIR) / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(table, indent=2) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
