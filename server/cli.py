"""`moe` command line: `moe generate`, `moe make-checkpoint` (and `python -m server ...`)."""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

DEFAULT_MODEL = Path(".cache/tiny-v3")
DEFAULT_PROMPTS = [
    "The expert router sends each token to",
    "Once upon a time",
    "Mixture-of-experts models are fast because",
    "Hello, world!",
]


def _setup_logging(verbose: bool) -> None:
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING,
                        format="%(asctime)s [rank 0] %(name)s: %(message)s", datefmt="%H:%M:%S")


def _add_engine_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dtype", default="auto", help="float32 | bfloat16 | float16 | auto (the checkpoint's)")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--kv-cache-tokens", type=int, default=32768)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--seed", type=int, default=0)


def _engine_kwargs(args: argparse.Namespace) -> dict:
    return dict(dtype=args.dtype, max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
                max_num_batched_tokens=args.max_num_batched_tokens, kv_cache_tokens=args.kv_cache_tokens,
                block_size=args.block_size, enable_prefix_caching=args.enable_prefix_caching, seed=args.seed)


def cmd_generate(args: argparse.Namespace) -> int:
    from server import LLM, SamplingParams

    model = Path(args.model)
    if args.model == str(DEFAULT_MODEL) and not (model / "config.json").exists():
        from moe.tiny import make_checkpoint

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
    from moe.tiny import make_checkpoint

    out = make_checkpoint(args.out, args.preset, dtype=args.dtype, seed=args.seed, fp8=args.fp8)
    print(f"wrote {args.preset} checkpoint to {out}")
    return 0


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
