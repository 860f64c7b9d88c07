"""`moe report`: PNG heatmaps and a summary from an expert-load dump; the replication simulation's numbers."""

from __future__ import annotations

import json

import pytest
import torch

from moe_serve.balancer.stats import ExpertLoadRecorder
from moe_serve.server.cli import main
from moe_serve.server.tools.report import analyse, replicate_hottest


def skewed_dump(ep_size: int = 1) -> dict:
    rec = ExpertLoadRecorder(3, 8, window_steps=4, ep_size=ep_size, layer_ids=[1, 2, 3])
    g = torch.Generator().manual_seed(0)
    for layer in range(3):  # expert 0 hot everywhere, expert `layer + 1` warm
        ids = torch.multinomial(torch.tensor([8.0, 1, 1, 1, 1, 1, 1, 1]).index_fill(0, torch.tensor([layer + 1]), 4.0),
                                400, replacement=True, generator=g)
        rec.record(layer, ids.view(-1, 2))
    rec.end_step()
    return rec.to_json()


def test_replicate_hottest_each_slot_a_unit():
    w = torch.tensor([8.0, 2.0, 1.0, 1.0])
    assert replicate_hottest(w, torch.arange(4), 1, 1).tolist() == [0, 1, 2, 3, 0]
    a = analyse({"logical_counts": [w.tolist()], "placement": {"phy2log": [list(range(4))]}, "ep_size": 1},
                ep_size=1, extra=1)
    assert a["now_L"][0].item() == pytest.approx(3 / 8)  # mean 3 / max 8
    assert a["replicated_L"][0].item() == pytest.approx(2.4 / 4)  # 5 slots: 4, 2, 1, 1, 4 -> mean 2.4 / max 4


def test_replicate_hottest_over_ranks():
    w = torch.tensor([8.0, 1.0, 1.0, 2.0])  # ranks {0, 1} = 9, {2, 3} = 3
    phy2log = replicate_hottest(w, torch.arange(4), 2, 2)
    assert sorted(phy2log.tolist()) == [0, 0, 1, 2, 3, 3]
    assert phy2log[3:].tolist().count(0) == 1  # expert 0's replica went to the other rank
    a = analyse({"logical_counts": [w.tolist()], "placement": {"phy2log": [list(range(4))]}, "ep_size": 2})
    assert a["extra"] == 2 and a["replicated_L"][0] > a["now_L"][0]
    with pytest.raises(ValueError, match="multiple of the EP size"):
        replicate_hottest(w, torch.arange(4), 2, 1)


def test_report_from_file(tmp_path, capsys):
    dump_path = tmp_path / "dump.json"
    dump_path.write_text(json.dumps(skewed_dump()))
    out = tmp_path / "report"
    assert main(["report", "--file", str(dump_path), "--out", str(out), "--ep-size", "2"]) == 0
    for name in ("layer_expert.png", "layer_rank.png", "balancedness.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
    summary = (out / "summary.txt").read_text()
    assert summary == capsys.readouterr().out.split("wrote ")[0]
    assert "2 EP ranks" in summary and "hottest experts over all layers: 0 (" in summary
    assert "replication: one extra replica for the 2 hottest experts" in summary
    lines = [line.split() for line in summary.splitlines() if line[:5].strip().isdigit()]
    assert [int(line[0]) for line in lines] == [1, 2, 3]
    assert all(float(line[4]) >= float(line[3]) for line in lines)  # replication never hurts here
    assert "over 2 EP ranks (simulated)" in summary


def test_default_simulates_ranks_for_ep_size_1():
    a = analyse(skewed_dump())  # 8 slots, EP size 1 -> 8 ranks simulated (each one slot), 8 extra replicas
    assert (a["ep_size"], a["extra"], a["simulated"]) == (8, 8, True)
    assert torch.allclose(a["experts_L"], a["now_L"])  # one slot per rank: the same measure


def test_report_bad_source(tmp_path):
    assert main(["report", "--file", str(tmp_path / "missing.json"), "--out", str(tmp_path)]) == 2
    assert main(["report", "--url", "http://127.0.0.1:9", "--out", str(tmp_path)]) == 2
