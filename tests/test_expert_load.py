"""ExpertLoadRecorder: the sliding window, totals and record sessions, slot counts under a placement, and the
engine hook counting exactly what the router chose. (The HTTP endpoints: test_api.py.)"""

from __future__ import annotations

import pytest
import torch

from moe_serve.balancer.stats import ExpertLoadRecorder, balancedness_per_layer


def test_worked_example_from_docstring():
    rec = ExpertLoadRecorder(2, 3, window_steps=2)
    rec.record(0, torch.tensor([[0, 1], [0, 2]]))
    rec.record(1, torch.tensor([[2, 2]]))
    rec.end_step()
    assert rec.snapshot().window_LE.tolist() == [[2, 1, 1], [0, 0, 2]]


def test_window_slides_totals_accumulate():
    rec = ExpertLoadRecorder(1, 4, window_steps=2)
    for step in range(3):  # step s routes (s + 1) tokens to expert s
        rec.record(0, torch.full((step + 1, 1), step))
        rec.end_step()
    snap = rec.snapshot()
    assert snap.window_LE.tolist() == [[0, 2, 3, 0]]  # the first step has left the window
    assert snap.total_LE.tolist() == [[1, 2, 3, 0]]
    assert (snap.steps_in_window, snap.steps_total) == (2, 3)
    rec.record(0, torch.tensor([[3]]))  # an unfinished step is in neither view
    assert rec.snapshot().window_LE.tolist() == [[0, 2, 3, 0]]


def test_discarded_steps_and_reset_count_nothing():
    """A dummy batch's step (a DP rank with no work) and the server's warm-up are not load."""
    rec = ExpertLoadRecorder(1, 3, window_steps=2)
    rec.record(0, torch.tensor([[1]]))
    rec.end_step()
    rec.record(0, torch.tensor([[2]]))  # routed in a step that is then discarded
    rec.discard_step()
    snap = rec.snapshot()
    assert snap.window_LE.tolist() == [[0, 1, 0]] and snap.steps_total == 1
    rec.reset()
    snap = rec.snapshot()
    assert snap.total_LE.sum() == 0 and snap.window_LE.sum() == 0 and snap.steps_total == 0
    rec.record(0, torch.tensor([[0]]))
    rec.end_step()
    assert rec.snapshot().window_LE.tolist() == [[1, 0, 0]]


class _Block:
    """Stands in for an MoE block: its placement and the moves asked of it."""

    def __init__(self, num_experts: int):
        self.phy2log_R = list(range(num_experts))
        self.moves = 0

    def relocate_experts(self, phy2log_R: list[int]) -> int:
        self.moves += 1
        moved = sum(a != b for a, b in zip(self.phy2log_R, phy2log_R))
        self.phy2log_R = list(phy2log_R)
        return moved


@pytest.mark.parametrize("skewed", [False, True])
def test_rebalancer_moves_only_for_a_real_gain(skewed):
    """A periodic plan that would raise balancedness by less than min_gain moves no weights."""
    from moe_serve.balancer.rebalancer import EplbConfig, Rebalancer

    blocks = {1: _Block(8), 2: _Block(8)}
    rec = ExpertLoadRecorder(2, 8, window_steps=4, ep_size=2, layer_ids=[1, 2],
                             phy2log_LR=torch.tensor([b.phy2log_R for b in blocks.values()]))

    class TwoRanks(Rebalancer):  # plans for 2 EP ranks; the load is this process's (no group to sum over)
        ep_size = 2

    reb = TwoRanks(EplbConfig(enable_eplb=True, window=4, interval=4, min_gain=0.05), blocks, rec, None, 1)
    for _ in range(4):
        for j in range(2):  # skewed: experts 0-3 (rank 0's) get nearly everything
            ids = torch.tensor([[0], [1], [2], [3]] * 8 + [[4], [5]]) if skewed else torch.arange(8).repeat(4)[:, None]
            rec.record(j, ids)
        rec.end_step()
    queued = reb.plan()
    assert (queued > 0) == skewed and (reb.num_rebalances == 1) == skewed
    assert reb.rebalance_now() >= 0  # an explicit rebalance plans whatever the gain


