"""A job that ends right after its last collective exits 0 on every rank. gloo's worker threads free an op's
tensors after `wait()` returns; without parallel.comm.drain at exit, about one launch in three of this
worker died in interpreter shutdown with "terminate called without an active exception" (SIGABRT)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from moe_serve.parallel.launch import free_port

pytestmark = pytest.mark.slow
WORKER = Path(__file__).with_name("exit_worker.py")


def test_jobs_exit_cleanly_after_their_last_collective():
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    for launch in range(8):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
               "--master-port", str(free_port()), str(WORKER)]
        run = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
        out = run.stdout + run.stderr
        assert run.returncode == 0 and "terminate called" not in out, f"launch {launch}:\n{out[-3000:]}"
        assert "rank 0 done" in out and "rank 1 done" in out
