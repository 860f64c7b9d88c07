"""The main job: serve the embedded tiny DeepSeek-V3-style model expert-parallel over 2 ranks, ask it
a few things with the `openai` client, print the answers with tokens/s, and write an expert-load
report (PNG heatmaps + summary) to out/report. Run by scripts/run.sh."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
MODEL = REPO / ".cache" / "tiny-v3"
PROMPTS = ["The expert router sends each token to", "Once upon a time", "Mixture-of-experts models are fast because"]


def wait_ready(url: str, proc: subprocess.Popen, timeout_s: float = 240) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited with {proc.returncode}; see out/serve.log")
        try:
            with urllib.request.urlopen(url + "/ready", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise SystemExit("the server did not become ready in time")


def main() -> None:
    from moe_serve.moe.tiny import ensure_checkpoint
    from moe_serve.parallel.launch import free_port

    ensure_checkpoint(MODEL, "v3")
    port, master_port = free_port(), free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
           "--master-port", str(master_port), "-m", "moe_serve.server", "-v", "serve", str(MODEL), "-dp", "2",
           "--enable-expert-parallel", "--port", str(port)]
    log_path = REPO / "out" / "serve.log"
    log_path.parent.mkdir(exist_ok=True)
    print("starting:", " ".join(cmd[2:]), f"(log: {log_path.relative_to(REPO)})", flush=True)
    with open(log_path, "wb") as log:
        server = subprocess.Popen(cmd, cwd=REPO, start_new_session=True, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_ready(url, server)
        from openai import OpenAI

        client = OpenAI(base_url=url + "/v1", api_key="none")
        t0, tokens = time.perf_counter(), 0
        for prompt in PROMPTS:
            out = client.completions.create(model=str(MODEL), prompt=prompt, max_tokens=24, temperature=0)
            tokens += out.usage.completion_tokens
            print(f"completion: {prompt!r} -> {out.choices[0].text!r}")
        chat = client.chat.completions.create(model=str(MODEL), messages=[{"role": "user", "content": "Hello!"}],
                                              max_tokens=24, temperature=0, stream=True)
        text = "".join(chunk.choices[0].delta.content or "" for chunk in chat if chunk.choices)
        print(f"chat (streamed): 'Hello!' -> {text!r}")
        seconds = time.perf_counter() - t0
        print(f"{tokens} completion tokens in {seconds:.2f} s: {tokens / seconds:.1f} tokens/s (sequential requests)")
        out_dir = REPO / "out" / "report"
        subprocess.run([sys.executable, "-m", "moe_serve.server", "report", "--url", url, "--out", str(out_dir)], check=True,
                       cwd=REPO)
        print(f"expert-load report written to {out_dir}")
    finally:
        from moe_serve.parallel.launch import kill_job

        kill_job(master_port)  # every rank, front end included
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGKILL)
        server.wait()

if __name__ == "__main__":
    main()
