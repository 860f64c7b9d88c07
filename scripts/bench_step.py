"""Time of one engine step: `EngineCore.step()` medians over decode steps with N requests running. Not a test.

    OMP_NUM_THREADS=1 .venv/bin/python scripts/bench_step.py --running 1 12 64
    OMP_NUM_THREADS=1 .venv/bin/python scripts/bench_step.py --running 4 --kernels   # time per C kernel
    OMP_NUM_THREADS=1 .venv/bin/python scripts/bench_step.py --running 4 --kernels --layer-by-layer
    OMP_NUM_THREADS=2 .venv/bin/python scripts/bench_step.py --running 1 4 --bound   # against memory bandwidth
    OMP_NUM_THREADS=2 .venv/bin/python scripts/bench_step.py --running 1 4 --phases  # engine phases, per layer
    OMP_NUM_THREADS=2 .venv/bin/python scripts/bench_step.py --running 4 --profile   # torch ops (torch.profiler)
    OMP_NUM_THREADS=2 .venv/bin/python scripts/bench_step.py --running --prefill 64 256 1024  # against matmul peak
    OMP_NUM_THREADS=2 .venv/bin/python scripts/bench_step.py --running 1 4 8 16 --steps 400 --jitter
    OMP_NUM_THREADS=2 .venv/bin/python scripts/bench_step.py --running 1 4 16 32 --mixed 4 8 16 32 64
    OMP_NUM_THREADS=2 .venv/bin/python scripts/bench_step.py --model .cache/bench-fp8 --running 1 4 --fp8-ab

Builds the benchmark checkpoint if missing (.cache/bench), adds N requests of random 64-192 token prompts,
prefills them all, then times --steps decode steps and prints the median and minimum per N. --kernels
also times every call into the CPU kernel ops (kernels/cpu_build.py; the cpu kernel backend)
and prints each one's milliseconds per decode step; the rest of the step is torch ops and Python. --phases
splits the step into the engine's phases (schedule, input preparation, model forward, logits, sampling,
update) and the forward into its decoder layers; --profile prints torch.profiler's top ops. --prefill N
times a step that computes one N-token prompt alone, counts its multiply-adds from the model's shapes,
and reports it as a fraction of the machine's matmul peak (one large GEMM, measured in the same run).
--jitter: how much steps of the same work differ (the machine's noise, which no scheduler removes): p90 and
p99 of each step's time over the median of its 21 neighbours (which follows the contexts' growth); then the
same figures for float32 GEMMs of the median step's length on the same threads, the machine's own floor, and
the CPU time that other processes took meanwhile (from /proc).
--mixed K: steps that carry one fresh K-token prompt beside the N running decodes (what a paced prompt slice
costs), K = 0 for none, alternating; then a least-squares fit of every (decodes, prompt tokens, median ms) to
bench_itl.py's step-cost model, printed as the `--cost` that `bench_itl.py --simulate` takes.
--fp8-ab (an FP8 model served in bf16): decode steps in alternating rounds with the FP8 products as served (the bf16
dot products, cpu_build.fp8_tiles, where the build has them) and all in float32, as for a model served in float32.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import os
import statistics
import time
from pathlib import Path


import torch  # noqa: E402

from moe_serve.kernels import cpu_build  # noqa: E402
from moe_serve.moe.tiny import ensure_checkpoint  # noqa: E402
from moe_serve.server import LLM, SamplingParams  # noqa: E402
from moe_serve.server.tools.bench import percentile  # noqa: E402

import machine_floor  # noqa: E402  (scripts/, beside this one)
from machine_floor import over_local_median  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=".cache/bench")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--kernel-backend", default="auto", choices=["auto", "torch", "cpu", "cuda"])
    ap.add_argument("--running", type=int, nargs="*", default=[1, 12, 64])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--kernels", action="store_true", help="also time each CPU kernel (ms per decode step)")
    ap.add_argument("--bound", action="store_true",
                    help="also the memory-bandwidth bound: bytes a decode step must read (weights of every layer, "
                         "the routed experts the step used, KV cache) / measured read bandwidth, and that bound as "
                         "a fraction of the median step")
    ap.add_argument("--layer-by-layer", action="store_true",
                    help="decode steps call each kernel from Python, not one C call per layer (kernels/cpu_decode_layer.py): "
                         "with --kernels, the time of each kernel inside a layer")
    ap.add_argument("--phases", action="store_true", help="time the engine's phases and each decoder layer")
    ap.add_argument("--jitter", action="store_true",
                    help="p90 / p99 of each decode step's time over the median of its 21 neighbours (use --steps 400)")
    ap.add_argument("--profile", action="store_true", help="torch.profiler's top ops over the decode (and --prefill) steps")
    ap.add_argument("--mixed", type=int, nargs="*", default=[],
                    help="prompt chunk sizes: time steps carrying one such chunk beside the running decodes, and "
                         "fit bench_itl.py's step-cost model to them")
    ap.add_argument("--prefill", type=int, nargs="*", default=[],
                    help="prompt lengths: time a step computing one such prompt alone, against the matmul peak")
    ap.add_argument("--fp8-ab", action="store_true",
                    help="an FP8 model served in bf16: also decode steps in alternating rounds with its FP8 products "
                         "as served (on the bf16 dot products where the build has them) and as in float32")
    args = ap.parse_args()
    kernel_s = time_kernels() if args.kernels else None
    if args.model == ".cache/bench":
        ensure_checkpoint(Path(args.model), "bench")
    llm = LLM(args.model, dtype=args.dtype, kernel_backend=args.kernel_backend,
              max_num_seqs=max(args.running, default=1) + bool(args.mixed),  # (room for the mixed steps' prompt)
              max_num_batched_tokens=2048, kv_cache_tokens=65536)
    engine = llm.engine
    if args.layer_by_layer:
        for layer in engine.runner.model.model.layers:
            layer.fast_decode = None
        engine.runner.decode_rows_limit = engine.runner.decode_context_limit = 0
    params = SamplingParams(max_tokens=10_000, temperature=0.0, ignore_eos=True)
    from moe_serve.kernels import ops

    limit = getattr(ops.backend(), "linear_row_limit", None)
    print(f"{args.model} {args.dtype}, kernel backend {ops.backend().name}"
          + (f" (C linear kernel up to {limit} rows)" if limit else "")
          + f", {torch.get_num_threads()} thread(s), torch {torch.__version__}")
    phase_s = time_phases(engine) if args.phases else None
    bandwidth = read_bandwidth() if args.bound else None
    if bandwidth is not None:
        print(f"read bandwidth {bandwidth / 1e9:.1f} GB/s (sum of 512 MiB, best of 7, {torch.get_num_threads()} thread(s))")
    print(f"{'running':>8} {'prefill all ms':>15} {'step median ms':>15} {'step min ms':>12}"
          + (f" {'MB read':>8} {'bound ms':>9} {'bound/median':>13}" if args.bound else ""))
    mixed_points: list[tuple[int, int, float]] = []
    for n in args.running:
        g = torch.Generator().manual_seed(args.seed)
        ids = []
        for i in range(n):
            length = int(torch.randint(64, 193, (1,), generator=g))
            prompt = torch.randint(0, engine.model_config.vocab_size, (length,), generator=g).tolist()
            ids.append(engine.add_request(prompt, params, request_id=f"step-{n}-{i}"))
        t0 = time.perf_counter()
        while any(engine.requests[r].num_output_tokens == 0 for r in ids):
            engine.step()
        prefill = time.perf_counter() - t0
        times, read = [], []
        for counter in (kernel_s, phase_s):
            if counter is not None:
                counter.clear()
        profiler = cpu_profiler(args.profile)
        with profiler or contextlib.nullcontext():
            for _ in range(args.steps):
                t0 = time.perf_counter()
                engine.step()
                times.append(time.perf_counter() - t0)
                if bandwidth is not None:
                    read.append(step_bytes(engine, ids))
        if args.mixed:
            mixed_points += time_mixed(engine, n, args.mixed, args.seed)
        fp8_line = fp8_ab_line(engine) if args.fp8_ab else None
        for r in ids:
            engine.abort_request(r)
        median = statistics.median(times)
        bound = "" if bandwidth is None else (
            f" {statistics.median(read) / 1e6:>8.1f} {statistics.median(read) / bandwidth * 1e3:>9.2f}"
            f" {statistics.median(read) / bandwidth / median:>13.2f}")
        print(f"{n:>8} {prefill * 1e3:>15.0f} {median * 1e3:>15.1f} {min(times) * 1e3:>12.1f}{bound}")
        if fp8_line:
            print(fp8_line)
        if args.jitter:
            print(jitter_line(times))
            print(gemm_floor_line(median, args.steps))
        if kernel_s is not None:
            per_step = {name: s / args.steps * 1e3 for name, s in kernel_s.items()}
            rest = sum(times) / args.steps * 1e3 - sum(per_step.values())
            print("         kernels, ms per step: " + ", ".join(f"{k} {v:.2f}" for k, v in
                                                          sorted(per_step.items(), key=lambda kv: -kv[1]))
                  + f"; the rest (torch ops, Python) {rest:.2f}")
        if phase_s is not None:
            print_phases(phase_s, sum(times), args.steps)
        print_profile(profiler)
    if args.prefill:
        prefill_against_peak(engine, args.prefill, args.seed, profile=args.profile)
    if len(mixed_points) >= 5:
        from bench_itl import fit_step_cost

        coef, rms = fit_step_cost(mixed_points)
        print("step cost fit (ms): a + b decodes + c prompt_tokens + w (1 - q ** (decodes + prompt_tokens)): "
              f"rms residual {rms:.2f} ms; bench_itl.py --simulate --cost " + ",".join(f"{v:.4g}" for v in coef))


def time_mixed(engine, running: int, sizes: list[int], seed: int, repeats: int = 12) -> list[tuple[int, int, float]]:
    """Median ms of steps carrying one fresh prompt of each size in `sizes` (0: none) beside `running`
    decodes, the sizes alternating: [(decodes, prompt tokens, ms)]. Each prompt asks for one token, so it is
    done after its step."""
    from moe_serve.server import SamplingParams

    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    g = torch.Generator().manual_seed(seed + 1 + 7919 * running)  # prompts unlike every other run's (the prefix cache)
    sizes = [0, *sorted(set(sizes) - {0})]
    if max(sizes) > engine.config.max_num_batched_tokens - running:
        raise SystemExit(f"--mixed {max(sizes)} with {running} running: above the token budget")
    times: dict[int, list[float]] = {k: [] for k in sizes}
    for rep in range(repeats):
        for k in sizes:
            rid = None
            if k:
                prompt = torch.randint(0, engine.model_config.vocab_size, (k,), generator=g).tolist()
                rid = engine.add_request(prompt, params, request_id=f"mixed-{running}-{k}-{rep}")
            t0 = time.perf_counter()
            engine.step()
            times[k].append(time.perf_counter() - t0)
            if rid is not None and rid in engine.requests:
                engine.abort_request(rid)
    medians = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    print(f"         with a prompt chunk of K tokens, median ms: "
          + ", ".join(f"K={k} {ms:.2f}" for k, ms in medians.items()))
    return [(running, k, ms) for k, ms in medians.items()]


def fp8_ab_line(engine, rounds: int = 12, steps: int = 15) -> str:
    """Decode steps in alternating rounds: the FP8 products as the backend set them (cpu_build.fp8_tiles), then
    all in float32 (as for a model served in float32); the median of each round's median step, and the spread."""
    served = cpu_build.fp8_tiles()
    times: dict[bool, list[float]] = {served: [], False: []}
    try:
        for _ in range(rounds):
            for on in times:
                cpu_build.fp8_tiles(on)
                t = []
                for _ in range(steps):
                    t0 = time.perf_counter()
                    engine.step()
                    t.append(time.perf_counter() - t0)
                times[on].append(statistics.median(t) * 1e3)
    finally:
        cpu_build.fp8_tiles(served)
    text = lambda v: f"{statistics.median(v):.2f} ms [{min(v):.2f}-{max(v):.2f}]"  # noqa: E731
    if not served:
        return f"         FP8 products as served: float32 already (cpu_build.fp8_tiles off): {text(times[False])}"
    return (f"         FP8 products on the bf16 dot products {text(times[True])}, in float32 {text(times[False])}: "
            f"{statistics.median(times[False]) / statistics.median(times[True]):.2f}x ({rounds} alternating rounds of "
            f"{steps} steps)")


