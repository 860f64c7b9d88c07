"""The CPU backend's linear kernels: bf16 weights against F.linear in float32, FP8 against bf16 weights. Not a test.

    OMP_NUM_THREADS=1 .venv/bin/python scripts/bench_linear.py                 # bf16 weight, float32 x
    OMP_NUM_THREADS=1 .venv/bin/python scripts/bench_linear.py --fp8-weights --shape 2048 7168 --rows 1 4 16
    OMP_NUM_THREADS=2 .venv/bin/python scripts/bench_linear.py --gemm        # prompt-sized products, GFLOP/s

Microseconds per call for one [out, in] weight at several row counts, cycling over --weights distinct
weights so they do not stay in cache (as in a decode step, which reads each weight once). Default: the
bf16-weight kernel of kernels/cpu_bf16w.py (float32 x) against F.linear on the same weights held in float32. --fp8-weights: the FP8-weight kernel (the same
weights as float8_e4m3fn with (128, 128) block scales) against the bf16-weight kernel, both float32 x, as for a
model served in bf16 (cpu_build.fp8_tiles on: FP8 products on the bf16 dot products where the build has them);
--fp8-float32 as for one served in float32 (every FP8 product float32). --fp8-both: the bf16-weight
kernel, FP8 as served in float32 and FP8 as served in bf16, in alternating rounds (--rounds, medians), each on its
own copies of the weights (a set read just before by another column would be partly in cache).
--gemm: GFLOP/s of prompt-sized products (rows x in x out, median of 20, one weight): the kernel as it runs
(bf16 products on AMX or AVX512-BF16 where the build has them), the same with every product in float32
(cpu_build.tile_rows(0)), MKL on a float32 copy of the weight, and oneDNN's bf16 matmul (torch.mm on bf16 x).
"""

from __future__ import annotations

import argparse
import statistics
import time


import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from moe_serve.kernels import cpu_bf16w, cpu_build  # noqa: E402

GEMM_SHAPES = [(256, 512, 512), (256, 512, 2048), (256, 1024, 2048), (256, 2048, 512), (48, 512, 2048),
               (1024, 1024, 1024), (2048, 512, 1536), (2048, 1024, 512), (4096, 512, 512)]
# rows, in, out: the bench model's prompt-chunk products, one square one, and steps of 2048-4096 prompt tokens


