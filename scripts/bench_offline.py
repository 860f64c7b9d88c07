"""Offline throughput: `LLM.generate` against transformers `generate`, same prompts, weights and dtype;
parallel layouts under torchrun; a profile of one engine step.

Not a test. Prints a table of generated tokens/s per request count and the ratio, in one run.
    python scripts/bench_offline.py --preset bench --dtype bfloat16 --num-requests 1 32

Parallel layouts (each launched with torchrun, one process per rank, OMP_NUM_THREADS=1, bounded by
--layout-timeout-s); "single" is the in-process run above, with the transformers comparison:
    python scripts/bench_offline.py --num-requests 8 32 --layouts single tp2 pp2 dp2-ep tp2-ep
A layout name is tpN / ppN / dpN parts joined by "-", plus "ep" for expert parallelism.

Where one engine step's time goes (torch.profiler, top ops by self CPU time; a decode step with N running
requests, and the prefill step before it):
    python scripts/bench_offline.py --num-requests 1 --profile-step 64
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path


import torch  # noqa: E402

from moe_serve.moe.tiny import ensure_checkpoint, load_reference_model  # noqa: E402
from moe_serve.parallel.launch import free_port  # noqa: E402
from moe_serve.server import LLM, SamplingParams  # noqa: E402


def make_prompts(n: int, vocab: int, seed: int, min_len: int, max_len: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(min_len, max_len))] for _ in range(n)]


def bench_hf(model, prompts: list[list[int]], max_tokens: int, pad_id: int) -> float:
    """Batched transformers generate with left padding (how it is used for batch throughput)."""
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    t0 = time.perf_counter()
    with torch.no_grad():
        model.generate(ids, attention_mask=mask, max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                       do_sample=False, pad_token_id=pad_id)
    return time.perf_counter() - t0


def bench_engine(llm: LLM, prompts: list[list[int]], max_tokens: int) -> float:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    seconds = time.perf_counter() - t0
    assert all(len(o.outputs[0].token_ids) == max_tokens for o in outs)
    return seconds


# ---- parallel layouts ------------------------------------------------------------------------------
def parse_layout(name: str) -> tuple[dict, int]:
    """"tp2-ep" -> ({"tensor_parallel_size": 2, "enable_expert_parallel": True}, world size 2)."""
    keys = {"tp": "tensor_parallel_size", "pp": "pipeline_parallel_size", "dp": "data_parallel_size"}
    layout: dict = {}
    for part in name.split("-"):
        m = re.fullmatch(r"(tp|pp|dp)(\d+)", part)
        if m:
            layout[keys[m[1]]] = int(m[2])
        elif part == "ep":
            layout["enable_expert_parallel"] = True
        else:
            raise ValueError(f"layout {name!r}: part {part!r} is not tpN, ppN, dpN or ep")
    world = 1
    for k in keys.values():
        world *= layout.get(k, 1)
    return layout, world


def run_worker(args: argparse.Namespace) -> None:
    """Under torchrun: every rank builds the engine and generates the same prompts; rank 0 writes JSON."""
    layout, world = parse_layout(args.layout)
    if int(os.environ.get("WORLD_SIZE", "1")) != world:
        raise SystemExit(f"layout {args.layout} needs {world} ranks; torchrun started {os.environ.get('WORLD_SIZE')}")
    ckpt = Path(args.model or f".cache/{args.preset}")
    llm = LLM(str(ckpt), dtype=args.dtype, max_num_seqs=args.max_num_seqs, max_num_batched_tokens=2048, **layout)
    vocab = llm.engine.model_config.vocab_size
    bench_engine(llm, make_prompts(2, vocab, 99, 8, 16), 4)
    rows = []
    for n in args.num_requests:
        prompts = make_prompts(n, vocab, args.seed + n, args.min_len, args.max_len)
        seconds = bench_engine(llm, prompts, args.max_tokens)
        rows.append({"layout": args.layout, "world_size": world, "requests": n,
                     "prompt_tokens": sum(map(len, prompts)), "generated_tokens": n * args.max_tokens,
                     "engine_tok_s": n * args.max_tokens / seconds, "seconds": seconds})
    if llm.engine.parallel.rank == 0 and args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "stats": llm.stats()}))


def run_layout(args: argparse.Namespace, name: str) -> list[dict]:
    """Launch this script under torchrun for one layout; returns its rows (or one row with the error)."""
    _, world = parse_layout(name)
    out = Path(tempfile.mkstemp(prefix=f"bench-offline-{name}-", suffix=".json")[1])
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(world), "--master-addr", "127.0.0.1",
           "--master-port", str(free_port()), __file__, "--worker", "--layout", name, "--preset", args.preset,
           "--dtype", args.dtype, "--max-tokens", str(args.max_tokens), "--min-len", str(args.min_len),
           "--max-len", str(args.max_len), "--seed", str(args.seed), "--max-num-seqs", str(args.max_num_seqs),
           "--json", str(out), "--num-requests", *map(str, args.num_requests)]
    if args.model:
        cmd += ["--model", args.model]
    threads = max(1, (os.cpu_count() or 1) // world)
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONUNBUFFERED": "1"}
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.layout_timeout_s,
                              start_new_session=True)
        if proc.returncode != 0:
            return [{"layout": name, "world_size": world, "error": (proc.stdout + proc.stderr)[-1500:]}]
        rows = json.loads(out.read_text())["rows"]
        for r in rows:
            r["threads_per_rank"] = threads
        return rows
    except subprocess.TimeoutExpired:
        return [{"layout": name, "world_size": world, "error": f"timed out after {args.layout_timeout_s} s"}]
    finally:
        out.unlink(missing_ok=True)


# ---- one engine step under the profiler ------------------------------------------------------------
_RANGED = re.compile(r"(^model$|^lm_head$|embed_tokens$|layers\.\d+\.(self_attn|mlp|mlp\.gate|mlp\.shared_experts|"
                     r"input_layernorm|post_attention_layernorm)$)")


def module_ranges(model: torch.nn.Module) -> list:
    """Wrap the main modules' forwards in profiler ranges named "## <module> (<class>)" (hooks only: the
    model code is untouched). Returns the hook handles; remove them when done."""
    from torch.profiler import record_function

    handles = []
    for name, mod in model.named_modules():
        if not _RANGED.search(name):
            continue
        label = "## " + re.sub(r"layers\.\d+\.", "", name.removeprefix("model.") or "model forward") + \
            f" ({type(mod).__name__})"

        def pre(m, _args, label=label):
            rf = record_function(label)
            rf.__enter__()
            m.__dict__.setdefault("_prof_ranges", []).append(rf)

        def post(m, _args, _out):
            m.__dict__["_prof_ranges"].pop().__exit__(None, None, None)

        handles += [mod.register_forward_pre_hook(pre), mod.register_forward_hook(post)]
    return handles


def profile_step(llm: LLM, n: int, prompt_len: int, top: int = 20) -> dict:
    """Profile the first (prefill) step and one decode step with `n` running requests: top ops by self CPU
    time, and time per module (inclusive; the rest of the step is scheduling, batch building, sampling)."""
    from torch.profiler import ProfilerActivity, profile

    engine = llm.engine
    vocab = engine.model_config.vocab_size
    prompts = make_prompts(n, vocab, 7, prompt_len, prompt_len)
    params = SamplingParams(max_tokens=10_000, temperature=0.0, ignore_eos=True)
    ids = [engine.add_request(p, params, request_id=f"profile-{i}") for i, p in enumerate(prompts)]
    out: dict = {"requests": n, "prompt_len": prompt_len, "threads": torch.get_num_threads(),
                 "max_num_batched_tokens": engine.config.max_num_batched_tokens}
    handles = module_ranges(engine.runner.model)
    try:
        for phase in ("prefill", "decode"):
            if phase == "decode":  # finish every prefill first: the next step is decode only
                while any(engine.requests[r].num_output_tokens == 0 for r in ids):
                    engine.step()
                engine.step()
            with profile(activities=[ProfilerActivity.CPU], record_shapes=False) as prof:
                t0 = time.perf_counter()
                engine.step()
                wall = time.perf_counter() - t0
            avg = prof.key_averages()
            ops = sorted((e for e in avg if not e.key.startswith("## ")), key=lambda e: e.self_cpu_time_total,
                         reverse=True)
            total = sum(e.self_cpu_time_total for e in ops) or 1
            mods = sorted((e for e in avg if e.key.startswith("## ")), key=lambda e: e.cpu_time_total, reverse=True)
            out[phase] = {"wall_ms": wall * 1000,
                          "table": avg.table(sort_by="self_cpu_time_total", row_limit=top),
                          "top_ops": [{"op": e.key, "self_cpu_ms": e.self_cpu_time_total / 1000, "count": e.count,
                                       "share": e.self_cpu_time_total / total} for e in ops[:top]],
                          "modules": [{"module": e.key[3:], "cpu_ms": e.cpu_time_total / 1000, "count": e.count,
                                       "share_of_step": e.cpu_time_total / 1000 / (wall * 1000)} for e in mods]}
    finally:
        for h in handles:
            h.remove()
        for r in ids:
            engine.abort_request(r)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="bench")
    ap.add_argument("--model", default=None, help="checkpoint dir (default: .cache/<preset>, made if missing)")
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--num-requests", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--min-len", type=int, default=16)
    ap.add_argument("--max-len", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--layouts", nargs="+", default=["single"],
                    help="single (in process, with transformers) and/or torchrun layouts: tp2, pp2, dp2-ep, tp2-ep, ...")
    ap.add_argument("--layout-timeout-s", type=float, default=600.0)
    ap.add_argument("--profile-step", type=int, default=0, metavar="N",
                    help="also profile one prefill and one decode step with N requests")
    ap.add_argument("--profile-prompt-len", type=int, default=128)
    ap.add_argument("--json", default=None, help="also write results here")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--layout", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        run_worker(args)
        return
    for name in args.layouts:
        if name != "single":
            parse_layout(name)  # bad names fail before anything runs
    ckpt = Path(args.model or f".cache/{args.preset}")
    ensure_checkpoint(ckpt, args.preset)
    rows, layout_rows, profile = [], [], None
    if "single" in args.layouts or args.profile_step:
        dtype = getattr(torch, args.dtype)
        llm = LLM(str(ckpt), dtype=args.dtype, max_num_seqs=args.max_num_seqs, max_num_batched_tokens=2048)
        vocab = llm.engine.model_config.vocab_size
        warm = make_prompts(2, vocab, 99, 8, 16)
        bench_engine(llm, warm, 4)
        if "single" in args.layouts:
            hf = load_reference_model(ckpt, dtype, attn_implementation="sdpa")
            pad_id = llm.tokenizer.pad_token_id or 0
            bench_hf(hf, warm, 4, pad_id)
            for n in args.num_requests:
                prompts = make_prompts(n, vocab, args.seed + n, args.min_len, args.max_len)
                t_hf = bench_hf(hf, prompts, args.max_tokens, pad_id)
                t_ours = bench_engine(llm, prompts, args.max_tokens)
                toks = n * args.max_tokens
                rows.append({"requests": n, "prompt_tokens": sum(map(len, prompts)), "generated_tokens": toks,
                             "transformers_tok_s": toks / t_hf, "engine_tok_s": toks / t_ours, "ratio": t_hf / t_ours})
            del hf
        if args.profile_step:
            profile = profile_step(llm, args.profile_step, args.profile_prompt_len)
        del llm
    for name in args.layouts:
        if name != "single":
            layout_rows += run_layout(args, name)
    print(f"checkpoint {ckpt} ({args.preset}), dtype {args.dtype}, {args.max_tokens} tokens per request, "
          f"prompts {args.min_len}-{args.max_len} tokens; torch {torch.__version__}, {platform.machine()}, "
          f"{torch.get_num_threads()} threads")
    if rows:
        print(f"{'requests':>8} {'prompt tok':>10} {'transformers tok/s':>19} {'engine tok/s':>13} {'ratio':>6}")
        for r in rows:
            print(f"{r['requests']:>8} {r['prompt_tokens']:>10} {r['transformers_tok_s']:>19.1f} "
                  f"{r['engine_tok_s']:>13.1f} {r['ratio']:>5.2f}x")
    if layout_rows:
        single = {r["requests"]: r["engine_tok_s"] for r in rows}
        print(f"\n{'layout':>12} {'ranks':>5} {'requests':>8} {'engine tok/s':>13} {'vs single':>9}")
        for r in layout_rows:
            if "error" in r:
                lines = r["error"].strip().splitlines()
                cause = next((ln for ln in reversed(lines) if re.search(r"Error|exitcode|lost rank|terminate", ln)), lines[-1])
                print(f"{r['layout']:>12} {r['world_size']:>5} failed: {cause.strip()[:150]}")
                continue
            vs = f"{r['engine_tok_s'] / single[r['requests']]:.2f}x" if r["requests"] in single else "-"
            print(f"{r['layout']:>12} {r['world_size']:>5} {r['requests']:>8} {r['engine_tok_s']:>13.1f} {vs:>9}")
    if profile:
        for phase in ("prefill", "decode"):
            p = profile[phase]
            what = (f"first step (prefill: up to {profile['max_num_batched_tokens']} prompt tokens)" if phase == "prefill"
                    else "decode step")
            print(f"\n{what}, {profile['requests']} requests x {profile['prompt_len']} prompt tokens: "
                  f"{p['wall_ms']:.1f} ms ({profile['threads']} threads)")
            print(f"{'module (summed over layers)':>44} {'calls':>5} {'ms':>8} {'of step':>7}")
            for m in p["modules"]:
                print(f"{m['module']:>44} {m['count']:>5} {m['cpu_ms']:>8.1f} {m['share_of_step']:>6.0%}")
            print(f"{'op':>44} {'calls':>5} {'self ms':>8} {'of ops':>7}")
            for o in p["top_ops"][:12]:
                print(f"{o['op']:>44} {o['count']:>5} {o['self_cpu_ms']:>8.1f} {o['share']:>6.0%}")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "rows": rows, "layouts": layout_rows,
                                               "profile": profile}, indent=2))


if __name__ == "__main__":
    main()