def jitter_line(times: list[float]) -> str:
    """Steps of one batch doing the same work: p90 / p99 of each step's time over its local median."""
    rel = over_local_median(times)
    return (f"         jitter over {len(times)} steps: step / local median p90 {percentile(rel, 90):.2f}, p99 "
            f"{percentile(rel, 99):.2f}; step p99 / p50 {percentile(times, 99) / statistics.median(times):.2f}")


def gemm_floor_line(target_s: float, iterations: int) -> str:
    """The machine's floor under `jitter_line`, in the same run: the same statistic over float32 GEMMs sized to
    take about `target_s` each on the same threads (fixed arithmetic that needs every thread, as a step does;
    scripts/machine_floor.py), and the CPU time other processes took meanwhile."""
    what, gemm = machine_floor.gemm_probe(target_s)
    before = other_threads_cpu()
    t_all = time.perf_counter()
    times = machine_floor.timed(gemm, iterations)
    others = other_cpu_text(before, other_threads_cpu(), time.perf_counter() - t_all)
    rel = over_local_median(times)
    return (f"         the machine's floor, {iterations} runs of a {what} ({statistics.median(times) * 1e3:.1f} ms "
            f"each): over the local median p90 {percentile(rel, 90):.2f}, p99 {percentile(rel, 99):.2f}; {others}")


