"""`moe serve` under torchrun: dp=2 with expert parallelism over 2 ranks. Greedy answers equal the
offline single-process LLM; the all-to-all counters move; losing a rank ends the job non-zero."""

from __future__ import annotations

import os
import signal
import time

import pytest
from api_server import running_server
from prometheus_client.parser import text_string_to_metric_families

from server import LLM, SamplingParams

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
