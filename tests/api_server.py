"""Starts `python -m moe_serve.server serve` on a free port for the API tests and stops it (engine included)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

try:
    import httpx
except ImportError:  # newer openai releases ship the client as httpx2
    import httpx2 as httpx  # noqa: F401 - re-exported for the tests

from moe_serve.parallel.launch import free_port  # noqa: E402  (re-exported for the tests)

REPO = Path(__file__).resolve().parents[1]


@dataclass
class Server:
    url: str
    proc: subprocess.Popen
    log_path: Path
    api_key: str | None = None

    def headers(self) -> dict:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def get(self, path: str, timeout: float = 30.0) -> tuple[int, bytes]:
        req = urllib.request.Request(self.url + path, headers=self.headers())
        try:
            with urllib.request.urlopen(req, timeout=timeout) as resp:
                return resp.status, resp.read()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read()

    def post(self, path: str, body: bytes | dict | None = None, timeout: float = 60.0,
             headers: dict | None = None) -> tuple[int, dict]:
        data = body if isinstance(body, bytes) else json.dumps(body or {}).encode()
        req = urllib.request.Request(self.url + path, data=data, method="POST",
                                     headers={"Content-Type": "application/json", **self.headers(), **(headers or {})})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as resp:
                return resp.status, json.loads(resp.read() or b"null")
        except urllib.error.HTTPError as exc:
            return exc.code, json.loads(exc.read() or b"null")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def engine_pids(self) -> list[int]:
        """The spawned engine process (children of the front end started by multiprocessing)."""
        pids = []
        try:
            children = Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children").read_text().split()
        except OSError:
            return pids
        for pid in map(int, children):
            try:
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
            except OSError:
                continue
            if "spawn_main" in cmd:
                pids.append(pid)
        return pids


@contextmanager
def running_server(model_dir: str, *args: str, api_key: str | None = None, timeout_s: float = 180.0, nproc: int = 1):
    """nproc > 1 launches under torchrun (every rank runs `-m moe_serve.server serve`; rank 0 serves HTTP)."""
    port = free_port()
    log_path = Path(tempfile.mkstemp(prefix="moe-serve-test-", suffix=".log")[1])
    launcher = [sys.executable]
    master_port = free_port()
    if nproc > 1:
        launcher += ["-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-addr", "127.0.0.1",
                     "--master-port", str(master_port)]
    cmd = [*launcher, "-m", "moe_serve.server", "serve", model_dir, "--dtype", "float32", "--port", str(port), *args]
    if api_key:
        cmd += ["--api-key", api_key]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    server = Server(f"http://127.0.0.1:{port}", proc, log_path, api_key)
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited with {proc.returncode}:\n{server.log()}")
            try:
                if server.get("/ready", timeout=2)[0] == 200:
                    break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"server not ready after {timeout_s} s:\n{server.log()}")
            time.sleep(0.2)
        yield server
    finally:
        if nproc > 1:
            from moe_serve.parallel.launch import kill_job

            kill_job(master_port)  # torchrun's workers live in sessions of their own
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # whatever is left of the group (the engine process)
        except ProcessLookupError:
            pass
        proc.wait()
        log_path.unlink(missing_ok=True)