def other_threads_cpu() -> dict[tuple[str, str], tuple[str, int, int]]:
    """{(pid, tid): (name, ns on a CPU, timeslices)} for every thread of every other process, from
    /proc/*/task/*/schedstat (empty where the kernel has none)."""
    own, out = str(os.getpid()), {}
    for pid in (p for p in os.listdir("/proc") if p.isdigit() and p != own):
        try:
            for tid in os.listdir(f"/proc/{pid}/task"):
                with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                    ran, _wait, slices = f.read().split()
                with open(f"/proc/{pid}/task/{tid}/comm") as f:
                    out[(pid, tid)] = (f.read().strip(), int(ran), int(slices))
        except (OSError, ValueError):
            continue  # gone meanwhile
    return out


def other_cpu_text(before: dict, after: dict, seconds: float) -> str:
    """Other processes' CPU time between two `other_threads_cpu` snapshots, with the largest three by name."""
    if not after:
        return "other processes' CPU time: not readable here"
    by_name: collections.Counter = collections.Counter()
    slices: collections.Counter = collections.Counter()
    for key, (name, ran, n) in after.items():
        _, ran0, n0 = before.get(key, (name, 0, 0))
        by_name[name] += ran - ran0
        slices[name] += n - n0
    top = ", ".join(f"{name} {ns / 1e6:.1f} ms in {slices[name]}" for name, ns in by_name.most_common(3) if ns > 0)
    return f"other processes ran {sum(by_name.values()) / 1e6:.1f} ms of CPU in {seconds:.1f} s ({top})"


