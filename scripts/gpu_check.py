"""GPU readiness in one run: the CUDA kernel backend against the torch backend, kernel TFLOP/s at DeepSeek-V3
shapes, and the decode step time. Not a test (tests/test_gpu_check.py runs its CPU mode).

    python scripts/gpu_check.py --out gpu_check            # on a CUDA GPU (one H200: a few minutes)
    TRITON_INTERPRET=1 python scripts/gpu_check.py --tiny   # any CPU: every code path at tiny shapes

1. Parity: greedy tokens and logprobs of `--kernel-backend cuda` against `--kernel-backend torch` (the
   reference: plain torch ops, FP8 weights dequantised per call) on the tiny and bench-shaped checkpoints,
   bf16 and block FP8. bf16 differs from the reference only in summation order; FP8 runs w8a8 (activations
   quantised per token group of 128), so its logprobs move more and a near-tie can flip a token.
2. Kernels at DeepSeek-V3 shapes (H 7168, I 2048, 256 experts over EP 8 or 32 = 32 or 8 local experts,
   top-8): the Triton fused MoE in bf16 and FP8 w8a8 at decode sizes (1-128 rows per local expert) and
   prefill chunks (512-4096 tokens), next to torch._grouped_mm (bf16) where this torch has it; the FP8
   linear against a bf16 torch.mm of the same shape; the card's bf16 matmul peak (8192^3) measured here.
3. Decode step: median engine step with 1 / 12 / 64 requests running, bench checkpoint, bf16 and FP8.

--tiny shrinks every shape (and the model to the tiny preset with two layers) so that the Triton interpreter
runs it on a CPU in a few minutes. A section that fails is reported and the others still run (exit status 1). Prints markdown tables; --out DIR also writes results.json and summary.md there.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def _importable() -> None:
    """`moe_serve` from this checkout even where the project is not installed (a bare GPU machine): a folder
    of links named as the installed namespace (pyproject.toml's package-dir)."""
    try:
        import moe_serve.kernels  # noqa: F401
        return
    except ImportError:
        pass
    shim = Path(tempfile.mkdtemp(prefix="moe_serve_shim")) / "moe_serve"
    shim.mkdir()
    for name in ("moe", "experts", "balancer", "parallel", "kernels", "server"):
        (shim / name).symlink_to(REPO / name)
    sys.path.insert(0, str(shim.parent))


_importable()

import torch  # noqa: E402

PROMPTS = ["Hello, my name is", "The capital of France is", "1, 2, 3, 4,", "Mixture-of-experts models"]


# ---- timing -----------------------------------------------------------------------------------------
def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


TIMING = {"warmup": 3, "repeats": 10}  # --tiny: 1 and 2 (the interpreter's timings mean nothing anyway)


def time_ms(fn, device: torch.device, warmup: int | None = None, repeats: int | None = None) -> float:
    """Median milliseconds of `repeats` calls (CUDA events on a GPU, wall clock elsewhere)."""
    warmup = TIMING["warmup"] if warmup is None else warmup
    repeats = TIMING["repeats"] if repeats is None else repeats
    for _ in range(warmup):
        fn()
    _sync(device)
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


# ---- 1. parity ---------------------------------------------------------------------------------------
def _generate(llm, prompts: list[str], max_tokens: int):
    from moe_serve.server import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=1)
    return [o.outputs[0] for o in llm.generate(prompts, params)]


def parity(ckpt: Path, name: str, dtype: str, device: str, prompts: list[str], max_tokens: int) -> dict:
    from moe_serve.server import LLM

    runs = {}
    for key, backend, run_dtype in (("torch", "torch", dtype), ("cuda", "cuda", dtype), ("float32", "torch", "float32")):
        llm = LLM(str(ckpt), dtype=run_dtype, device=device, kernel_backend=backend, kv_cache_tokens=8192,
                  max_num_batched_tokens=512)
        t0 = time.perf_counter()
        runs[key] = _generate(llm, prompts, max_tokens)
        runs[key + "_s"] = time.perf_counter() - t0
        del llm

    def agreement(want, got) -> tuple[int, list[int], float]:
        same, first_diff, max_lp = 0, [], 0.0
        for ref, out in zip(want, got):
            n = next((i for i, (a, b) in enumerate(zip(ref.token_ids, out.token_ids)) if a != b), len(ref.token_ids))
            same += n == len(ref.token_ids)
            first_diff.append(n)
            for t, a, b in list(zip(ref.token_ids, ref.logprobs, out.logprobs))[:n]:
                max_lp = max(max_lp, abs(a[t] - b[t]))
        return same, first_diff, round(max_lp, 5)

    same, first, lp = agreement(runs["torch"], runs["cuda"])
    # the torch backend in float32 on the same stored values: how far each dtype-`dtype` backend is from it
    same_t, first_t, _ = agreement(runs["float32"], runs["torch"])
    same_c, first_c, _ = agreement(runs["float32"], runs["cuda"])
    return {"checkpoint": name, "dtype": dtype, "prompts": len(prompts), "identical": same,
            "first_divergence": first, "max_logprob_diff_before_divergence": lp,
            "torch_vs_fp32_identical": same_t, "torch_vs_fp32_first_divergence": first_t,
            "cuda_vs_fp32_identical": same_c, "cuda_vs_fp32_first_divergence": first_c,
            "torch_s": round(runs["torch_s"], 2), "cuda_s": round(runs["cuda_s"], 2)}


