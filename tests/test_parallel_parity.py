"""Greedy float32 tokens of every parallel layout equal the single-process run, under real torchrun
launches on gloo: tp=2; pp=2; dp=2 (experts replicated); dp=2+EP; tp=2+EP; tp=2 x dp=2; pp=2 x tp=2 +EP;
pp=2 x dp=2 +EP; on V3- and V2-style checkpoints and the shipped trained model; with a lone request on a DP
layout (the idle DP rank runs dummy batches); a two-node launch; and a rank killed mid-generation."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from moe_serve.kernels import cpu_build
from moe_serve.moe.tiny import make_checkpoint
from moe_serve.parallel.launch import free_port
from moe_serve.server import LLM, SamplingParams

pytestmark = pytest.mark.slow
WORKER = Path(__file__).with_name("parallel_worker.py")
PROMPTS = ["Hello", "The quick brown fox jumps over the lazy dog.", "Once upon a time there was a model", "1 2 3", "Why?"]
MAX_TOKENS = 10
LAYOUTS = {
    "tp2": ({"tensor_parallel_size": 2}, 2),
    "pp2": ({"pipeline_parallel_size": 2}, 2),
    "dp2": ({"data_parallel_size": 2}, 2),
    "dp2-ep": ({"data_parallel_size": 2, "enable_expert_parallel": True}, 2),
    "tp2-ep": ({"tensor_parallel_size": 2, "enable_expert_parallel": True}, 2),
    "tp2-dp2": ({"tensor_parallel_size": 2, "data_parallel_size": 2}, 4),
    "pp2-tp2-ep": ({"pipeline_parallel_size": 2, "tensor_parallel_size": 2, "enable_expert_parallel": True}, 4),
    "pp2-dp2-ep": ({"pipeline_parallel_size": 2, "data_parallel_size": 2, "enable_expert_parallel": True}, 4),
}


def torchrun(nproc: int, args: list[str], *, nnodes: int = 1, node_rank: int = 0, port: int | None = None,
             timeout: float = 240, wait: bool = True):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc)]
    if nnodes > 1:
        # torchrun's default (static) rendezvous: node 0 hosts the store and holds ranks 0..nproc-1. (The c10d
        # backend ignores --node-rank, and its agents poll the store while workers run, so an agent whose
        # peer agent closed the store at the end of the job could fail a finished run.)
        cmd += ["--nnodes", str(nnodes), "--node-rank", str(node_rank), "--rdzv-endpoint", f"127.0.0.1:{port}"]
    else:
        cmd += ["--master-addr", "127.0.0.1", "--master-port", str(port or free_port())]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    if not wait:  # the log goes to a file, so a launch nobody is reading yet cannot block on a full pipe
        log = tempfile.TemporaryFile()
        proc = subprocess.Popen(cmd + [str(WORKER), *args], stdout=log, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
        proc.log_file = log
        return proc
    proc = subprocess.Popen(cmd + [str(WORKER), *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env, start_new_session=True)
    out, _ = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, out[-4000:]
    return out


def finish(proc: subprocess.Popen, timeout: float) -> str:
    """Wait for a launch started with wait=False; its whole log."""
    proc.wait(timeout=timeout)
    proc.log_file.seek(0)
    return proc.log_file.read().decode(errors="replace")


def run_layout(ckpt: str, tmp_path: Path, layout: dict, nproc: int, prompts=PROMPTS, dtype: str = "float32") -> list[dict]:
    out = tmp_path / "out.json"
    torchrun(nproc, [ckpt, str(out), json.dumps(layout), json.dumps(prompts), str(MAX_TOKENS), dtype])
    return [json.loads(Path(f"{out}.rank{r}").read_text()) for r in range(nproc)]


_single: dict[tuple, list] = {}


def single_process_tokens(ckpt: str, prompts=PROMPTS) -> list[list[int]]:
    key = (ckpt, tuple(prompts))
    if key not in _single:
        llm = LLM(ckpt, dtype="float32")
        outs = llm.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True))
        _single[key] = [o.outputs[0].token_ids for o in outs]
    return _single[key]


TRAINED = str(Path(__file__).resolve().parents[1] / "models" / "tiny-fortunes")  # the shipped trained model


@pytest.mark.parametrize("preset", ["v3", "v2", "trained"])
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_matches_single_process(checkpoint, tmp_path, preset, name):
    layout, nproc = LAYOUTS[name]
    ckpt = TRAINED if preset == "trained" else checkpoint(preset)
    expected = single_process_tokens(ckpt)
    for rank, result in enumerate(run_layout(ckpt, tmp_path, layout, nproc)):
        assert result["tokens"] == expected, f"rank {rank} of {name}"
    if layout.get("enable_expert_parallel"):
        stats = result["stats"]
        assert stats["dispatch_rows_sent_remote"] > 0
        assert stats["dispatch_bytes_sent"] <= stats["dispatch_naive_bytes_sent"]


@pytest.mark.skipif(cpu_build.lib() is None, reason="no C compiler or no AVX2 + FMA here")
def test_bf16_pipeline_stages_run_their_decode_layers_in_one_call(tmp_path):
    """bf16 weights computing in float32 through the CPU kernel backend (--kernel-backend cpu): each of two
    pipeline stages runs its own layers' decode steps one C call per layer (kernels/cpu_decode_layer.py), and
    the greedy tokens equal the single-process run's."""
    ckpt = str(make_checkpoint(tmp_path / "bf16", "v3", dtype="bfloat16"))
    llm = LLM(ckpt, dtype="bfloat16", kernel_backend="cpu")
    layers = llm.engine.runner.model.model.layers
    assert all(layer.fast_decode is not None for layer in layers)
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True))
    expected = [o.outputs[0].token_ids for o in outs]
    for rank, result in enumerate(run_layout(ckpt, tmp_path, {"pipeline_parallel_size": 2}, 2, dtype="bfloat16")):
        assert result["tokens"] == expected, f"rank {rank}"
        assert result["decode_layer_kernels"] == len(layers) // 2, f"rank {rank}"


