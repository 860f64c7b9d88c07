"""The main job, run by scripts/run.sh: what the system is for, on the small trained model it ships.

1. Serves models/tiny-fortunes (a DeepSeek-V3-architecture model trained on Debian's fortunes: see its
   README.md) expert-parallel over 2 ranks (torchrun, data-parallel attention + EP, gloo on CPU), and asks it
   a few things with the `openai` client: completions and a streamed chat answer, with tokens/s.
2. Replays fixed traffic (chat requests and completions of held-out fortunes) recording the expert load,
   and writes the expert-load report of that traffic to out/report/before (PNG heatmaps + summary.txt):
   how unevenly the router spreads tokens (max / mean expert load per layer) and the balance over EP ranks.
3. Plans a placement from that load with 2 redundant slots (`moe plan`, the balancer's EPLB-style planner),
   restarts the server on it with EPLB on, replays the same traffic, and writes out/report/after; prints
   the balancedness over the EP ranks before and after, per MoE layer.
Logs in out/serve-*.log. Without the trained model (a checkout without models/) it falls back to the random
tiny checkpoint, whose answers are noise.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TRAINED = REPO / "models" / "tiny-fortunes"
FALLBACK = REPO / ".cache" / "tiny-v3"
OUT = REPO / "out"
PROMPTS = ["Once upon a time", "The best thing about a computer is", "A friend in need",
           "Never put off until tomorrow"]
CHAT = "Tell me a fortune."
REDUNDANT = 2


class Server:
    """`moe serve` under torchrun, 2 ranks, data-parallel attention with expert parallelism."""

    def __init__(self, model: Path, name: str, *extra: str):
        from moe_serve.parallel.launch import free_port

        self.port, self.master_port = free_port(), free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
               "--master-port", str(self.master_port), "-m", "moe_serve.server", "-v", "serve", str(model),
               "-dp", "2", "--enable-expert-parallel", "--port", str(self.port), "--served-model-name", "demo", *extra]
        self.log_path = OUT / f"serve-{name}.log"
        print(f"[demo] starting: moe serve {model.relative_to(REPO)} -dp 2 --enable-expert-parallel "
              f"{' '.join(extra)} (log: {self.log_path.relative_to(REPO)})", flush=True)
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(cmd, cwd=REPO, start_new_session=True, stdout=log, stderr=subprocess.STDOUT)

    def __enter__(self) -> "Server":
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise SystemExit(f"the server exited with {self.proc.returncode}; see {self.log_path}")
            try:
                with urllib.request.urlopen(self.url + "/ready", timeout=2) as r:
                    if r.status == 200:
                        return self
            except OSError:
                pass
            time.sleep(0.5)
        raise SystemExit(f"the server did not become ready in time; see {self.log_path}")

    def __exit__(self, *exc) -> None:
        from moe_serve.parallel.launch import kill_job

        kill_job(self.master_port)  # every rank, front end included
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()

    def post(self, path: str, body: dict | None = None) -> dict:
        req = urllib.request.Request(self.url + path, data=json.dumps(body or {}).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as r:
            return json.loads(r.read())


ASKS = ["Tell me a fortune.", "Say something wise.", "Give me a quote.", "Tell me something funny.",
        "What do you have for me today?", "Any advice for a programmer?", "What is love?", "Tell me about cats.",
        "How do I become rich?", "What should I do on Monday?", "Why is the sky blue?", "Cheer me up."]


def traffic(model: Path, completions: int = 16) -> list[tuple[str, dict]]:
    """What a served chat model sees: chat requests (the asks above), and completions of the first words of
    held-out fortunes (text the model never trained on)."""
    bodies = [("/v1/chat/completions", {"messages": [{"role": "user", "content": q}]}) for q in ASKS]
    held = model / "heldout.txt"
    starts = [" ".join(f.split()[:6]) for f in held.read_text().split("\n%\n")[:completions]] if held.exists() else PROMPTS
    return bodies + [("/v1/completions", {"prompt": p}) for p in starts]


def replay(server: Server, requests: list[tuple[str, dict]]) -> dict:
    """The traffic (32 greedy tokens each), 8 requests at a time, recorded: returns the dump of the record."""
    server.post("/start_expert_distribution_record")
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda r: server.post(r[0], {"model": "demo", "max_tokens": 32, "temperature": 0, **r[1]}),
                      requests))
    dump = server.post("/dump_expert_distribution_record")
    server.post("/stop_expert_distribution_record")
    return dump


def report(dump: dict, name: str) -> Path:
    path = OUT / f"load-{name}.json"
    path.write_text(json.dumps(dump))
    subprocess.run([sys.executable, "-m", "moe_serve.server", "report", "--file", str(path), "--out",
                    str(OUT / "report" / name)], check=True, cwd=REPO, stdout=subprocess.DEVNULL)
    return path


def per_layer(dump: dict) -> tuple[list[int], list[float], list[float]]:
    """(layer ids, max / mean load over the logical experts, balancedness over the EP ranks as measured from the
    tokens each slot computed) per MoE layer."""
    max_over_mean = [max(row) / max(sum(row) / len(row), 1e-9) for row in dump["logical_counts"]]
    return dump["layer_ids"], max_over_mean, dump["balancedness"]


def main() -> None:
    from openai import OpenAI

    model = TRAINED if (TRAINED / "config.json").exists() else FALLBACK
    if model == FALLBACK:
        from moe_serve.moe.tiny import ensure_checkpoint

        print(f"[demo] {TRAINED.relative_to(REPO)} is missing: using a random tiny checkpoint (answers are noise)")
        ensure_checkpoint(FALLBACK, "v3")
    OUT.mkdir(exist_ok=True)
    requests = traffic(model)

    with Server(model, "before") as server:
        client = OpenAI(base_url=server.url + "/v1", api_key="none")
        t0, tokens = time.perf_counter(), 0
        for prompt in PROMPTS:
            out = client.completions.create(model="demo", prompt=prompt, max_tokens=32, temperature=0)
            tokens += out.usage.completion_tokens
            print(f"completion: {prompt!r} -> {out.choices[0].text!r}")
        chat = client.chat.completions.create(model="demo", messages=[{"role": "user", "content": CHAT}],
                                              max_tokens=48, temperature=0, stream=True)
        text = "".join(chunk.choices[0].delta.content or "" for chunk in chat if chunk.choices)
        print(f"chat (streamed): {CHAT!r} -> {text!r}")
        seconds = time.perf_counter() - t0
        print(f"{tokens} completion tokens in {seconds:.2f} s: {tokens / seconds:.1f} tokens/s (sequential requests)")
        print(f"[demo] replaying {len(requests)} requests (chats and completions) x 32 tokens as traffic, recording "
              "the expert load", flush=True)
        before = report(replay(server, requests), "before")

    placement = OUT / "placement.json"
    subprocess.run([sys.executable, "-m", "moe_serve.server", "plan", "--load", str(before), "--ep", "2",
                    "--redundant", str(REDUNDANT), "--out", str(placement)], check=True, cwd=REPO,
                   stdout=subprocess.DEVNULL)
    with Server(model, "after", "--enable-eplb", "--num-redundant-experts", str(REDUNDANT),
                "--expert-placement", str(placement)) as server:
        print("[demo] the same traffic with EPLB on, from the planned placement", flush=True)
        after = report(replay(server, requests), "after")

    layers, skew, bal_before = per_layer(json.loads(before.read_text()))
    _, _, bal_after = per_layer(json.loads(after.read_text()))
    print(f"\nexpert load of the traffic, per MoE layer (16 routed experts over 2 EP ranks; EPLB: +{REDUNDANT} slots)")
    print(f"{'layer':>5}  {'max/mean expert load':>20}  {'balancedness before':>19}  {'with EPLB':>9}")
    for layer, s, b0, b1 in zip(layers, skew, bal_before, bal_after):
        print(f"{layer:>5}  {s:>20.2f}  {b0:>19.3f}  {b1:>9.3f}")
    print(f"max/mean expert load, highest layer: {max(skew):.2f}; balancedness over EP ranks, mean of layers: "
          f"{sum(bal_before) / len(bal_before):.3f} -> {sum(bal_after) / len(bal_after):.3f}")
    print(f"reports (PNG heatmaps, summary.txt): {(OUT / 'report' / 'before').relative_to(REPO)}, "
          f"{(OUT / 'report' / 'after').relative_to(REPO)}")


if __name__ == "__main__":
    main()