def test_periodic_plan_runs_in_the_background_and_lands_on_a_fixed_step():
    """The planner runs beside the next `plan_steps` steps and its plan is queued after exactly that many
    (every rank alike): the same plan a synchronous one makes."""
    from moe_serve.balancer.rebalancer import EplbConfig, Rebalancer

    def skewed_rebalancer(plan_steps: int):
        blocks = {1: _Block(8), 2: _Block(8)}
        rec = ExpertLoadRecorder(2, 8, window_steps=4, ep_size=2, layer_ids=[1, 2],
                                 phy2log_LR=torch.tensor([b.phy2log_R for b in blocks.values()]))

        class TwoRanks(Rebalancer):
            ep_size = 2

        cfg = EplbConfig(enable_eplb=True, window=4, interval=4, min_gain=0.0, plan_steps=plan_steps)
        reb = TwoRanks(cfg, blocks, rec, None, 1)
        for _ in range(4):
            for j in range(2):
                rec.record(j, torch.tensor([[0], [1], [2], [3]] * 8 + [[4], [5]]))
            rec.end_step()
            reb.after_step()
        return reb

    sync = skewed_rebalancer(0)
    assert sync.pending and sync._planning is None
    reb = skewed_rebalancer(3)
    assert reb._planning is not None and not reb.pending and reb.num_rebalances == 0
    reb.after_step()
    reb.after_step()
    assert not reb.pending  # taken after exactly 3 more steps, however early the thread finished
    reb.after_step()
    assert reb._planning is None and reb.pending == sync.pending and reb.num_rebalances == 1
    with pytest.raises(ValueError, match="plan_steps must be an integer >= 0"):
        EplbConfig(plan_steps=-1)


def test_a_restarted_job_moves_to_the_exported_placement_and_counts_its_load():
    """Rebalancer.move_to with a previous job's export (as GET /v1/expert_load writes it): the blocks move to its
    phy2log, the window holds its load until window_steps steps of this job have passed; a different slot
    count plans from the load instead; other layers are left alone."""
    from moe_serve.balancer.rebalancer import EplbConfig, Rebalancer

    def job(num_slots: int):
        blocks = {1: _Block(num_slots), 2: _Block(num_slots)}
        rec = ExpertLoadRecorder(2, 8, window_steps=3, ep_size=2, layer_ids=[1, 2],
                                 phy2log_LR=torch.tensor([[e % 8 for e in b.phy2log_R] for b in blocks.values()]))
        for b in blocks.values():
            b.phy2log_R = [e % 8 for e in b.phy2log_R]
        return Rebalancer(EplbConfig(window=3), blocks, rec, None, 1), blocks, rec

    load = [[9, 1, 1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1, 1, 9]]
    exported = {"layer_ids": [1, 2], "logical_counts": load,
                "placement": {"phy2log": [[7, 6, 5, 4, 3, 2, 1, 0], [0, 1, 2, 3, 4, 5, 6, 7]]}}
    reb, blocks, rec = job(8)
    assert reb.move_to(exported, count_load=True) == 8  # layer 1 reversed: every slot loads; layer 2 unchanged
    assert [b.phy2log_R for b in blocks.values()] == exported["placement"]["phy2log"]
    assert rec.phy2log_LR.tolist() == exported["placement"]["phy2log"]
    assert rec.snapshot().window_LE.tolist() == load
    for step in range(3):
        rec.record(0, torch.tensor([[0]]))
        rec.end_step()
        assert (rec.snapshot().window_LE.sum().item() > 3) == (step < 2)  # the export ages out after 3 steps
    reb, blocks, rec = job(10)  # two redundant slots: the export's 8-slot phy2log does not fit, its load plans
    reb.move_to(exported)
    assert all(sorted(set(b.phy2log_R)) == list(range(8)) for b in blocks.values())
    assert blocks[1].phy2log_R.count(0) > 1 and blocks[2].phy2log_R.count(7) > 1  # the hot experts replicated
    assert rec.snapshot().window_LE.sum() == 0  # count_load False: this rank adds nothing
    assert job(8)[0].move_to({**exported, "layer_ids": [0, 1]}) == 0


