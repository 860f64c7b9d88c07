"""`moe` command line: `moe generate`, `moe serve`, `moe report`, `moe plan`, `moe make-checkpoint`, `moe bench serve` (and `python -m moe_serve.server ...`)."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path

# The embedded default: the small trained model shipped in a checkout (models/tiny-fortunes), else a random
# tiny checkpoint made on first use.
_SHIPPED = Path(__file__).resolve().parents[1] / "models" / "tiny-fortunes"
DEFAULT_MODEL = _SHIPPED if (_SHIPPED / "config.json").exists() else Path(".cache/tiny-v3")
DEFAULT_PROMPTS = [
    "The expert router sends each token to",
    "Once upon a time",
    "Mixture-of-experts models are fast because",
    "Hello, world!",
]


def _setup_logging(verbose: bool, who: str = "rank 0") -> None:
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING,
                        format=f"%(asctime)s [{who}] %(name)s: %(message)s", datefmt="%H:%M:%S", force=True)


def _add_engine_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dtype", default="auto", help="float32 | bfloat16 | float16 | auto (the checkpoint's)")
    p.add_argument("--kernel-backend", default="auto", choices=("auto", "torch", "cpu", "cuda"),
                   help="how the model's ops run: cuda (Triton + torch CUDA), cpu (C kernels: x86 AVX2 + FMA, "
                        "float32 activations on bf16 / FP8 weights), torch (plain torch, the reference); "
                        "auto: cuda on GPUs, else cpu where it builds, else torch")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--prompt-spread-ms", type=float, default=0.0,
                   help="while decodes run, spread a new prompt's tokens evenly over the steps of up to this many ms "
                        "(its first token comes about that much later) so that running streams keep an even pace "
                        "instead of stalling on one long chunk; 0 (default) = as many prompt tokens per step as the "
                        "budget allows (docs/benchmarks.md, \"Serving speed, round 2\": when spreading pays)")
    p.add_argument("--min-prompt-chunk", type=int, default=16,
                   help="with --prompt-spread-ms, the fewest prompt tokens a step carries while prompts wait (16 with a "
                        "spread of 300 and a latest due time of 450 ms gave the lowest inter-token p99 near "
                        "saturation in docs/benchmarks.md; smaller slices even out steps at light load but cost "
                        "more a token)")
    p.add_argument("--prompt-slowdown", type=float, default=0.0,
                   help="with --prompt-spread-ms: while decodes run, waiting prompts get as many tokens a step as keep "
                        "the step within this many times what its decodes alone take (from a fit of the measured "
                        "step times), and more only where a prompt would miss arrival + the spread: prompts start "
                        "sooner, streams are less even (docs/benchmarks.md); 0 (default) = off (the spread's even "
                        "rate alone)")
    p.add_argument("--prompt-spread-max-ms", type=float, default=0.0,
                   help="with --prompt-spread-ms: when arrivals bunch up, prompts may take up to this many ms instead; "
                        "until then a step carries at most 1.2x the prompt tokens steps have carried lately, so a "
                        "cluster of prompts stretches rather than piling into a few long steps (docs/benchmarks.md); "
                        "0 (default) = off")
    p.add_argument("--kv-cache-tokens", type=int, default=32768)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--step-trace", default=None, metavar="FILE",
                   help="append a line per engine step to FILE: start and end (CLOCK_MONOTONIC seconds), decodes, "
                        "prompt tokens, outputs; FILE.rankN per rank under torchrun (server/core/step_trace.py)")


def _engine_kwargs(args: argparse.Namespace) -> dict:
    return dict(dtype=args.dtype, kernel_backend=args.kernel_backend, max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
                max_num_batched_tokens=args.max_num_batched_tokens, prompt_spread_ms=args.prompt_spread_ms,
                min_prompt_chunk=args.min_prompt_chunk, prompt_slowdown=args.prompt_slowdown,
                prompt_spread_max_ms=args.prompt_spread_max_ms,
                kv_cache_tokens=args.kv_cache_tokens,
                block_size=args.block_size, enable_prefix_caching=args.enable_prefix_caching, seed=args.seed,
                step_trace=args.step_trace)


def cmd_generate(args: argparse.Namespace) -> int:
    from moe_serve.server import LLM, SamplingParams

    model = Path(args.model)
    if args.model == str(DEFAULT_MODEL) and not (model / "config.json").exists():
        from moe_serve.moe.tiny import make_checkpoint

        print(f"making the embedded default checkpoint in {model} ...", flush=True)
        make_checkpoint(model, "v3")
    llm = LLM(str(model), **_engine_kwargs(args))
    prompts = args.prompt or DEFAULT_PROMPTS
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, seed=args.sample_seed)
    t0 = time.perf_counter()
    outputs = llm.generate(prompts, params)
    seconds = time.perf_counter() - t0
    n_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    for prompt, out in zip(prompts, outputs):
        c = out.outputs[0]
        print(f"prompt: {prompt!r}\n  -> {c.text!r}  ({len(c.token_ids)} tokens, finish_reason={c.finish_reason})")
    print(f"{len(outputs)} requests, {n_tokens} generated tokens in {seconds:.2f} s: {n_tokens / seconds:.1f} tokens/s")
    return 0


def cmd_make_checkpoint(args: argparse.Namespace) -> int:
    from moe_serve.moe.tiny import make_checkpoint

    out = make_checkpoint(args.out, args.preset, dtype=args.dtype, seed=args.seed, fp8=args.fp8)
    print(f"wrote {args.preset} checkpoint to {out}")
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from moe_serve.moe.config import ModelConfig
    from moe_serve.server.core.config import EngineConfig

    eplb = json.loads(args.eplb_config) if args.eplb_config else {}
    if not isinstance(eplb, dict):
        raise ValueError("--eplb-config must be a JSON object, e.g. '{\"window\": 1000, \"interval\": 3000}'")
    unknown = sorted(set(eplb) - {"window", "interval", "layers_per_step", "num_redundant_experts", "min_gain",
                                  "plan_steps"})
    if unknown:
        raise ValueError(f"--eplb-config has unknown field(s) {unknown}; known: window, interval, layers_per_step, "
                         "num_redundant_experts, min_gain, plan_steps")
    kwargs = dict(model=args.model, **_engine_kwargs(args), eplb_window=eplb.get("window", args.expert_load_window),
                  tensor_parallel_size=args.tensor_parallel_size, pipeline_parallel_size=args.pipeline_parallel_size,
                  data_parallel_size=args.data_parallel_size, enable_expert_parallel=args.enable_expert_parallel,
                  enable_eplb=args.enable_eplb, eplb_interval=eplb.get("interval", 3000),
                  eplb_layers_per_step=eplb.get("layers_per_step", 1), eplb_min_gain=eplb.get("min_gain", 0.01),
                  eplb_plan_steps=eplb.get("plan_steps", 2),
                  num_redundant_experts=eplb.get("num_redundant_experts", args.num_redundant_experts),
                  expert_placement=args.expert_placement, collective_timeout_s=args.collective_timeout)
    EngineConfig(**kwargs)  # bad flags fail here, with one line, before any process starts
    ModelConfig.from_dir(args.model)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    secret = args.frontend_secret or os.environ.get("MOE_FRONTEND_SECRET") or None
    if args.frontend_only:
        return _serve_frontend_only(args, kwargs, secret, world)
    if world != EngineConfig(**kwargs).parallel_config().world_size:
        raise ValueError(f"the layout -pp {args.pipeline_parallel_size} x -dp {args.data_parallel_size} x "
                         f"-tp {args.tensor_parallel_size} needs that many ranks; launch with "
                         f"torchrun --nproc-per-node N -m moe_serve.server serve ... (now {world})")
    if world > 1 and int(os.environ["RANK"]) != 0:
        from moe_serve.server.frontend.engine_loop import run_follower

        _setup_logging(args.verbose, f"rank {os.environ['RANK']}")
        run_follower(kwargs)  # rank 0 runs the front end; its engine process is rank 0 of the job
        return 0
    if args.frontend_address:  # an engine job for a front end running on its own: rank 0 attaches to it
        from moe_serve.server.frontend.engine_loop import run_engine_process

        level = logging.INFO if args.verbose else logging.WARNING
        print(f"moe serve: engine job of {world} rank(s) attaching to the front end at {args.frontend_address}",
              file=sys.stderr, flush=True)
        run_engine_process(kwargs, args.frontend_address, secret, level, log_tag="rank 0")
        return 0

    from moe_serve.server.frontend.api import run_server

    print(f"moe serve: {args.model} on http://{args.host}:{args.port} (GET /ready answers 200 once warmed up)",
          file=sys.stderr, flush=True)
    run_server(_server_args(args, kwargs), args.host, args.port)
    return 0


def _server_args(args: argparse.Namespace, kwargs: dict, **frontend) -> "ServerArgs":
    """The front end's settings from `moe serve` flags (frontend: where it listens when it runs alone)."""
    from moe_serve.server.frontend.api import ServerArgs

    if args.max_waiting_requests < 0:
        raise ValueError(f"--max-waiting-requests must be >= 0, got {args.max_waiting_requests}")
    return ServerArgs(engine_kwargs=kwargs, served_model_names=args.served_model_name or [], api_key=args.api_key,
                      log_level=logging.INFO if args.verbose else logging.WARNING,
                      max_waiting_requests=args.max_waiting_requests,
                      heartbeat_timeout_s=args.engine_heartbeat_timeout, **frontend)


