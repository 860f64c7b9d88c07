"""`moe serve` under torchrun: dp=2 with expert parallelism over 2 ranks. Greedy answers equal the
offline single-process LLM; the all-to-all counters move; losing a rank ends the job non-zero."""

from __future__ import annotations

import os
import signal
import time

import pytest
from api_server import running_server
from prometheus_client.parser import text_string_to_metric_families

from moe_serve.server import LLM, SamplingParams

pytestmark = pytest.mark.slow
PROMPTS = ["Hello", "Once upon a time there was", "The expert router", "1 2 3 4"]


def metric(server, name: str) -> float:
    _, body = server.get("/metrics")
    for family in text_string_to_metric_families(body.decode()):
        for sample in family.samples:
            if sample.name == name:
                return sample.value
    raise KeyError(name)


def _processes_of(ckpt: str) -> list[int]:
    pids = []
    for entry in os.listdir("/proc"):
        try:
            if entry.isdigit() and ckpt in open(f"/proc/{entry}/cmdline", "rb").read().decode(errors="replace"):
                pids.append(int(entry))
        except OSError:
            pass
    return pids


def _environ(pid: int) -> list[str]:
    try:
        return open(f"/proc/{pid}/environ", "rb").read().decode(errors="replace").split("\0")
    except OSError:
        return []


def test_lost_rank_turns_health_503(checkpoint, tmp_path):
    """Two one-rank "nodes" (dp=2 + EP): node 0 runs the front end, node 1 a follower. SIGKILL the
    follower: node 0's engine watchdog ends the engine naming rank 1, and /health answers 503 within
    seconds (unless node 0's launcher, told through the rendezvous, ends the whole job first: then it
    must exit non-zero)."""
    import subprocess
    import sys

    from api_server import Server, free_port

    ckpt = checkpoint("v3")
    port, rdzv = free_port(), free_port()
    log0, log1 = tmp_path / "node0.log", tmp_path / "node1.log"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}

    def node(rank: int, log):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(rank),
               "--nproc-per-node", "1", "--rdzv-endpoint", f"127.0.0.1:{rdzv}",
               "-m", "moe_serve.server", "serve", ckpt, "--dtype", "float32", "--port", str(port), "-dp", "2",
               "--enable-expert-parallel"]
        return subprocess.Popen(cmd, stdout=open(log, "wb"), stderr=subprocess.STDOUT, env=env, start_new_session=True)

    nodes = [node(0, log0), node(1, log1)]
    server = Server(f"http://127.0.0.1:{port}", nodes[0], log0)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                if server.get("/ready", timeout=2)[0] == 200:
                    break
            except OSError:
                pass
            time.sleep(0.5)
        try:
            assert server.get("/health")[0] == 200
        except OSError:  # node 0 is gone: show why
            raise AssertionError(log0.read_text()[-3000:] + log1.read_text()[-2000:]) from None
        rank1 = [pid for pid in _processes_of(ckpt) if "RANK=1" in _environ(pid)]
        assert rank1, "rank 1 not found"
        t0 = time.monotonic()
        os.kill(rank1[0], signal.SIGKILL)
        status = 200
        while status == 200 and time.monotonic() - t0 < 60:
            time.sleep(0.5)
            try:
                status = server.get("/health", timeout=5)[0]
            except OSError:  # node 0's launcher learnt of the loss through the rendezvous and ended the job
                status = None
        assert time.monotonic() - t0 < 60
        if status is None:
            assert nodes[0].wait(60) != 0, log0.read_text()[-3000:]
        else:
            assert status == 503
    finally:
        for p in nodes:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for pid in _processes_of(ckpt):  # the torchrun workers live in sessions of their own
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    log = log0.read_text()
    assert "lost rank(s): 1" in log or nodes[0].returncode not in (None, 0), log[-3000:]


def test_parallel_server_matches_offline_and_reports_a_lost_rank(checkpoint):
    ckpt = checkpoint("v3")
    offline = LLM(ckpt, dtype="float32").generate(PROMPTS, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    with running_server(ckpt, "-dp", "2", "--enable-expert-parallel", nproc=2) as server:
        status, body = server.post("/v1/completions", {"model": ckpt, "prompt": PROMPTS, "max_tokens": 8,
                                                         "temperature": 0, "ignore_eos": True})
        assert status == 200, body
        texts = [c["text"] for c in sorted(body["choices"], key=lambda c: c["index"])]
        assert texts == [o.outputs[0].text for o in offline]
        assert metric(server, "moe_all_to_all_bytes_total") > 0
        assert server.get("/health")[0] == 200
        # lose rank 1 (the follower): rank 0's engine stops, /health says so within seconds
        rank1 = [pid for pid in _processes_of(ckpt) if "RANK=1" in _environ(pid)]
        assert rank1, "rank 1 not found"
        os.kill(rank1[0], signal.SIGKILL)
        # torchrun's agent then ends the job; until it does, /health answers 503, never 200
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and server.proc.poll() is None:
            try:
                assert server.get("/health", timeout=2)[0] in (200, 503)
            except OSError:
                pass
            time.sleep(0.2)
        assert server.proc.wait(30) != 0