def test_paced_prompts_are_scheduled_alike_on_every_rank(checkpoint, tmp_path):
    """Prompt pacing reads a clock and step times, and under torchrun every rank runs its own scheduler: tp=2
    with prompts paced beside running decodes, rank 1's own clock 1000 s ahead of rank 0's. Every rank paces
    by rank 0's clock and step times (handed round with each step's has-work all-reduce), so both schedule the
    same chunks (a rank that paced by its own clock would see every prompt overdue and run other shapes) and
    the greedy tokens equal the single process's."""
    ckpt = checkpoint("v3")
    layout = {"tensor_parallel_size": 2, "max_num_batched_tokens": 8, "prompt_spread_ms": 10000.0,
              "min_prompt_chunk": 2, "prompt_slowdown": 1.2, "_rank1_clock_ahead_s": 1000.0}
    expected = single_process_tokens(ckpt)
    results = run_layout(ckpt, tmp_path, layout, 2)
    for rank, result in enumerate(results):
        assert result["tokens"] == expected, f"rank {rank}"
    assert results[0]["paced_steps"] == results[1]["paced_steps"] > 0


def test_lone_request_on_data_parallel_ranks(checkpoint, tmp_path):
    """One request on two DP ranks: rank 1 has no work and runs dummy batches through the MoE layers."""
    ckpt = checkpoint("v3")
    lone = ["A single request"]
    expected = single_process_tokens(ckpt, lone)
    for result in run_layout(ckpt, tmp_path, LAYOUTS["dp2-ep"][0], 2, lone):
        assert result["tokens"] == expected


def test_two_node_launch(checkpoint, tmp_path):
    """Two torchrun launches (--nnodes 2) of two ranks each on loopback: dp=4 with EP across both nodes and
    redundant slots, so the placement is node-aware, re-planned while generating, and tokens take a replica on
    their own node where the expert has one; the dispatch statistics count what crossed between the nodes."""
    ckpt = checkpoint("v3")
    port = free_port()
    out = tmp_path / "out.json"
    layout = {"data_parallel_size": 4, "enable_expert_parallel": True, "num_redundant_experts": 4,
              "enable_eplb": True, "eplb_interval": 6, "eplb_plan_steps": 0, "eplb_min_gain": 0.0}
    args = [ckpt, str(out), json.dumps(layout), json.dumps(PROMPTS), str(MAX_TOKENS)]
    nodes = [torchrun(2, args, nnodes=2, node_rank=i, port=port, wait=False) for i in range(2)]
    logs = [finish(node, timeout=300) for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], "\n".join(
        f"--- node {i} (exit {node.returncode}):\n{log[-3000:]}" for i, (node, log) in enumerate(zip(nodes, logs)))
    expected = single_process_tokens(ckpt)
    for r in range(4):
        result = json.loads(Path(f"{out}.rank{r}").read_text())
        assert result["tokens"] == expected
        stats = result["stats"]
        assert 0 < stats["dispatch_rows_sent_cross_node"] <= stats["dispatch_rows_sent_remote"]
        assert 0 < stats["dispatch_node_rows_sent_remote"] <= stats["dispatch_rows_sent_cross_node"]
        assert result["rebalances"] >= 1  # re-planned across the nodes (with co-activation) while generating


def test_killed_rank_ends_the_job(checkpoint, tmp_path):
    """Two one-rank "nodes" (dp=2 with EP); SIGKILL the rank of node 1 mid-generation: the rank of
    node 0 is not told by any launcher, so its watchdog must end it non-zero within the collective
    timeout, naming the lost rank."""
    ckpt = checkpoint("v3")
    layout = {**LAYOUTS["dp2-ep"][0], "collective_timeout_s": 10}
    out = tmp_path / "out.json"
    port = free_port()
    args = [ckpt, str(out), json.dumps(layout), json.dumps(PROMPTS * 8), "400"]
    nodes = [torchrun(1, args, nnodes=2, node_rank=i, port=port, wait=False) for i in range(2)]
    pid_file = Path(f"{out}.pid1")
    deadline = time.monotonic() + 120
    while not pid_file.exists() and time.monotonic() < deadline and nodes[1].poll() is None:
        time.sleep(0.5)
    assert pid_file.exists(), "rank 1 did not start generating"
    time.sleep(3)  # inside the decode loop
    t0 = time.monotonic()
    os.kill(int(pid_file.read_text()), signal.SIGKILL)
    log = finish(nodes[0], timeout=120)
    elapsed = time.monotonic() - t0
    finish(nodes[1], timeout=60)
    assert nodes[0].returncode != 0
    assert elapsed < 60, f"took {elapsed:.0f} s to stop"
    assert "lost rank(s): 1" in log, log[-3000:]  # rank 0's watchdog names the killed rank
