"""Run under torchrun by the parallel tests: generate greedily with a parallel layout and write the
tokens (rank 0) as JSON. Every rank checks it got every output."""

import json
import os
import sys
import time
from pathlib import Path


from moe_serve.server import LLM, SamplingParams  # noqa: E402


def main() -> None:
    ckpt, out, layout = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    prompts = json.loads(sys.argv[4])
    max_tokens = int(sys.argv[5]) if len(sys.argv) > 5 else 12
    clock_ahead_s = layout.pop("_rank1_clock_ahead_s", 0.0)   # this process's clock, off from rank 0's
    llm = LLM(ckpt, dtype=sys.argv[6] if len(sys.argv) > 6 else "float32", **layout)
    sched = llm.engine.scheduler
    if clock_ahead_s and llm.engine.parallel.rank == 1:
        sched.clock = lambda: time.monotonic() + clock_ahead_s
    paced = [0]   # steps whose prompt budget the pacing cut below the token budget
    prompt_budget = sched._prompt_budget

    def counted() -> int:
        budget = prompt_budget()
        paced[0] += budget < sched.config.max_num_batched_tokens
        return budget

    sched._prompt_budget = counted
    Path(f"{out}.pid{llm.engine.parallel.rank}").write_text(str(os.getpid()))  # loaded; generating next
    outs = llm.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    tokens = [o.outputs[0].token_ids for o in outs]
    assert len(tokens) == len(prompts) and all(len(t) == max_tokens for t in tokens)
    rank = llm.engine.parallel.rank
    stats = llm.stats()
    layers = llm.engine.runner.model.model.layers
    decode_kernels = sum(getattr(layer, "fast_decode", None) is not None for layer in layers)  # CPU backend, bf16
    rebalancer = getattr(llm.engine, "rebalancer", None)
    Path(f"{out}.rank{rank}").write_text(json.dumps({"tokens": tokens, "stats": stats,
                                                     "decode_layer_kernels": decode_kernels, "paced_steps": paced[0],
                                                     "rebalances": rebalancer.num_rebalances if rebalancer else 0}))


if __name__ == "__main__":
    main()