def test_pipeline_stages_export_one_placement_and_each_restores_its_layers(caplog):
    """Under pipeline parallelism each stage exports its layers' rows; merged, they cover every MoE layer, and
    a restarted job's stages each move to their own rows (a stage missing from the file is not restored)."""
    from moe_serve.balancer.placement_stages import merge_stages, stage_rows
    from moe_serve.balancer.rebalancer import EplbConfig, Rebalancer

    def stage(layers: list[int]):
        blocks = {i: _Block(4) for i in layers}
        rec = ExpertLoadRecorder(len(layers), 4, window_steps=3, layer_ids=layers)
        return Rebalancer(EplbConfig(window=3), blocks, rec, None, 1), blocks, rec

    phy2log = {1: [3, 2, 1, 0], 2: [1, 0, 3, 2], 3: [0, 1, 2, 3]}
    load = {1: [5, 0, 0, 1], 2: [0, 6, 0, 0], 3: [1, 1, 1, 4]}
    parts = []
    for layers in ([2, 3], [1]):  # in any order
        reb, blocks, rec = stage(layers)
        reb.move_to({"layer_ids": layers, "placement": {"phy2log": [phy2log[i] for i in layers]}})
        for j, layer in enumerate(layers):
            rec.record(j, torch.tensor(sum(([[e]] * n for e, n in enumerate(load[layer])), [])))
        rec.end_step()
        parts.append(rec.to_json("window"))
    merged = merge_stages(parts)
    assert merged["layer_ids"] == [1, 2, 3] and merged["num_layers"] == 3
    assert merged["placement"]["phy2log"] == [phy2log[i] for i in (1, 2, 3)]
    assert merged["logical_counts"] == [load[i] for i in (1, 2, 3)]
    assert len(merged["physical_counts"]) == len(merged["balancedness"]) == 3
    assert merged["balancedness_min"] == min(merged["balancedness"])
    assert stage_rows(merged, [3, 1])["placement"]["phy2log"] == [phy2log[3], phy2log[1]]
    assert stage_rows(merged, [3, 4]) is None
    with pytest.raises(ValueError, match="overlap"):
        merge_stages([parts[0], parts[0]])
    with pytest.raises(ValueError, match="disagree on num_slots"):
        merge_stages([parts[0], {**parts[1], "num_slots": 6}])

    for layers in ([1], [2, 3]):  # the next job's stages, each given the whole file
        reb, blocks, rec = stage(layers)
        assert reb.move_to(merged, count_load=True) > 0
        assert [b.phy2log_R for b in blocks.values()] == [phy2log[i] for i in layers]
        assert rec.snapshot().window_LE.tolist() == [load[i] for i in layers]
    reb, blocks, _ = stage([3, 4])
    with caplog.at_level("WARNING"):
        assert reb.move_to(merged) == 0
    assert "not all of this stage's [3, 4]" in caplog.text and blocks[3].moves == 0


def test_a_placement_file_of_every_stage_starts_each_stage(tmp_path):
    import json

    from moe_serve.balancer.placement_file import initial_placement

    path = tmp_path / "placement.json"
    path.write_text(json.dumps({"layer_ids": [1, 2, 3], "num_experts": 4, "logical_counts": [[1] * 4] * 3,
                                "placement": {"phy2log": [[3, 2, 1, 0], [1, 0, 3, 2], [0, 1, 2, 3]]}}))
    assert initial_placement([2, 3], 4, 4, 1, 1, path, topk=2) == {2: [1, 0, 3, 2], 3: [0, 1, 2, 3]}
    planned = initial_placement([1], 4, 6, 2, 1, path, topk=2)  # 6 slots: planned from layer 1's load
    assert list(planned) == [1] and len(planned[1]) == 6 and set(planned[1]) == {0, 1, 2, 3}
    with pytest.raises(ValueError, match="this stage has"):
        initial_placement([3, 4], 4, 4, 1, 1, path, topk=2)


def test_record_session():
    rec = ExpertLoadRecorder(1, 2, window_steps=8)
    rec.record(0, torch.tensor([[0]]))
    rec.end_step()
    rec.start_record()
    rec.record(0, torch.tensor([[1], [1]]))
    rec.end_step()
    rec.stop_record()
    rec.record(0, torch.tensor([[0]]))
    rec.end_step()
    dump = rec.to_json("record")
    assert dump["logical_counts"] == [[0, 2]] and dump["steps"] == 1 and not dump["recording"]
    rec.start_record()  # a new session starts from zero
    assert rec.to_json("record")["logical_counts"] == [[0, 0]]


def test_balancedness_definition():
    load = torch.tensor([[4.0, 2.0, 1.0, 1.0], [0.0, 0.0, 0.0, 0.0]])
    # EP size 1: each expert its own unit -> mean 2 / max 4; a layer without load counts as balanced
    assert balancedness_per_layer(load, 1).tolist() == [0.5, 1.0]
    # 2 ranks: slots {0, 1} -> 6, {2, 3} -> 2: mean 4 / max 6
    assert balancedness_per_layer(load, 2)[0].item() == pytest.approx(4 / 6)
    with pytest.raises(ValueError, match="do not divide"):
        balancedness_per_layer(load, 3)


