"""Offline throughput: `LLM.generate` against transformers `generate`, same prompts, weights and dtype.

Not a test. Prints a table of generated tokens/s per request count and the ratio, in one run.
    python scripts/bench_offline.py --preset bench --dtype bfloat16 --num-requests 1 32
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from moe.tiny import ensure_checkpoint, load_reference_model  # noqa: E402
from server import LLM, SamplingParams  # noqa: E402


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
    ap.add_argument("--json", default=None, help="also write results here")
    args = ap.parse_args()
    ckpt = Path(args.model or f".cache/{args.preset}")
    ensure_checkpoint(ckpt, args.preset)
    dtype = getattr(torch, args.dtype)
    llm = LLM(str(ckpt), dtype=args.dtype, max_num_seqs=64, max_num_batched_tokens=2048)
    hf = load_reference_model(ckpt, dtype, attn_implementation="sdpa")
    pad_id = llm.tokenizer.pad_token_id or 0
    vocab = llm.engine.model_config.vocab_size
    warm = make_prompts(2, vocab, 99, 8, 16)
    bench_engine(llm, warm, 4)
    bench_hf(hf, warm, 4, pad_id)
    rows = []
    for n in args.num_requests:
        prompts = make_prompts(n, vocab, args.seed + n, args.min_len, args.max_len)
        t_hf = bench_hf(hf, prompts, args.max_tokens, pad_id)
        t_ours = bench_engine(llm, prompts, args.max_tokens)
        toks = n * args.max_tokens
        rows.append({"requests": n, "prompt_tokens": sum(map(len, prompts)), "generated_tokens": toks,
                     "transformers_tok_s": toks / t_hf, "engine_tok_s": toks / t_ours, "ratio": t_hf / t_ours})
    print(f"checkpoint {ckpt} ({args.preset}), dtype {args.dtype}, {args.max_tokens} tokens per request, "
          f"prompts {args.min_len}-{args.max_len} tokens; torch {torch.__version__}, {platform.machine()}, "
          f"{torch.get_num_threads()} threads")
    print(f"{'requests':>8} {'prompt tok':>10} {'transformers tok/s':>19} {'engine tok/s':>13} {'ratio':>6}")
    for r in rows:
        print(f"{r['requests']:>8} {r['prompt_tokens']:>10} {r['transformers_tok_s']:>19.1f} {r['engine_tok_s']:>13.1f} "
              f"{r['ratio']:>5.2f}x")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