def cpu_profiler(on: bool) -> torch.profiler.profile | None:
    return torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) if on else None


def print_profile(profiler: torch.profiler.profile | None) -> None:
    """The top ops by their own CPU time (nothing without a profiler)."""
    if profiler is not None:
        print(profiler.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))


def time_phases(engine) -> collections.Counter:
    """Wrap the engine's phases and each decoder layer in timers; returns the seconds spent in each."""
    from moe_serve.server.core import runner as runner_module

    spent = collections.Counter()

    def timed(name, fn):
        def wrapper(*a, **kw):
            t0 = time.perf_counter()
            out = fn(*a, **kw)
            spent[name] += time.perf_counter() - t0
            return out
        return wrapper

    run, model = engine.runner, engine.runner.model
    engine.scheduler.schedule = timed("schedule", engine.scheduler.schedule)
    run._prepare = timed("prepare inputs", run._prepare)
    model.forward = timed("model forward", model.forward)
    model.compute_logits = timed("logits (lm head)", model.compute_logits)
    runner_module.sample = timed("sample", runner_module.sample)
    engine._update = timed("update (stop checks, outputs)", engine._update)
    for i, layer in enumerate(model.model.layers):
        layer.forward = timed(f"layer {i}", layer.forward)
    return spent


def print_phases(spent: collections.Counter, total_s: float, steps: int) -> None:
    phases = {k: v for k, v in spent.items() if not k.startswith("layer ")}
    layers = {k: v for k, v in spent.items() if k.startswith("layer ")}
    other = total_s - sum(phases.values())
    print("         phases, ms per step: " + ", ".join(f"{k} {v / steps * 1e3:.2f}" for k, v in phases.items())
          + f", the rest of the step (recorder, balancer hook, Python) {other / steps * 1e3:.2f}")
    in_layers = sum(layers.values())
    print("         decoder layers, ms per step: " + ", ".join(f"{k.split()[1]}: {v / steps * 1e3:.2f}" for k, v in layers.items())
          + f"; forward outside the layers (embedding, final norm) {(phases['model forward'] - in_layers) / steps * 1e3:.2f}")