def per_call_us(fn, calls: int, repeats: int = 5) -> float:
    for _ in range(2):
        fn()
    t0 = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - t0) / repeats / calls * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", type=int, nargs=2, default=[512, 512], metavar=("OUT", "IN"))
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8, 64, 256])
    ap.add_argument("--weights", type=int, default=64)
    ap.add_argument("--fp8-weights", action="store_true", help="FP8 against bf16 weights, float32 x")
    ap.add_argument("--fp8-float32", action="store_true",
                    help="with --fp8-weights: every FP8 product in float32, as for a model served in float32")
    ap.add_argument("--fp8-both", action="store_true",
                    help="bf16 weights, FP8 served in float32 and FP8 served in bf16, alternating (see above)")
    ap.add_argument("--rounds", type=int, default=7, help="with --fp8-both: alternating rounds")
    ap.add_argument("--gemm", action="store_true", help="GFLOP/s of prompt-sized products (see above)")
    args = ap.parse_args()
    if args.gemm:
        return gemm()
    if args.fp8_both:
        return fp8_both(args.shape, args.rows, args.weights, args.rounds)
    ws = [torch.randn(*args.shape, dtype=torch.bfloat16) for _ in range(args.weights)]
    ref_fn, ref_what = F.linear, "F.linear float32"
    if not cpu_bf16w.available():
        raise SystemExit("the CPU kernels cannot run here (needs x86-64 with AVX2, FMA and F16C, c++ and ninja)")
    if args.fp8_weights:
        block, (O, K) = (128, 128), args.shape
        scale = torch.full((-(-O // 128), -(-K // 128)), 1 / 64)
        fp8 = {id(w): (w.float() * 64).to(torch.float8_e4m3fn) for w in ws}
        ref_ws, x_dtype, what = ws, torch.float32, "fp8-weight kernel"
        ref_fn, ref_what = cpu_bf16w.linear, "bf16-weight kernel"
        new_fn = lambda x, w: cpu_bf16w.linear(x, fp8[id(w)], scale_inv=scale, block=block)  # noqa: E731
        on = cpu_build.fp8_tiles(not args.fp8_float32)
        print(f"FP8 products on the bf16 dot products: {'yes' if on else 'no'}")
    else:
        ref_ws, x_dtype, what = [w.float() for w in ws], torch.float32, "bf16-weight kernel"
        new_fn = cpu_bf16w.linear
    print(f"weight {args.shape[0]}x{args.shape[1]}, {args.weights} weights, {torch.get_num_threads()} thread(s)")
    print(f"{'rows':>6} {ref_what + ' us':>22} {what + ' us':>22} {'ratio':>6}")
    for m in args.rows:
        x = torch.randn(m, args.shape[1], dtype=x_dtype)
        ref = per_call_us(lambda: [ref_fn(x, w) for w in ref_ws], len(ws))
        new = per_call_us(lambda: [new_fn(x, w) for w in ws], len(ws))
        print(f"{m:>6} {ref:>22.1f} {new:>22.1f} {ref / new:>5.2f}x")


def fp8_both(shape: list[int], rows: list[int], count: int, rounds: int) -> None:
    if not cpu_bf16w.available():
        raise SystemExit("the CPU kernels cannot run here (needs x86-64 with AVX2, FMA and F16C, c++ and ninja)")
    (O, K), block = shape, (128, 128)
    scale = torch.full((-(-O // 128), -(-K // 128)), 1 / 64)
    bf16 = [torch.randn(O, K, dtype=torch.bfloat16) for _ in range(count)]
    fp8 = {mode: [(torch.randn(O, K) * 64).clamp(-448, 448).to(torch.float8_e4m3fn) for _ in range(count)]
           for mode in ("float32", "bf16")}
    before = cpu_build.fp8_tiles()
    print(f"weight {O}x{K}, {count} weights a column, {torch.get_num_threads()} thread(s), medians of {rounds} rounds; "
          f"FP8 served in bf16 on the bf16 dot products: {'yes' if cpu_build.fp8_tiles(True) else 'no (not this build)'}")
    print(f"{'rows':>6} {'bf16 weight us':>15} {'FP8 in float32 us':>18} {'FP8 in bf16 us':>15} {'gain':>6}")
    try:
        for m in rows:
            x = torch.randn(m, K)
            times: dict[str, list[float]] = {"bf16w": [], "float32": [], "bf16": []}
            for _ in range(rounds):
                times["bf16w"].append(per_call_us(lambda: [cpu_bf16w.linear(x, w) for w in bf16], count, repeats=1))
                for mode in ("float32", "bf16"):
                    cpu_build.fp8_tiles(mode == "bf16")
                    times[mode].append(per_call_us(
                        lambda: [cpu_bf16w.linear(x, w, scale_inv=scale, block=block) for w in fp8[mode]], count,
                        repeats=1))
            med = {k: statistics.median(v) for k, v in times.items()}
            print(f"{m:>6} {med['bf16w']:>15.1f} {med['float32']:>18.1f} {med['bf16']:>15.1f} "
                  f"{med['float32'] / med['bf16']:>5.2f}x")
    finally:
        cpu_build.fp8_tiles(before)


def gemm() -> None:
    def median_s(fn, n: int = 20) -> float:
        fn()
        times = []
        for _ in range(n):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    tiles = cpu_build.tile_rows()
    print(f"kernel build {cpu_build.isa()} (bf16 products from {tiles or 'no'} rows), {torch.get_num_threads()} "
          f"thread(s), torch {torch.__version__}; GFLOP/s, median of 20")
    print(f"{'rows x in x out':>18} {'kernel':>8} {'float32 kernel':>15} {'MKL float32':>12} {'oneDNN bf16':>12}")
    for M, K, O in GEMM_SHAPES:
        x, w = torch.randn(M, K), torch.randn(O, K).bfloat16()
        wf, xb, flop = w.float(), x.bfloat16(), 2 * M * K * O / 1e9
        kernel = median_s(lambda: cpu_bf16w.linear(x, w))
        cpu_build.tile_rows(0)
        try:
            f32 = median_s(lambda: cpu_bf16w.linear(x, w))
        finally:
            cpu_build.tile_rows(tiles)
        mkl, onednn = median_s(lambda: torch.mm(x, wf.T)), median_s(lambda: torch.mm(xb, w.T))
        print(f"{f'{M} x {K} x {O}':>18} {flop / kernel:>8.0f} {flop / f32:>15.0f} {flop / mkl:>12.0f} {flop / onednn:>12.0f}")


if __name__ == "__main__":
    main()
