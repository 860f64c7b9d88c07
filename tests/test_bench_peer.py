"""scripts/bench_peer.py: the placing of rates at fractions of the measured saturation rate (--saturation-fractions), and
--moe-base-model's path."""

import argparse
import math
from pathlib import Path

import pytest


class Gate:  # bench_peer's QuietGate, always quiet
    def wait(self):
        return {"other_busy_cores": 0.0}


def test_fraction_rates_join_the_given_rates_in_order(script):
    peer = script("bench_peer")
    assert peer.fraction_rates([1.0, 6.0, math.inf], [0.5, 0.8], 15.74) == [1.0, 6.0, 7.9, 12.6, math.inf]
    assert peer.fraction_rates([math.inf], [0.5], 12.0) == [6.0, math.inf]
    assert peer.fraction_rates([6.0], [0.5], 12.0) == [6.0]  # a rate already asked for runs once


def test_probe_measures_saturation_on_our_engine_and_places_the_rates(script, monkeypatch, tmp_path):
    peer = script("bench_peer")
    seen = []

    def fake_run(spec, rate, tag, args, requests, out, docs):
        seen.append((spec.name, rate, tag))
        return {"rate": rate, "summary": {"request_throughput": [16.0, 14.0, 20.0][len(seen) - 1]}}

    monkeypatch.setattr(peer, "run_once", fake_run)
    specs = [peer.EngineSpec("vllm", [], {}, "/health", 1), peer.EngineSpec("moe", [], {}, "/ready", 2)]
    args = argparse.Namespace(saturation_fractions=[0.5, 0.8], saturation_probes=3, request_rates=[1.0, math.inf])
    docs = {"vllm": {"runs": []}, "moe": {"runs": []}}
    rates = peer.probe_saturation(specs, args, [], tmp_path, docs, Gate())
    assert [s[:2] for s in seen] == [("moe", math.inf)] * 3  # ours, not the peer's
    assert rates == [1.0, 8.0, 12.8, math.inf]  # median 16 req/s
    probe = docs["moe"]["saturation_probe"]
    assert probe["request_throughput"] == 16.0 and probe["rates"] == [8.0, 12.8] and len(probe["runs"]) == 3
    assert "saturation_probe" not in docs["vllm"]

    doc = {**docs["moe"], "rates": [{"rate": r, "summary": {"request_throughput": 12.8 if r == 1.0 else 16.0}}
                                    for r in (1.0, 8.0, 12.8, math.inf)]}
    line = peer.saturation_lines(doc)[-1]
    assert "50% -> 8 req/s, 80% -> 12.8 req/s" in line and "sit at 50% / 80%" in line
    assert peer.saturation_lines({"rates": []}) == []


def test_probe_that_completes_nothing_says_so(script, monkeypatch, tmp_path):
    peer = script("bench_peer")
    monkeypatch.setattr(peer, "run_once", lambda *a: {"rate": math.inf, "summary": {"request_throughput": 0.0}})
    args = argparse.Namespace(saturation_fractions=[0.5], saturation_probes=1, request_rates=[math.inf])
    with pytest.raises(RuntimeError, match="measured 0.000 req/s"):
        peer.probe_saturation([peer.EngineSpec("moe", [], {}, "/ready", 2)], args, [], tmp_path, {"moe": {}}, Gate())


def test_base_model_path_is_resolved_and_checked(script, checkpoint, monkeypatch, tmp_path):
    """--moe-base-model: moe-base's server runs from its own checkout, so the path is made absolute first, and
    one without config.json stops the run with a line naming it, before any server starts."""
    peer = script("bench_peer")
    monkeypatch.setattr(peer, "compare", lambda *a: pytest.fail("no server should start"))
    monkeypatch.chdir(tmp_path)
    argv = ["bench_peer.py", "--model", checkpoint("v3"), "--engines", "moe-base", "--moe-base-venv", str(tmp_path),
            "--client", "moe", "--out", str(tmp_path / "out"), "--num-prompts", "2", "--moe-base-model", "missing"]
    monkeypatch.setattr("sys.argv", argv)
    with pytest.raises(SystemExit, match=f"--moe-base-model missing: no config.json in {tmp_path / 'missing'}"):
        peer.main()
    seen = []
    monkeypatch.setattr(peer, "compare", lambda specs, *a: seen.extend(specs) or ({}, []))
    monkeypatch.setattr("sys.argv", argv[:-1] + ["."])  # a relative path to a checkpoint
    monkeypatch.chdir(checkpoint("v3"))
    peer.main()
    assert seen and seen[0].name == "moe-base" and str(Path(checkpoint("v3")).resolve()) in " ".join(seen[0].cmd)


def test_machine_floor_statistics(script):
    floor = script("machine_floor")
    times = [0.005] * 99 + [0.010]  # one run of a hundred twice as slow
    stats = floor.floor_stats(times)
    assert stats["median_ms"] == pytest.approx(5.0) and stats["runs"] == 100
    assert 1.0 < stats["p99_over_p50"] < 2.0 and stats["p99_over_local"] > 1.0
    assert floor.floor_stats([0.005] * 100)["p99_over_p50"] == 1.0


def test_machine_floor_probe_runs_on_the_servers_threads_and_is_reported(script, monkeypatch):
    import torch

    peer = script("bench_peer")
    seen = {}

    def fake_measure(target_s, runs):
        seen["threads"], seen["target_s"], seen["runs"] = torch.get_num_threads(), target_s, runs
        return {"gemm": {"what": "GEMM 700^3 float32", "threads": 1, "median_ms": 5.0, "p99_over_p50": 1.6,
                         "p99_over_local": 1.4, "runs": runs},
                "read": {"what": "sum of 200 MB", "threads": 1, "median_ms": 4.8, "p99_over_p50": 1.3,
                         "p99_over_local": 1.2, "runs": runs}}

    monkeypatch.setattr(peer.machine_floor, "measure", fake_measure)
    before = torch.get_num_threads()
    args = argparse.Namespace(moe_env="OMP_NUM_THREADS=1", machine_floor_ms=5.0, machine_floor_runs=50)
    floors = [peer.floor_probe(Gate(), args) for _ in range(3)]
    assert seen == {"threads": 1, "target_s": 0.005, "runs": 50} and torch.get_num_threads() == before
    lines = "\n".join(peer.floor_lines(floors))
    assert "| GEMM 700^3 float32, 1 threads | 5.0 [5.0-5.0] | 1.60 [1.60-1.60] | 1.40 [1.40-1.40] |" in lines
    assert "sum of 200 MB" in lines and peer.floor_lines([]) == []