def matmul_peak(dtype: torch.dtype, n: int = 2048) -> float:
    """Multiply-add FLOP/s of one n x n x n matmul in `dtype` (best of 5, the engine's threads)."""
    a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
    a @ b
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t0)
    return 2 * n ** 3 / best


def prompt_flops(cfg, num_tokens: int) -> float:
    """FLOPs (2 per multiply-add) of computing one `num_tokens` prompt from scratch, from the model's shapes:
    every linear once per token (a MoE layer: the gate, top-k routed experts and the shared ones), kv_b_proj
    over the context (the decompressed form prompts attend in), and attention over the causal half of the
    L x L score matrix (the useful work: key l <= query i; the float32 path computes it all and masks the
    future, the bf16 path skips most of it). The lm head for the last token only."""
    H, N, C, R = cfg.hidden_size, cfg.num_attention_heads, cfg.kv_lora_rank, cfg.qk_rope_head_dim
    Dn, Dv, T = cfg.qk_nope_head_dim, cfg.v_head_dim, num_tokens
    qk = Dn + R
    q = H * N * qk if cfg.q_lora_rank is None else H * cfg.q_lora_rank + cfg.q_lora_rank * N * qk
    per_token_attn = q + H * (C + R) + N * Dv * H
    total = 0.0
    for i in range(cfg.num_hidden_layers):
        if cfg.is_moe_layer(i):
            experts = cfg.num_experts_per_tok + (cfg.n_shared_experts or 0)
            mlp = 3 * H * cfg.moe_intermediate_size * experts + H * cfg.n_routed_experts
        else:
            mlp = 3 * H * cfg.intermediate_size
        total += 2 * T * (per_token_attn + mlp) + 2 * T * C * N * (Dn + Dv) + N * T * (T + 1) * (qk + Dv)
    return total + 2 * H * cfg.vocab_size


