"""Serving through a lost rank (docs/reliability.md): the front end runs on its own (`--frontend-only`), a 2-rank
EP engine job attaches to it over TCP with a shared secret, and one rank is SIGKILLed mid-generation. Every
accepted request completes with the text (greedy and seeded) and usage of a run without the failure; the
outage (last token before the kill, first token after, over the streams) is printed.
  - a job without restarts: the test starts the next job itself, as a supervisor would;
  - a job under torchrun --max-restarts 1: torchrun starts it again; it resumes from the placement the
    balancer exported; losing a rank once more exhausts the restarts: the requests then in flight fail with
    503 after --reattach-timeout, /health says why, new requests get 503 with Retry-After.
Under pipeline parallelism (no front end needed): the exported placement covers every stage's MoE layers and a
restarted job's stages each move to their own rows.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest
from api_server import REPO, Server, free_port, httpx

from moe_serve.parallel.launch import kill_job

pytestmark = pytest.mark.slow
SECRET = "test-secret-19"
REATTACH_S = 20.0  # longer than a restart takes on a loaded 2-core machine (3-10 s)
JOB_FLAGS = ["--dtype", "float32", "--kernel-backend", "torch", "-dp", "2", "--enable-expert-parallel",
             "--collective-timeout", "5", "--num-redundant-experts", "2", "--enable-eplb",
             "--eplb-config", '{"interval": 64, "plan_steps": 0, "layers_per_step": 3, "min_gain": 0}']
# min_gain 0: the restart test needs a re-plan that moves something; the placement the job resumes (left by the
# tests before it) can already balance its load within the default gain of 0.01
REQUESTS = [  # (body, stream): greedy and seeded, streaming and not, n=2
    ({"prompt": "Once upon a time", "temperature": 0}, True),
    ({"prompt": "The expert router", "temperature": 0}, False),
    ({"prompt": "Hello", "temperature": 1.0, "seed": 11}, True),
    ({"prompt": "1 2 3 4", "temperature": 0.8, "top_p": 0.9, "seed": 5}, False),
    ({"prompt": "Mixture of experts", "temperature": 0, "stream_options": {"include_usage": True}}, True),
    ({"prompt": "Tokens", "temperature": 1.0, "seed": 3, "n": 2}, False),
]
MAX_TOKENS = 48


class Env:
    def __init__(self, ckpt: str, tmp: Path):
        self.ckpt, self.tmp = ckpt, tmp
        self.engine_addr = f"tcp://127.0.0.1:{free_port()}"
        self.jobs: list[tuple[subprocess.Popen, int]] = []
        port = free_port()
        cmd = [sys.executable, "-m", "moe_serve.server", "serve", ckpt, "--frontend-only", "--port", str(port),
               "--frontend-address", self.engine_addr, "--frontend-secret", SECRET, "--engine-heartbeat-timeout", "3",
               "--reattach-timeout", str(REATTACH_S)]
        log = tmp / "frontend.log"
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=open(log, "wb"), stderr=subprocess.STDOUT,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"}, start_new_session=True)
        self.server = Server(f"http://127.0.0.1:{port}", proc, log)

    def start_job(self, max_restarts: int = 0) -> tuple[subprocess.Popen, int]:
        master_port = free_port()
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
               "--master-port", str(master_port), "--max-restarts", str(max_restarts), "--monitor-interval", "0.1",
               "-m", "moe_serve.server", "serve", self.ckpt, "--frontend-address", self.engine_addr, *JOB_FLAGS]
        log = self.tmp / f"job{len(self.jobs)}.log"
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=open(log, "wb"), stderr=subprocess.STDOUT,
                                env={**os.environ, "PYTHONUNBUFFERED": "1", "MOE_FRONTEND_SECRET": SECRET},
                                start_new_session=True)
        self.jobs.append((proc, master_port))
        return proc, master_port

    def wait_attached(self, generation: int = 1, timeout_s: float = 120.0) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                status, body = self.server.get("/health", timeout=2)
                if status == 200 and json.loads(body)["engine_generation"] >= generation \
                        and self.server.get("/ready", timeout=2)[0] == 200:
                    return
            except OSError:
                pass
            assert time.monotonic() < deadline, self.logs()
            assert self.server.proc.poll() is None, self.logs()
            time.sleep(0.2)

    def logs(self) -> str:
        out = [f"--- front end\n{self.server.log()[-4000:]}"]
        for i in range(len(self.jobs)):
            out.append(f"--- job {i}\n{(self.tmp / f'job{i}.log').read_text(errors='replace')[-4000:]}")
        return "\n".join(out)

    def close(self) -> None:
        for proc, master_port in self.jobs:
            kill_job(master_port, grace_s=2)
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        self.server.proc.send_signal(signal.SIGINT)
        try:
            self.server.proc.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(self.server.proc.pid, signal.SIGKILL)
            self.server.proc.wait()


def rank_pid(master_port: int, rank: int) -> int:
    for entry in os.listdir("/proc"):
        try:
            env = open(f"/proc/{entry}/environ", "rb").read().split(b"\0") if entry.isdigit() else []
        except OSError:
            continue
        if f"MASTER_PORT={master_port}".encode() in env and f"RANK={rank}".encode() in env \
                and b"LOCAL_RANK=" + str(rank).encode() in env:
            return int(entry)
    raise AssertionError(f"rank {rank} of the job on port {master_port} not found")


def run_requests(url: str, kill=None) -> tuple[list[dict], float | None, float | None]:
    """Send REQUESTS at once; `kill()` runs once a stream has 8 chunks. Returns per request {texts, usage,
    finish} and, with a kill, the outage: the longest gap over the streams from the last chunk before the
    kill to the first after it, and the kill time."""
    results: list[dict | None] = [None] * len(REQUESTS)
    chunk_times: list[list[float]] = [[] for _ in REQUESTS]
    killed = threading.Event()
    kill_at: list[float] = []

    def one(i: int) -> None:
        body, stream = REQUESTS[i]
        body = {**body, "max_tokens": MAX_TOKENS, "ignore_eos": True, "stream": stream}
        if not stream:
            resp = httpx.post(url + "/v1/completions", json=body, timeout=180)
            data = resp.json()
            assert resp.status_code == 200, data
            choices = sorted(data["choices"], key=lambda c: c["index"])
            results[i] = {"texts": [c["text"] for c in choices], "usage": data["usage"],
                          "finish": [c["finish_reason"] for c in choices]}
            return
        text, usage, finish = "", None, None
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=180) as resp:
            assert resp.status_code == 200
            for line in resp.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                assert "error" not in chunk, chunk
                chunk_times[i].append(time.monotonic())
                if chunk.get("usage"):
                    usage = chunk["usage"]
                for c in chunk["choices"]:
                    text += c["text"]
                    finish = c["finish_reason"] or finish
                if kill is not None and len(chunk_times[i]) == 8 and not killed.is_set():
                    killed.set()
                    kill_at.append(time.monotonic())
                    kill()
        results[i] = {"texts": [text], "usage": usage, "finish": [finish]}

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(REQUESTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(240)
    assert all(r is not None for r in results), "a request failed (see the assertion in its thread)"
    if kill is None:
        return results, None, None
    assert kill_at, "no stream reached 8 chunks: nothing was killed"
    t_kill = kill_at[0]
    gaps = [min(t for t in ts if t > t_kill) - max(t for t in ts if t <= t_kill)
            for ts in chunk_times if ts and min(ts) <= t_kill < max(ts)]
    return results, max(gaps) if gaps else None, t_kill


@pytest.fixture(scope="module")
def env(checkpoint, tmp_path_factory):
    e = Env(checkpoint("v3"), tmp_path_factory.mktemp("reliability"))
    try:
        e.start_job()
        e.wait_attached()
        e.baseline, _, _ = run_requests(e.server.url)  # the run without a failure
        for r in e.baseline:
            assert r["finish"] == ["length"] * len(r["finish"])
        yield e
    finally:
        e.close()


def check_same(results: list[dict], baseline: list[dict]) -> None:
    for i, (got, want) in enumerate(zip(results, baseline)):
        assert got["texts"] == want["texts"], (i, REQUESTS[i])
        assert got["finish"] == want["finish"]
        assert got["usage"] == want["usage"], (i, got["usage"], want["usage"])


def test_a_lost_rank_loses_no_request_when_the_next_job_attaches(env):
    """The job has no restarts left: it ends; the next job (started here) attaches and finishes every request."""
    proc, master_port = env.jobs[-1]
    victim = rank_pid(master_port, 1)

    def kill():
        os.kill(victim, signal.SIGKILL)
        threading.Thread(target=lambda: (proc.wait(60), env.start_job()), daemon=True).start()

    results, outage, _ = run_requests(env.server.url, kill)
    assert proc.returncode not in (None, 0), env.logs()
    check_same(results, env.baseline)
    assert outage is not None, "no stream was open across the kill"
    print(f"\nnew job started by the test: outage (last token before the SIGKILL, first after) {outage:.1f} s; "
          f"{len(REQUESTS)} API calls ({sum(len(r['texts']) for r in results)} completions), 0 lost")


def test_a_lost_rank_under_torchrun_restarts(env):
    """torchrun --max-restarts 1 starts the job again; it resumes the placement exported before. Losing a rank
    again exhausts the restarts: in-flight requests fail with 503 after --reattach-timeout, nothing hangs."""
    generation = json.loads(env.server.get("/health")[1])["engine_generation"]  # (503 once the job below ends)
    for proc, master_port in env.jobs:
        kill_job(master_port, grace_s=2)
    proc, master_port = env.start_job(max_restarts=1)
    env.wait_attached(generation + 1)
    initial = json.loads(env.server.get("/v1/expert_load")[1])["placement"]["phy2log"]
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:  # steps for the balancer (interval 64) to re-plan and export: 3 calls on a
        # quiet machine; its plan is computed in a background thread, which a loaded machine slows down (12 calls
        # were once not enough in a full run)
        assert env.server.post("/v1/completions", {"prompt": "warm the balancer", "max_tokens": 24,
                                                   "ignore_eos": True})[0] == 200
        placement = json.loads(env.server.get("/v1/expert_load")[1])["placement"]["phy2log"]
        if placement != initial:
            break
    results, outage, _ = run_requests(env.server.url, lambda: os.kill(rank_pid(master_port, 1), signal.SIGKILL))
    check_same(results, env.baseline)
    assert outage is not None, "no stream was open across the kill"
    assert proc.poll() is None, env.logs()  # the restarted job serves
    restored = json.loads(env.server.get("/v1/expert_load")[1])["placement"]["phy2log"]
    assert placement != initial, "the balancer moved nothing: no placement to carry over\n" + env.logs()
    assert restored == placement, (initial, placement, restored)
    print(f"\ntorchrun --max-restarts 1: outage (last token before the SIGKILL, first after) {outage:.1f} s; "
          f"{len(REQUESTS)} API calls, 0 lost")

    # restarts exhausted: the requests in flight fail with 503 once --reattach-timeout has passed
    t0 = time.monotonic()
    statuses: list[int] = []
    thread = threading.Thread(target=lambda: statuses.append(httpx.post(
        env.server.url + "/v1/completions", json={"prompt": "doomed", "max_tokens": 500, "ignore_eos": True},
        timeout=120).status_code))
    thread.start()
    while json.loads(env.server.get("/health")[1])["requests_in_flight"] == 0:  # kill it once it runs
        time.sleep(0.02)
    os.kill(rank_pid(master_port, 1), signal.SIGKILL)
    assert proc.wait(60) != 0
    thread.join(REATTACH_S + 30)
    assert statuses == [503], (statuses, env.logs())
    status, body = env.server.get("/health")
    assert status == 503 and "re-attached within" in json.loads(body)["error"]["message"], body
    resp = httpx.post(env.server.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=10)
    assert resp.status_code == 503 and resp.headers["Retry-After"]
    print(f"restarts exhausted: the request in flight failed with 503 after {time.monotonic() - t0:.1f} s; "
          f"/health: {json.loads(body)['error']['message']}")


def test_pipeline_stages_hand_their_placement_to_the_next_job(checkpoint, tmp_path):
    """Two pipeline stages of two DP ranks each (EP over them, redundant slots, a rebalance every 4 steps;
    tests/pp_placement_worker.py): the
    export after a rebalance covers both stages' MoE layers, each row what its stage held then; restoring it,
    as a restarted job does from the front end's welcome, moves each stage to its own rows (and back from the
    placement before the rebalances), and the greedy tokens stay the same."""
    out = tmp_path / "pp.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4", "--master-addr", "127.0.0.1",
           "--master-port", str(free_port()), str(Path(__file__).with_name("pp_placement_worker.py")),
           checkpoint("v3"), str(out)]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=240,
                         env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"})
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    ranks = [json.loads(Path(f"{out}.rank{r}").read_text()) for r in range(4)]  # stage 0: ranks 0, 1; stage 1: 2, 3
    every_layer = sorted(ranks[0]["layers"] + ranks[2]["layers"])
    assert ranks[0]["layers"] and ranks[2]["layers"], "a stage without MoE layers tests nothing here"

    def rows(file: dict, layers: list[int]) -> dict[str, list[int]]:  # (JSON keys are strings)
        by_layer = dict(zip(file["layer_ids"], file["placement"]["phy2log"]))
        return {str(layer): by_layer[layer] for layer in layers}

    for r in ranks[1:]:  # every rank took part in the same exports
        assert [e["file"] for e in r["exports"]] == [e["file"] for e in ranks[0]["exports"]]
    for r in ranks:
        assert r["exports"], "no placement was exported"
        assert r["initial_file"]["layer_ids"] == every_layer
        for e in r["exports"]:
            assert e["file"]["layer_ids"] == every_layer
            assert rows(e["file"], r["layers"]) == e["stage"]
        exported = rows(r["exports"][-1]["file"], r["layers"])
        assert exported != r["initial"], "the balancer moved nothing on this stage: no placement to carry over"
        assert r["restored_initial"] == r["initial"] == rows(r["initial_file"], r["layers"])
        assert r["restored"] == exported
        assert r["tokens_after"] == r["tokens"]
