"""Run under torchrun (4 ranks: two pipeline stages x two DP ranks, EP with redundant slots over each stage's
two ranks, a rebalance every 4 steps) by
test_reliability: steps as the engine loop does, with the placement export after each step; then restores, as a
restarted job would, the placement before the rebalances and then the exported one. Writes per rank: its MoE
layers' placement at each point and the exports (which cover every stage's layers), as JSON."""

import json
import sys
from pathlib import Path

from moe_serve.server import LLM, SamplingParams
from moe_serve.server.frontend.placement_handoff import PlacementExport, start_from_placement

PROMPTS = [[1, 2, 3, 4, 5], [7, 8], [9, 10, 11, 12, 13, 14, 15], [20]]


def placement(engine) -> dict[int, list[int]]:
    return {i: list(b.phy2log_R) for i, b in engine.runner.model.moe_blocks().items()}


def run(engine, export: PlacementExport, exports: list) -> list[list[int]]:
    """The prompts to the end, greedily; the export's placement files (and this stage's placement at each)."""
    dp = engine.parallel.dp
    params = SamplingParams(max_tokens=14, temperature=0.0, ignore_eos=True)
    rids = [engine.add_request(p, params) for i, p in enumerate(PROMPTS) if i % dp.size == dp.index]  # its share
    tokens = {rid: [] for rid in rids}
    while engine.any_rank_has_work():
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
        data = export.after_step()
        if data is not None:
            exports.append({"file": data, "stage": placement(engine)})
    return [tokens[rid] for rid in rids]


def main() -> None:
    ckpt, out = sys.argv[1], sys.argv[2]
    llm = LLM(ckpt, dtype="float32", pipeline_parallel_size=2, data_parallel_size=2, enable_expert_parallel=True,
              num_redundant_experts=2, enable_eplb=True, eplb_interval=4, eplb_plan_steps=0, eplb_min_gain=0.0)
    engine = llm.engine
    leader = engine.parallel.rank == 0
    export = PlacementExport(engine)
    initial_file, initial = export.export(), placement(engine)  # every rank takes part
    exports: list[dict] = []
    tokens = run(engine, export, exports)
    last = exports[-1]["file"] if exports else None
    moved = placement(engine)
    start_from_placement(engine, initial_file if leader else None)  # the leader's welcome reaches every rank
    restored_initial = placement(engine)
    start_from_placement(engine, last if leader else None)
    restored = placement(engine)
    tokens_after = run(engine, PlacementExport(engine), [])
    result = {"layers": sorted(initial), "initial": initial, "moved": moved, "exports": exports,
              "initial_file": initial_file, "restored_initial": restored_initial, "restored": restored,
              "tokens": tokens, "tokens_after": tokens_after}
    Path(f"{out}.rank{engine.parallel.rank}").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