def prefill_against_peak(engine, lengths: list[int], seed: int, repeats: int = 5, profile: bool = False) -> None:
    from moe_serve.server import SamplingParams

    peaks = {"float32": matmul_peak(torch.float32)}
    if cpu_build.cpu_has("avx512_bf16") or cpu_build.cpu_has("amx_bf16"):  # bf16 arithmetic in hardware
        peaks["bfloat16"] = matmul_peak(torch.bfloat16)
    peak_name, peak = max(peaks.items(), key=lambda kv: kv[1])
    print("matmul peak (2048^3, best of 5): " + ", ".join(f"{k} {v / 1e9:.1f} GFLOP/s" for k, v in peaks.items())
          + f"; fractions below are of the {peak_name} one")
    print(f"{'prompt':>8} {'step median ms':>15} {'GFLOP':>8} {'GFLOP/s':>8} {'of peak':>8}")
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    g = torch.Generator().manual_seed(seed)
    for n in lengths:
        if n > engine.config.max_num_batched_tokens:
            raise SystemExit(f"--prefill {n}: above the token budget {engine.config.max_num_batched_tokens}")
        times = []
        profiler = cpu_profiler(profile)
        with profiler or contextlib.nullcontext():
            for r in range(repeats + 1):
                prompt = torch.randint(0, engine.model_config.vocab_size, (n,), generator=g).tolist()
                rid = engine.add_request(prompt, params, request_id=f"prefill-{n}-{r}")
                t0 = time.perf_counter()
                engine.step()
                if r:  # the first one warms up
                    times.append(time.perf_counter() - t0)
                if rid in engine.requests:
                    engine.abort_request(rid)
        median = statistics.median(times)
        flops = prompt_flops(engine.model_config, n)
        print(f"{n:>8} {median * 1e3:>15.1f} {flops / 1e9:>8.2f} {flops / median / 1e9:>8.1f} {flops / median / peak:>8.2f}")
        print_profile(profiler)


def read_bandwidth(num_bytes: int = 1 << 29) -> float:
    """Bytes per second this process reads from memory: a float32 sum over a buffer 16x the L3 cache of this
    machine class, best of 7 (threads as the engine's)."""
    src = torch.ones(num_bytes // 4)
    src.sum()
    best = float("inf")
    for _ in range(7):
        t0 = time.perf_counter()
        src.sum()
        best = min(best, time.perf_counter() - t0)
    return num_bytes / best


def step_bytes(engine, request_ids: list[str]) -> int:
    """What the last decode step had to read at least: every weight once (embedding: one row per token),
    of the routed experts only those its tokens chose (the expert load recorder's last step), and each
    request's cached latents."""
    from moe_serve.moe.model import MoEBlock

    model = engine.runner.model
    chosen_LE = engine.expert_load_recorder.last_step() > 0
    total, j = 0, 0
    for layer in model.model.layers:
        mlp = getattr(layer, "mlp", None)
        if isinstance(mlp, MoEBlock):
            per_slot = sum(t[0].numel() * t.element_size() for t in mlp.experts.slot_tensors())
            total += int(chosen_LE[j].sum()) * per_slot
            j += 1
    routed = {t.data_ptr() for layer in model.model.layers if isinstance(getattr(layer, "mlp", None), MoEBlock)
              for t in layer.mlp.experts.slot_tensors()}
    embed = model.model.embed_tokens.weight
    total += sum(p.numel() * p.element_size() for p in model.parameters()
                 if p.data_ptr() not in routed and p is not embed)
    total += len(request_ids) * embed.shape[1] * embed.element_size()
    cache = engine.runner.kv_caches[0]
    per_token = cache.shape[-1] * cache.element_size() * len(engine.runner.kv_caches)
    total += sum(engine.requests[r].num_tokens for r in request_ids) * per_token
    return total


def time_kernels() -> collections.Counter:
    """Wrap every CPU kernel op (torch.ops.moe_serve.*) in a timer; returns the seconds spent per op."""
    if not cpu_build.available():
        raise SystemExit(f"--kernels: the CPU kernels cannot run here: {cpu_build.unavailable_reason()}")
    spent = collections.Counter()
    ops = torch.ops.moe_serve
    for name in cpu_build.OPS:
        def timed(*args, _fn=getattr(ops, name), _name=name):
            t0 = time.perf_counter()
            out = _fn(*args)
            spent[_name] += time.perf_counter() - t0
            return out
        setattr(ops, name, timed)  # the wrappers look the op up on every call
    return spent

if __name__ == "__main__":
    main()
