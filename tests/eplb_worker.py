"""Run under torchrun by test_eplb_serving: generate with EP and redundant slots, before, during and
after rebalances, and write tokens, load counts and placements (per rank) as JSON."""

import json
import sys
from pathlib import Path


from moe_serve.server import LLM, SamplingParams  # noqa: E402


def main() -> None:
    ckpt, out, layout = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    prompts = json.loads(sys.argv[4])
    llm = LLM(ckpt, dtype="float32", **layout)
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    blocks = llm.engine.runner.model.moe_blocks()
    before = {i: b.phy2log_R for i, b in blocks.items()}
    first = llm.generate(prompts, params)  # eplb_interval is small: layers move during this call
    during = {i: b.phy2log_R for i, b in blocks.items()}
    load = llm.expert_load("total")
    moved = llm.rebalance()  # a forced rebalance between calls
    after = llm.generate(prompts, params)
    result = {
        "tokens_first": [o.outputs[0].token_ids for o in first],
        "tokens_after": [o.outputs[0].token_ids for o in after],
        "placement_before": before, "placement_during": during,
        "placement_after": {i: b.phy2log_R for i, b in blocks.items()},
        "moved_forced": moved, "rebalances": llm.engine.rebalancer.num_rebalances,
        "logical_counts": load["logical_counts"], "physical_counts": load["physical_counts"],
        "layer_ids": load["layer_ids"],
    }
    Path(f"{out}.rank{llm.engine.parallel.rank}").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