def _serve_frontend_only(args: argparse.Namespace, kwargs: dict, secret: str | None, world: int) -> int:
    """`moe serve MODEL --frontend-only --frontend-address tcp://HOST:PORT`: HTTP here, engines attach."""
    from moe_serve.server.frontend.api import run_server
    from moe_serve.server.frontend.engine_link import check_listen_address

    if world > 1:
        raise ValueError("--frontend-only runs one process, not under torchrun; start the engine job under torchrun "
                         "with --frontend-address instead")
    if not args.frontend_address:
        raise ValueError("--frontend-only needs --frontend-address tcp://HOST:PORT for engine jobs to attach to")
    check_listen_address(args.frontend_address, secret)
    _setup_logging(args.verbose, "front end")  # not a rank of any job
    if args.reattach_timeout <= 0:
        raise ValueError(f"--reattach-timeout must be > 0 seconds, got {args.reattach_timeout}")
    print(f"moe serve: front end for {args.model} on http://{args.host}:{args.port}; engine jobs attach at "
          f"{args.frontend_address}", file=sys.stderr, flush=True)
    run_server(_server_args(args, kwargs, frontend_address=args.frontend_address, frontend_secret=secret,
                            reattach_timeout_s=args.reattach_timeout), args.host, args.port)
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    from moe_serve.balancer.placement_file import format_what_if, read_load_file, what_if

    dump = read_load_file(args.load)
    if dump["load"] is None:
        raise ValueError(f"{args.load} has no logical_counts to plan from")
    expert_bytes = None
    if args.model:
        from moe_serve.moe.config import ModelConfig

        mc = ModelConfig.from_dir(args.model)
        itemsize = {"float32": 4, "float16": 2, "bfloat16": 2}.get(mc.torch_dtype or "bfloat16", 2)
        expert_bytes = 3 * mc.hidden_size * mc.moe_intermediate_size * itemsize
    routing = {"num_groups": args.groups or 1, "topk_group": args.topk_group or 1, "topk": args.topk or 8}
    token_bytes = None
    if args.model:
        routing = {"num_groups": args.groups or mc.n_group or 1, "topk_group": args.topk_group or mc.topk_group or 1,
                   "topk": args.topk or mc.num_experts_per_tok}
        token_bytes = mc.hidden_size * itemsize
    report = what_if(dump["load"], args.ep, args.redundant, args.nodes, current_LR=dump["phy2log"],
                     expert_bytes=expert_bytes, layer_ids=dump["layer_ids"], token_bytes=token_bytes, **routing)
    print(format_what_if(report))
    if args.out:
        Path(args.out).write_text(json.dumps({"layer_ids": dump["layer_ids"], "num_experts": report["num_experts"],
                                              "ep_size": args.ep, "logical_counts": dump["load"].tolist(),
                                              "placement": {"phy2log": report["phy2log"]}}))
        print(f"placement written to {args.out} (start a server from it with --expert-placement)")
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    from moe_serve.server.tools.report import main as report_main

    return report_main(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="moe", description="Expert-parallel serving of DeepSeek-style MoE models")
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress (loading shards, KV cache)")
    sub = parser.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="generate offline from a few prompts and print tokens/s")
    g.add_argument("model", nargs="?", default=str(DEFAULT_MODEL),
                   help=f"checkpoint directory (default: the embedded tiny model, made in {DEFAULT_MODEL} if missing)")
    g.add_argument("--prompt", action="append", help="a prompt (repeatable); default: a few built-in ones")
    g.add_argument("--max-tokens", type=int, default=32)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--sample-seed", type=int, default=None)
    _add_engine_flags(g)
    g.set_defaults(func=cmd_generate)
    s = sub.add_parser("serve", help="serve a checkpoint over an OpenAI-compatible HTTP API")
    s.add_argument("model", help="checkpoint directory")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--served-model-name", nargs="+", default=None,
                   help="model name(s) the API accepts and reports (default: the MODEL argument)")
    s.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1/* routes")
    s.add_argument("--max-waiting-requests", type=int, default=256,
                   help="engine requests admitted beyond those that run at once (max-num-seqs x DP ranks); "
                        "past it new requests get 503 with Retry-After")
    s.add_argument("-tp", "--tensor-parallel-size", type=int, default=1)
    s.add_argument("-pp", "--pipeline-parallel-size", type=int, default=1)
    s.add_argument("-dp", "--data-parallel-size", type=int, default=1)
    s.add_argument("--enable-expert-parallel", action="store_true",
                   help="experts over the TP x DP ranks (EP size 1 with a single rank)")
    s.add_argument("--enable-eplb", action="store_true", help="rebalance expert placement while serving (needs EP)")
    s.add_argument("--eplb-config", default=None,
                   help='JSON: {"window": steps, "interval": steps, "layers_per_step": n, "num_redundant_experts": n, '
                        '"min_gain": balancedness gain a re-plan must bring (default 0.01)}')
    s.add_argument("--num-redundant-experts", type=int, default=0, help="extra expert slots per MoE layer (needs EP)")
    s.add_argument("--expert-placement", default=None, help="start from this placement file or load dump (JSON)")
    s.add_argument("--collective-timeout", type=float, default=60.0,
                   help="seconds a collective may take before the job ends naming the lost rank(s)")
    s.add_argument("--frontend-only", action="store_true",
                   help="run the HTTP front end alone; engine jobs (torchrun ... serve --frontend-address) attach "
                        "to it, and one restarted after losing a rank attaches again (docs/reliability.md)")
    s.add_argument("--frontend-address", default=None,
                   help="tcp://HOST:PORT: with --frontend-only, where the front end listens for engine jobs "
                        "(loopback unless a secret is set); without it, the front end this engine job attaches to")
    s.add_argument("--frontend-secret", default=None,
                   help="shared secret an engine job presents to the front end (default: $MOE_FRONTEND_SECRET); "
                        "required when the front end listens beyond loopback")
    s.add_argument("--reattach-timeout", type=float, default=300.0,
                   help="--frontend-only: seconds without an engine attached after which requests in flight fail "
                        "with 503 (the engine job's restarts are taken to be exhausted)")
    s.add_argument("--engine-heartbeat-timeout", type=float, default=30.0,
                   help="seconds of silence after which the engine counts as lost (/health 503)")
    s.add_argument("--expert-load-window", type=int, default=1000,
                   help="engine steps the expert-load window holds (GET /v1/expert_load, moe_expert_balancedness)")
    _add_engine_flags(s)
    s.set_defaults(func=cmd_serve)
    r = sub.add_parser("report", help="expert-load heatmaps and a text summary from a server or a dump")
    src = r.add_mutually_exclusive_group(required=True)
    src.add_argument("--url", help="server base URL: reads GET URL/v1/expert_load")
    src.add_argument("--file", help="a JSON dump (from /v1/expert_load or /dump_expert_distribution_record)")
    r.add_argument("--out", required=True, help="directory for the PNGs and summary.txt")
    r.add_argument("--view", default="window", choices=["window", "total", "record"], help="with --url: which counts")
    r.add_argument("--api-key", default=None)
    r.add_argument("--ep-size", type=int, default=None,
                   help="EP ranks to show and simulate (default: the dump's; 1 = each expert its own unit)")
    r.add_argument("--extra-replicas", type=int, default=None,
                   help="replicas to add to the hottest experts in the simulation (default: one per EP rank, "
                        "or an eighth of the experts with EP size 1)")
    r.set_defaults(func=cmd_report)
    pl = sub.add_parser("plan", help="what-if: predicted balance of re-planning expert placement from a load dump")
    pl.add_argument("--load", required=True, help="a load dump (GET /v1/expert_load, /dump_expert_distribution_record)")
    pl.add_argument("--ep", type=int, required=True, help="expert-parallel ranks")
    pl.add_argument("--redundant", type=int, default=0, help="redundant expert slots per MoE layer")
    pl.add_argument("--nodes", type=int, default=1)
    pl.add_argument("--model", default=None, help="checkpoint dir: prices the redundant slots' memory and a token's "
                    "bytes, and gives the routing (groups, top-k) that cross-node figures sample")
    pl.add_argument("--groups", type=int, default=None, help="expert groups (default: the model's, else 1)")
    pl.add_argument("--topk-group", type=int, default=None, help="groups a token may use (default: the model's)")
    pl.add_argument("--topk", type=int, default=None, help="experts per token (default: the model's, else 8)")
    pl.add_argument("--out", default=None, help="write the planned placement here (JSON)")
    pl.set_defaults(func=cmd_plan)
    bench_p = sub.add_parser("bench", help="benchmarks; `moe bench serve`: goodput, TTFT and TPOT against a server")
    bench_sub = bench_p.add_subparsers(dest="bench_command", required=True)
    from moe_serve.server.tools import bench  # stdlib-only at import

    bs = bench_sub.add_parser("serve", help="open-loop Poisson replay against an OpenAI-compatible server on this host",
                              description=bench.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    bench.add_arguments(bs)
    bs.set_defaults(func=bench.run_cli)
    m = sub.add_parser("make-checkpoint", help="write a small random DeepSeek-style checkpoint (HF format)")
    m.add_argument("--out", required=True)
    m.add_argument("--preset", default="v3")
    m.add_argument("--dtype", default=None)
    m.add_argument("--seed", type=int, default=0)
    m.add_argument("--fp8", action="store_true")
    m.set_defaults(func=cmd_make_checkpoint)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    _setup_logging(args.verbose)
    try:
        return args.func(args)
    except ValueError as exc:  # bad input: one line naming the problem, no traceback
        print(f"moe: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
