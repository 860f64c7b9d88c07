"""Per-token cost of the front end's output processing over a long generation with a stop string.

    .venv/bin/python scripts/bench_output_processor.py --tokens 2000 --repeats 5

Feeds 2,000 token ids one engine output at a time to `RequestState` (incremental detokenization, stop
string search, streamed deltas) with a stop string that never matches, and reports the median time per token
over the first and the last 200 tokens. For comparison, the same for decoding the whole output on every token
(what the engine's stop check did before the output processor existed: `tokenizer.decode(all output ids)`).
Tokenizer: the tiny checkpoint's byte-level BPE (moe.tiny_tokenizer); text: a sentence repeated.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

from moe_serve.moe.tiny_tokenizer import build_tokenizer
from moe_serve.server.core.outputs import EngineOutput
from moe_serve.server.core.sampling_params import SamplingParams
from moe_serve.server.frontend.output_processor import RequestState


def per_token_us(step, n: int) -> list[float]:
    times = []
    for i in range(n):
        t0 = time.perf_counter()
        step(i)
        times.append((time.perf_counter() - t0) * 1e6)
    return times


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=2000)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--edge", type=int, default=200, help="tokens at each end to compare")
    args = ap.parse_args()
    tok = build_tokenizer()
    sentence = tok.encode(" The router scores every expert, keeps the top k, and sums their outputs.",
                          add_special_tokens=False)
    ids = (sentence * (args.tokens // len(sentence) + 1))[:args.tokens]
    rows = {"output processor (stream)": [], "whole-text decode per token": []}
    for _ in range(args.repeats):
        state = RequestState("r", None, [0], SamplingParams(max_tokens=args.tokens, stop=["never appears"]), tok,
                             stream=True)
        rows["output processor (stream)"].append(per_token_us(
            lambda i: (state.add(EngineOutput("r", [ids[i]], None)), state.stream_delta()), args.tokens))
        rows["whole-text decode per token"].append(per_token_us(
            lambda i: tok.decode(ids[:i + 1], skip_special_tokens=True), args.tokens))
    print(f"{args.tokens} tokens, median of {args.repeats} runs; microseconds per token")
    print(f"| path | first {args.edge} | last {args.edge} | last / first |")
    print("|---|---|---|---|")
    for name, runs in rows.items():
        first = statistics.median(statistics.median(r[:args.edge]) for r in runs)
        last = statistics.median(statistics.median(r[-args.edge:]) for r in runs)
        print(f"| {name} | {first:.1f} | {last:.1f} | {last / first:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
