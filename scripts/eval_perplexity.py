"""Held-out perplexity of a checkpoint through transformers and through this engine, in float32.

    .venv/bin/python scripts/eval_perplexity.py --model models/tiny-fortunes             # the shipped slice
    .venv/bin/python scripts/eval_perplexity.py --model models/tiny-fortunes --all-held-out  # needs `fortunes`

Documents: the fortunes in the model's heldout.txt (separated by lines holding '%'), or with --all-held-out
every fortune that scripts/train_tiny.py held out (read again from Debian's `fortunes` package). Each one is
scored on its own as <bos> text <eos>: perplexity = exp(mean negative log-likelihood of every token after
<bos>). transformers: its DeepseekV3 forward over the whole document. Ours: the engine's prompt logprobs
(`SamplingParams(prompt_logprobs=0)`: paged MLA cache, chunked prefill, our MoE path).
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch


def documents(model_dir: Path, all_held_out: bool = False) -> list[str]:
    if all_held_out:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from train_tiny import CORPUS_DIR, HELD_OUT_EVERY, read_fortunes

        return read_fortunes(CORPUS_DIR)[::HELD_OUT_EVERY]
    text = (model_dir / "heldout.txt").read_text()
    return [d.strip("\n") for d in text.split("\n%\n") if d.strip()]


def token_docs(tokenizer, docs: list[str], max_len: int) -> list[list[int]]:
    return [(tokenizer.encode(d, add_special_tokens=True) + [tokenizer.eos_token_id])[:max_len] for d in docs]


def nll_reference(model_dir: Path, docs_ids: list[list[int]], model=None) -> tuple[float, int]:
    """Summed NLL and token count through transformers' implementation (float32; `model`, or the checkpoint's)."""
    from moe_serve.moe.tiny import load_reference_model

    model = model if model is not None else load_reference_model(model_dir, torch.float32)
    total, count = 0.0, 0
    with torch.no_grad():
        for ids in docs_ids:
            x = torch.tensor([ids])
            logprobs = model(x).logits[0, :-1].float().log_softmax(-1)
            total -= logprobs.gather(1, x[0, 1:, None]).sum().item()
            count += len(ids) - 1
    return total, count


def nll_engine(llm, docs_ids: list[list[int]]) -> tuple[float, int]:
    """Summed NLL and token count through this engine's prompt logprobs."""
    from moe_serve.server import SamplingParams

    outs = llm.generate(docs_ids, SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0))
    total, count = 0.0, 0
    for ids, out in zip(docs_ids, outs):
        total -= sum(entry[token] for entry, token in zip(out.prompt_logprobs[1:], ids[1:]))
        count += len(ids) - 1
    return total, count


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="models/tiny-fortunes")
    ap.add_argument("--all-held-out", action="store_true")
    ap.add_argument("--max-len", type=int, default=256, help="tokens per document at most (as in training)")
    args = ap.parse_args()
    from moe_serve.server import LLM

    model_dir = Path(args.model)
    llm = LLM(str(model_dir), dtype="float32")
    docs_ids = token_docs(llm.tokenizer, documents(model_dir, args.all_held_out), args.max_len)
    ref_nll, n = nll_reference(model_dir, docs_ids)
    our_nll, n2 = nll_engine(llm, docs_ids)
    assert n == n2
    ref_ppl, our_ppl = math.exp(ref_nll / n), math.exp(our_nll / n)
    print(f"{len(docs_ids)} documents, {n} scored tokens")
    print(f"perplexity, transformers (float32): {ref_ppl:.4f}")
    print(f"perplexity, moe-serve engine (float32): {our_ppl:.4f}")
    print(f"relative difference: {abs(our_ppl - ref_ppl) / ref_ppl:.2e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