# ---- 2. kernels --------------------------------------------------------------------------------------
def _quantize_blocks(w: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A weight stack [E, O, I] in block FP8, one expert at a time (moe/fp8_block.py, as checkpoints are made)."""
    from moe_serve.moe.fp8_block import quantize_fp8_block

    parts = [quantize_fp8_block(w_OI, (block, block)) for w_OI in w]
    return torch.stack([q for q, _ in parts]), torch.stack([s for _, s in parts])


def _routing(T: int, E: int, K: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token picks K distinct local experts uniformly (a balanced load)."""
    g = torch.Generator(device="cpu").manual_seed(T * 131 + E)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]).to(device)
    weights = torch.rand(T, K, generator=g).to(device)
    return weights / weights.sum(-1, keepdim=True), ids


def _grouped_mm_moe(x_TH, w13_EH2I, w2_EIH, weights_TK, ids_TK):
    """The same routed-expert computation through torch._grouped_mm (bf16): rows sorted by expert."""
    T, K = ids_TK.shape
    order = ids_TK.flatten().argsort()
    counts = torch.bincount(ids_TK.flatten(), minlength=w13_EH2I.shape[0])
    offs = counts.cumsum(0).to(torch.int32)
    rows = x_TH[order // K]
    h = torch._grouped_mm(rows, w13_EH2I, offs=offs)
    I = h.shape[-1] // 2
    h = torch.nn.functional.silu(h[:, :I]) * h[:, I:]
    y = torch._grouped_mm(h, w2_EIH, offs=offs).float() * weights_TK.flatten()[order, None]
    out = torch.zeros(x_TH.shape, dtype=torch.float32, device=x_TH.device)
    out.index_add_(0, order // K, y)
    return out.to(x_TH.dtype)


def bench_moe(H: int, I: int, E_local: int, K: int, tokens: list[int], device, block: int) -> list[dict]:
    from moe_serve.kernels.fused_moe import fused_moe

    g = torch.Generator(device="cpu").manual_seed(0)
    w13 = (torch.randn(E_local, 2 * I, H, generator=g) / H ** 0.5).to(device, torch.bfloat16)
    w2 = (torch.randn(E_local, H, I, generator=g) / I ** 0.5).to(device, torch.bfloat16)
    w13_q, w13_s = _quantize_blocks(w13, block)
    w2_q, w2_s = _quantize_blocks(w2, block)
    grouped = hasattr(torch, "_grouped_mm") and device.type == "cuda"
    w13_t, w2_t = w13.transpose(1, 2), w2.transpose(1, 2)  # [E, H, 2I], [E, I, H]: column-major, as cuBLAS takes B
    rows = []
    for T in tokens:
        x = torch.randn(T, H, generator=g).to(device, torch.bfloat16)
        weights, ids = _routing(T, E_local, K, device)
        flops = 2 * 3 * H * I * T * K
        bf16 = time_ms(lambda: fused_moe(x, w13, w2, weights, ids, backend="triton"), device)
        fp8 = time_ms(lambda: fused_moe(x, w13_q, w2_q, weights, ids, w13_scale=w13_s, w2_scale=w2_s,
                                        block_shape=(block, block), backend="triton"), device)
        row = {"experts": E_local, "tokens": T, "rows_per_expert": T * K // E_local,
               "triton_bf16_ms": round(bf16, 4), "triton_bf16_tflops": round(flops / bf16 / 1e9, 1),
               "triton_fp8_ms": round(fp8, 4), "triton_fp8_tflops": round(flops / fp8 / 1e9, 1)}
        if grouped:
            try:
                try:
                    _grouped_mm_moe(x, w13_t, w2_t, weights, ids)
                except RuntimeError:  # a torch that wants B row-major
                    w13_t, w2_t = w13_t.contiguous(), w2_t.contiguous()
                gm = time_ms(lambda: _grouped_mm_moe(x, w13_t, w2_t, weights, ids), device)
                row.update(grouped_mm_bf16_ms=round(gm, 4), grouped_mm_bf16_tflops=round(flops / gm / 1e9, 1))
            except (RuntimeError, TypeError) as err:  # an older torch or an unsupported card
                row["grouped_mm_bf16"] = f"n/a ({str(err).splitlines()[0][:80]})"
        rows.append(row)
    return rows


def bench_linear(shapes: list[tuple[int, int]], tokens: list[int], device, block: int) -> list[dict]:
    from moe_serve.kernels.fp8_linear_triton import fp8_linear_triton

    g = torch.Generator(device="cpu").manual_seed(1)
    rows = []
    for O, I in shapes:
        w = (torch.randn(1, O, I, generator=g) / I ** 0.5).to(device, torch.bfloat16)
        w_q, w_s = _quantize_blocks(w, block)
        for T in tokens:
            x = torch.randn(T, I, generator=g).to(device, torch.bfloat16)
            flops = 2 * T * O * I
            mm = time_ms(lambda: torch.mm(x, w[0].t()), device)
            fp8 = time_ms(lambda: fp8_linear_triton(x, w_q[0], w_s[0], (block, block)), device)
            rows.append({"out": O, "in": I, "tokens": T, "torch_mm_bf16_ms": round(mm, 4),
                         "torch_mm_bf16_tflops": round(flops / mm / 1e9, 1), "triton_fp8_ms": round(fp8, 4),
                         "triton_fp8_tflops": round(flops / fp8 / 1e9, 1)})
    return rows


def sweep_fp8_linear(shapes: list[tuple[int, int]], tokens: list[int], device, block: int) -> list[dict]:
    """The FP8 linear's Triton tile per row count: milliseconds of each candidate (kernels/fp8_linear_triton.py
    config_for picks one per size class; this is how to choose it on a new card)."""
    from moe_serve.kernels import fp8_linear_triton as fl

    g = torch.Generator(device="cpu").manual_seed(3)
    chosen = fl.config_for
    rows = []
    try:
        for O, I in shapes:
            w = (torch.randn(1, O, I, generator=g) / I ** 0.5).to(device, torch.bfloat16)
            w_q, w_s = _quantize_blocks(w, block)
            for T in tokens:
                x = torch.randn(T, I, generator=g).to(device, torch.bfloat16)
                timed = {}
                for bm in (16, 64):
                    for bn in (32, 64, 128):
                        for bk in (64, 128):
                            for stages in (3, 5):
                                if bk > block or (bm == 64 and T < 64) or (bm == 16 and T > 128):
                                    continue
                                cfg = dict(BLOCK_SIZE_M=bm, BLOCK_SIZE_N=bn, BLOCK_SIZE_K=bk, GROUP_SIZE_M=1 if bm == 16 else 8,
                                           num_warps=4, num_stages=stages)
                                fl.config_for = lambda _T, _b, _c=cfg: _c
                                timed[f"m{bm} n{bn} k{bk} s{stages}"] = time_ms(
                                    lambda: fl.fp8_linear_triton(x, w_q[0], w_s[0], (block, block)), device, 2, 5)
                fl.config_for = chosen
                now = time_ms(lambda: fl.fp8_linear_triton(x, w_q[0], w_s[0], (block, block)), device, 2, 5)
                best = min(timed, key=timed.get)
                rows.append({"out": O, "in": I, "tokens": T, "current_ms": round(now, 4), "best": best,
                             "best_ms": round(timed[best], 4), "all": {k: round(v, 4) for k, v in timed.items()}})
    finally:
        fl.config_for = chosen
    return rows


def matmul_peak(device, n: int) -> float:
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    ms = time_ms(lambda: torch.mm(a, b), device)
    return round(2 * n ** 3 / ms / 1e9, 1)


def fp8_kernel_error(device, H: int, I: int, block: int) -> dict:
    """FP8 fused MoE (w8a8) against the float32 reference on the dequantised weights, and against the same
    reference with its activations rounded through FP8 per token group as the kernel does (the second error
    is the kernel's own; the first adds the activation rounding, which FP8 serving accepts)."""
    from moe_serve.kernels.fused_moe import fused_moe
    from moe_serve.kernels.reference import fused_moe_reference

    g = torch.Generator(device="cpu").manual_seed(2)
    E, K, T = 8, 2, 33
    w13, w2 = torch.randn(E, 2 * I, H, generator=g) / H ** 0.5, torch.randn(E, H, I, generator=g) / I ** 0.5
    w13_q, w13_s = _quantize_blocks(w13, block)
    w2_q, w2_s = _quantize_blocks(w2, block)
    x = torch.randn(T, H, generator=g)
    weights, ids = _routing(T, E, K, "cpu")
    scales = dict(w13_scale=w13_s, w2_scale=w2_s, block_shape=(block, block))
    got = fused_moe(x.to(device), w13_q.to(device), w2_q.to(device), weights.to(device), ids.to(device),
                    w13_scale=w13_s.to(device), w2_scale=w2_s.to(device), block_shape=(block, block),
                    backend="triton").float().cpu()

    def rel(ref: torch.Tensor) -> float:
        return round(((got - ref).abs().max() / ref.abs().max()).item(), 5)

    return {"rel_max_err_vs_dequantised": rel(fused_moe_reference(x, w13_q, w2_q, weights, ids, **scales)),
            "rel_max_err_vs_fp8_activations": rel(fused_moe_reference(x, w13_q, w2_q, weights, ids, **scales,
                                                                      quant_act=True))}


# ---- 3. decode step ----------------------------------------------------------------------------------
def decode_step(ckpt: Path, dtype: str, device: str, running: list[int], steps: int) -> list[dict]:
    from moe_serve.server import LLM, SamplingParams

    llm = LLM(str(ckpt), dtype=dtype, device=device, kernel_backend="cuda",
              max_num_seqs=max(running), max_num_batched_tokens=4096, kv_cache_tokens=65536)
    engine = llm.engine
    params = SamplingParams(max_tokens=100_000, temperature=0.0, ignore_eos=True)
    dev = torch.device(device)
    rows = []
    for n in running:
        g = torch.Generator().manual_seed(n)
        ids = [engine.add_request(torch.randint(0, engine.model_config.vocab_size, (128,), generator=g).tolist(),
                                  params, request_id=f"gpu-check-{n}-{i}") for i in range(n)]
        while any(engine.requests[r].num_output_tokens == 0 for r in ids):
            engine.step()
        for _ in range(2):
            engine.step()
        times = []
        for _ in range(steps):
            _sync(dev)
            t0 = time.perf_counter()
            engine.step()
            _sync(dev)
            times.append((time.perf_counter() - t0) * 1e3)
        for r in ids:
            engine.abort_request(r)
        while engine.has_unfinished_requests():
            engine.step()
        rows.append({"dtype": dtype, "running": n, "step_median_ms": round(statistics.median(times), 3),
                     "step_min_ms": round(min(times), 3)})
    return rows


# ---- report ------------------------------------------------------------------------------------------
def section(fn):
    """Run one section; a failure is recorded (with its traceback printed) and the next section still runs."""
    try:
        return fn()
    except Exception as err:  # noqa: BLE001 - one GPU session: report everything it can
        traceback.print_exc()
        return {"error": f"{type(err).__name__}: {err}"[:500]}


def table(rows) -> str:
    if isinstance(rows, dict):
        return str(rows)
    if not rows:
        return ""
    keys = list(dict.fromkeys(k for r in rows for k in r))
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    lines += ["| " + " | ".join(str(r.get(k, "")) for k in keys) + " |" for r in rows]
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="tiny shapes and models (the CPU mode, with TRITON_INTERPRET=1)")
    ap.add_argument("--out", default=None, help="folder for results.json and summary.md")
    ap.add_argument("--work", default=None, help="folder for the checkpoints it builds (default: a temporary one)")
    ap.add_argument("--skip", nargs="*", default=[], choices=["parity", "kernels", "decode"])
    args = ap.parse_args()
    interpreting = os.environ.get("TRITON_INTERPRET") == "1"
    if args.tiny:
        TIMING.update(warmup=1, repeats=2)
    if not torch.cuda.is_available() and not interpreting:
        print("gpu_check: no CUDA GPU here; on a CPU run it with TRITON_INTERPRET=1 and --tiny", file=sys.stderr)
        return 2
    device = "cuda" if torch.cuda.is_available() and not interpreting else "cpu"
    dev = torch.device(device)
    from moe_serve.moe.tiny import make_checkpoint

    work = Path(args.work or tempfile.mkdtemp(prefix="gpu_check"))
    t_start = time.perf_counter()
    env = {"device": torch.cuda.get_device_name(0) if device == "cuda" else "cpu (TRITON_INTERPRET=1)",
           "torch": torch.__version__, "triton": __import__("triton").__version__, "tiny": args.tiny}
    results: dict = {"environment": env}
    print(f"gpu_check on {env['device']}, torch {env['torch']}, triton {env['triton']}", flush=True)

    # --tiny: two layers (one dense, one MoE), two prompts, three tokens: the Triton interpreter is slow
    presets = ["v3"] if args.tiny else ["v3", "bench"]
    overrides = {"num_hidden_layers": 2} if args.tiny else None
    ckpts = {(p, fp8): make_checkpoint(work / f"{p}-{'fp8' if fp8 else 'bf16'}", p, dtype="bfloat16", fp8=fp8,
                                       overrides=overrides if p == "v3" else None)
             for p in presets for fp8 in (False, True)}
    if "parity" not in args.skip:
        prompts, max_tokens = (PROMPTS[:2], 3) if args.tiny else (PROMPTS, 24)
        results["parity"] = section(lambda: [parity(ckpt, f"{p} {'fp8' if fp8 else 'bf16'}", "bfloat16", device,
                                                    prompts, max_tokens) for (p, fp8), ckpt in ckpts.items()])
        print("\n## parity: cuda backend against torch backend (greedy)\n" + table(results["parity"]), flush=True)
    if "kernels" not in args.skip:
        if args.tiny:
            H, I, K, block, experts = 64, 32, 2, 16, [4]
            decode_rows, prefill_tokens, lin_shapes, lin_tokens = [1], [8], [(64, 128)], [1]
        else:
            H, I, K, block, experts = 7168, 2048, 8, 128, [32, 8]
            decode_rows, prefill_tokens = [1, 4, 16, 64, 128], [512, 4096]
            lin_shapes, lin_tokens = [(7168, 16384), (24576, 1536)], [1, 16, 128, 512, 4096]
        tokens = {E: sorted({max(1, m * E // K) for m in decode_rows} | set(prefill_tokens)) for E in experts}
        results["fused_moe"] = section(lambda: [r for E in experts for r in bench_moe(H, I, E, K, tokens[E], dev, block)])
        results["fp8_linear"] = section(lambda: bench_linear(lin_shapes, lin_tokens, dev, block))
        results["fp8_error"] = section(lambda: fp8_kernel_error(dev, 64 if args.tiny else 256, 32 if args.tiny else 256,
                                                                block))
        if not args.tiny:
            results["fp8_linear_tiles"] = section(lambda: sweep_fp8_linear(lin_shapes, [1, 16, 128, 512], dev, block))
            print("\n## FP8 linear tiles\n" + table([{k: v for k, v in r.items() if k != "all"}
                                                      for r in results["fp8_linear_tiles"]]
                                                     if isinstance(results["fp8_linear_tiles"], list)
                                                     else results["fp8_linear_tiles"]), flush=True)
        results["bf16_matmul_peak_tflops"] = section(lambda: matmul_peak(dev, 512 if args.tiny else 8192))
        print(f"\n## fused MoE (H {H}, I {I}, top-{K}; bf16 matmul peak here "
              f"{results['bf16_matmul_peak_tflops']} TFLOP/s)\n" + table(results["fused_moe"]), flush=True)
        print("\n## FP8 linear against bf16 torch.mm\n" + table(results["fp8_linear"]), flush=True)
        print(f"\nFP8 fused MoE against the dequantised torch reference: {results['fp8_error']}", flush=True)
    if "decode" not in args.skip:
        preset = "v3" if args.tiny else "bench"
        running, steps, kinds = ([1], 1, (False,)) if args.tiny else ([1, 12, 64], 20, (False, True))
        results["decode_step"] = section(lambda: [row | {"weights": "fp8" if fp8 else "bf16"} for fp8 in kinds
                                                  for row in decode_step(ckpts[(preset, fp8)], "bfloat16", device,
                                                                         running, steps)])
        print(f"\n## decode step ({preset} checkpoint, cuda backend)\n" + table(results["decode_step"]), flush=True)
    failed = [k for k, v in results.items() if isinstance(v, dict) and "error" in v]
    results["seconds"] = round(time.perf_counter() - t_start, 1)
    print(f"\ngpu_check done in {results['seconds']} s", flush=True)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
        (out / "summary.md").write_text("\n\n".join(table(v) if isinstance(v, list) else f"{k}: {v}"
                                                    for k, v in results.items()) + "\n")
    if failed:
        print(f"gpu_check: {len(failed)} section(s) failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