def test_slots_follow_placement():
    # expert 0 has two replicas (slots 0 and 3): its tokens split evenly between them
    rec = ExpertLoadRecorder(1, 3, window_steps=4, ep_size=2, phy2log_LR=torch.tensor([[0, 1, 2, 0]]))
    rec.record(0, torch.tensor([[0], [0], [0], [0], [1], [2]]))
    rec.end_step()
    dump = rec.to_json()
    assert dump["logical_counts"] == [[4, 1, 1]]
    assert dump["physical_counts"] == [[2.0, 1.0, 1.0, 2.0]]
    assert dump["rank_tokens"] == [[3.0, 3.0]] and dump["balancedness"] == [1.0]
    # measured slot ids, when the caller has them, win over the even split
    rec.record(0, torch.tensor([[0], [0]]), phy_ids_TK=torch.tensor([[3], [3]]))
    rec.end_step()
    assert rec.to_json()["physical_counts"] == [[0, 0, 0, 2]]  # only the measured step is in the measured window


def test_slot_ids_that_are_the_expert_ids_count_as_measured():
    """A layer with a slot per expert passes one tensor as both ids (moe/model.py, the fused decode layer): the slot
    counts are then the expert counts, the same as when the same ids come as two tensors (one scatter-add each, the
    layers' offsets kept per pattern of layers and ids), step after step and across batch sizes."""
    fast, slow = ExpertLoadRecorder(2, 4, window_steps=3), ExpertLoadRecorder(2, 4, window_steps=3)
    g = torch.Generator().manual_seed(0)
    for tokens in (1, 3, 3, 2, 5):
        ids = [torch.randint(0, 4, (tokens, 2), generator=g) for _ in range(2)]
        for layer in (0, 1):
            fast.record(layer, ids[layer], ids[layer])
            slow.record(layer, ids[layer], ids[layer].clone())
        fast.end_step()
        slow.end_step()
        a, b = fast.to_json(), slow.to_json()
        assert a["physical_counts"] == b["physical_counts"] and a["logical_counts"] == b["logical_counts"]
        assert a["physical_counts"] == a["logical_counts"]
    assert fast.snapshot().total_LE.sum() == 2 * 2 * (1 + 3 + 3 + 2 + 5)


def test_identity_placement_json():
    rec = ExpertLoadRecorder(2, 4, layer_ids=[1, 3])
    dump = rec.to_json()
    assert dump["placement"]["phy2log"] == [[0, 1, 2, 3]] * 2 and dump["layer_ids"] == [1, 3]
    assert dump["balancedness"] == [1.0, 1.0] and dump["ep_size"] == 1


def test_engine_hook_counts_what_the_router_chose(checkpoint, monkeypatch):
    from moe_serve.moe import model as moe_model
    from moe_serve.server import LLM, SamplingParams

    llm = LLM(checkpoint("v3"), dtype="float32")
    engine = llm.engine
    rec = engine.expert_load_recorder  # on by default
    assert rec is not None and engine.enable_expert_load_recording() is rec  # attached once
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    plain = [o.outputs[0].token_ids for o in llm.generate(["Hello", "Once upon a time"], params)]
    before = rec.snapshot()
    routed = []
    real_route = moe_model.route

    def counting_route(*args, **kw):
        weights, ids = real_route(*args, **kw)
        routed.append(ids.flatten().bincount(minlength=rec.num_experts))
        return weights, ids

    monkeypatch.setattr(moe_model, "route", counting_route)
    outs = llm.generate(["Hello again, world", "The expert router sends"], params)
    L = rec.num_layers
    direct_LE = torch.stack([sum(routed[j::L]) for j in range(L)])
    after = rec.snapshot()
    assert torch.equal(after.total_LE - before.total_LE, direct_LE)
    assert torch.equal(after.window_LE - before.window_LE, direct_LE)  # the window (1000 steps) holds both runs
    assert torch.equal(after.total_LR - before.total_LR, direct_LE)  # identity placement: slot i = expert i
    top_k = engine.model_config.num_experts_per_tok  # every token through the model: prompt + all outputs but the last
    assert direct_LE.sum().item() == L * top_k * sum(len(o.prompt_token_ids) + 4 for o in outs)
    monkeypatch.undo()
    assert [o.outputs[0].token_ids for o in llm.generate(["Hello", "Once upon a time"], params)] == plain


def test_coactivation_totals_count_pairs_of_completed_steps_only():
    rec = ExpertLoadRecorder(2, 4, window_steps=2)
    assert rec.coactivation() is None  # not counted unless asked for (a node-aware balancer asks)
    rec.enable_coactivation()
    rec.record(0, torch.tensor([[0, 1], [1, 2]]))
    rec.end_step()
    rec.record(1, torch.tensor([[3, 0]]))
    rec.discard_step()  # a dummy batch: dropped
    co = rec.coactivation()
    assert co.shape == (2, 4, 4) and co[0, 0, 1] == 1 and co[0, 1, 2] == 1 and co[0, 2, 1] == 1 and co[1].sum() == 0
    rec.reset()
    assert rec.coactivation().sum() == 0
