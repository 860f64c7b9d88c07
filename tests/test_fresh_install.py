"""A new user's install: a fresh virtual environment where transformers 5 and Hugging Face's `kernels` package
(a top-level `kernels`, like our repository folder) are installed first, then this project from a built
wheel; the `moe` command makes the tiny checkpoint and serves it end to end, from a directory outside the
checkout. Nothing of ours may be installed under a generic top-level name, and `kernels` stays Hugging Face's."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from moe_serve.parallel.launch import free_port

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[1]
OURS = ("moe", "experts", "balancer", "parallel", "kernels", "server")


def _run(cmd: list, cwd: Path, timeout: float = 600) -> str:
    proc = subprocess.run([str(c) for c in cmd], cwd=cwd, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{' '.join(map(str, cmd))} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout


def _post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as resp:
        return json.loads(resp.read())


def test_fresh_venv_with_hf_kernels_and_transformers5(tmp_path):
    venv, work = tmp_path / "venv", tmp_path / "work"
    work.mkdir()
    py, moe = venv / "bin" / "python", venv / "bin" / "moe"
    _run([sys.executable, "-m", "venv", venv], work)
    pip = [py, "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    torch_pin = f"torch=={__import__('torch').__version__.split('+')[0]}"  # the build on this machine's disk
    _run([*pip, torch_pin], work)
    _run([*pip, "transformers>=5", "kernels"], work)
    _run([*pip, REPO], work)  # a wheel built from the checkout: its package layout, not the source tree

    probe = ("import json, importlib.util, kernels, transformers, moe_serve.kernels, moe_serve.server; "
             "print(json.dumps({'transformers': transformers.__version__, 'kernels': kernels.__file__, "
             "'ours': moe_serve.kernels.__file__, "
             f"'top': {{n: importlib.util.find_spec(n) is not None for n in {OURS!r}}}}}))")
    found = json.loads(_run([py, "-c", probe], work).strip().splitlines()[-1])
    assert found["transformers"].startswith("5."), found
    assert "site-packages/kernels/" in found["kernels"], found  # Hugging Face's, untouched by our install
    assert "site-packages/moe_serve/kernels/" in found["ours"], found
    assert found["top"] == {n: n == "kernels" for n in OURS}, found  # only HF's `kernels` at the top level

    ckpt = work / "tiny"
    _run([moe, "make-checkpoint", "--out", ckpt, "--preset", "v3"], work)
    port = free_port()
    log = (tmp_path / "serve.log").open("wb")
    server = subprocess.Popen([str(moe), "serve", str(ckpt), "--dtype", "float32", "--port", str(port)], cwd=work,
                              stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                              env={**os.environ, "PYTHONUNBUFFERED": "1"})
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 240
        while True:
            assert server.poll() is None, (tmp_path / "serve.log").read_text()[-4000:]
            try:
                with urllib.request.urlopen(url + "/ready", timeout=2) as resp:
                    if resp.status == 200:
                        break
            except OSError:
                pass
            assert time.monotonic() < deadline, "not ready in 240 s:\n" + (tmp_path / "serve.log").read_text()[-4000:]
            time.sleep(0.5)
        out = _post(url + "/v1/completions", {"prompt": "Once upon a time", "max_tokens": 8, "temperature": 0})
        assert out["usage"]["completion_tokens"] == 8 and out["choices"][0]["text"], out
        chat = _post(url + "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4})
        assert chat["choices"][0]["message"]["role"] == "assistant", chat
    finally:
        os.killpg(server.pid, signal.SIGINT)
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()
