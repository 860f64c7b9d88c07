"""Serving benchmark: replays a request set against an OpenAI-compatible `/v1/completions` endpoint.

Open loop: request i is sent at its Poisson arrival time whatever the server is doing (rate `inf` sends
them all at once). Every request streams, with `max_tokens` = its output length, `ignore_eos` and greedy
sampling, so output lengths are fixed and both engines do the same work. Per rate it reports completed
and failed requests, TTFT / TPOT / ITL / E2E percentiles, throughput and goodput: completed requests per
second whose TTFT <= `ttft_ms` and TPOT <= `tpot_ms` (TPOT = (E2E - TTFT) / (output tokens - 1)).

    moe bench serve --base-url http://127.0.0.1:8000 --request-rates 0.5 1 2 inf --num-prompts 64
    python scripts/bench_serving.py ... (the same flags)

Request sets: a JSONL file (`{"prompt": "..." | "prompt_token_ids": [...], "output_len": N}` per line)
or generated token-id prompts (input/output length distributions, shared-prefix fraction, seed).
A failure (connection error, HTTP 4xx/5xx, a stream that ends early, the time limit) is counted under
its reason; the run never raises for one. Every run is bounded: `--max-seconds-per-rate` and
`--request-timeout-s`. Only loopback addresses are accepted unless `--allow-remote`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import random
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from importlib import metadata
from pathlib import Path
from urllib.parse import urlparse

PERCENTILES = (50, 90, 99)
LOOPBACK_HOSTS = {"127.0.0.1", "localhost", "::1"}


# ---- request sets ----------------------------------------------------------------------------------
@dataclass
class BenchRequest:
    prompt: str | list[int]  # text or token ids
    prompt_len: int  # tokens (for text prompts: as given in the JSONL, else a rough count)
    output_len: int


def generate_requests(num: int, input_len: int, output_len: int, vocab_size: int, *, input_dist: str = "uniform",
                      output_dist: str = "fixed", range_ratio: float = 0.5, prefix_fraction: float = 0.0,
                      seed: int = 0, min_token_id: int = 3) -> list[BenchRequest]:
    """`num` token-id prompts. Lengths: "fixed" = the mean; "uniform" = integers in mean * [1 - r, 1 + r].
    The first round(prefix_fraction * input_len) tokens are one prefix shared by every prompt (capped at
    each prompt's length - 1 so every prompt has its own tail). Ids are drawn in [min_token_id, vocab_size)."""
    if num < 1 or input_len < 1 or output_len < 1:
        raise ValueError(f"num ({num}), input_len ({input_len}) and output_len ({output_len}) must be at least 1")
    if not 0.0 <= prefix_fraction <= 1.0:
        raise ValueError(f"prefix_fraction must be in [0, 1], got {prefix_fraction}")
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"range_ratio must be in [0, 1), got {range_ratio}")
    if not 0 <= min_token_id < vocab_size:
        raise ValueError(f"min_token_id {min_token_id} must be below vocab_size {vocab_size}")
    rng = random.Random(seed)

    def draw(mean: int, dist: str) -> int:
        if dist == "fixed":
            return mean
        if dist == "uniform":
            return rng.randint(max(1, math.floor(mean * (1 - range_ratio))), max(1, math.ceil(mean * (1 + range_ratio))))
        raise ValueError(f"length distribution {dist!r} is not one of: fixed, uniform")

    prefix = [rng.randrange(min_token_id, vocab_size) for _ in range(round(prefix_fraction * input_len))]
    out = []
    for _ in range(num):
        n_in, n_out = draw(input_len, input_dist), draw(output_len, output_dist)
        shared = prefix[: max(0, n_in - 1)] if prefix else []
        ids = shared + [rng.randrange(min_token_id, vocab_size) for _ in range(n_in - len(shared))]
        out.append(BenchRequest(ids, len(ids), n_out))
    return out


def load_jsonl(path: str | Path, num: int | None = None, default_output_len: int | None = None) -> list[BenchRequest]:
    """One request per line: `prompt` (text) or `prompt_token_ids`, and `output_len` (or `max_tokens`)."""
    out = []
    for lineno, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        row = json.loads(line)
        prompt = row.get("prompt_token_ids", row.get("prompt"))
        if prompt is None or (isinstance(prompt, list) and not all(isinstance(t, int) for t in prompt)):
            raise ValueError(f"{path}:{lineno}: needs 'prompt' (text) or 'prompt_token_ids' (list of ints)")
        n_out = row.get("output_len", row.get("max_tokens", default_output_len))
        if not isinstance(n_out, int) or n_out < 1:
            raise ValueError(f"{path}:{lineno}: needs 'output_len' (a positive int), or pass --output-len")
        n_in = row.get("prompt_len", len(prompt) if isinstance(prompt, list) else max(1, len(prompt.split())))
        out.append(BenchRequest(prompt, int(n_in), n_out))
        if num is not None and len(out) >= num:
            break
    if not out:
        raise ValueError(f"{path}: no requests")
    return out


def save_jsonl(requests: list[BenchRequest], path: str | Path) -> None:
    key = lambda r: "prompt_token_ids" if isinstance(r.prompt, list) else "prompt"  # noqa: E731
    Path(path).write_text("".join(json.dumps({key(r): r.prompt, "prompt_len": r.prompt_len,
                                              "output_len": r.output_len}) + "\n" for r in requests))


# ---- arrivals and statistics -----------------------------------------------------------------------
def arrival_times(num: int, rate: float, seed: int = 0, burstiness: float = 1.0) -> list[float]:
    """Send times (s from the start) of `num` requests. Gaps are Gamma(burstiness, 1 / (rate * burstiness)):
    exponential (a Poisson process) at burstiness 1; rate inf sends everything at 0."""
    if rate <= 0 or burstiness <= 0:
        raise ValueError(f"rate ({rate}) and burstiness ({burstiness}) must be positive")
    if math.isinf(rate):
        return [0.0] * num
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(num):
        t += rng.gammavariate(burstiness, 1.0 / (rate * burstiness))
        out.append(t)
    return out


def percentile(values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default); nan for no values."""
    if not values:
        return float("nan")
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


@dataclass
class RequestResult:
    ok: bool = False
    prompt_len: int = 0
    output_len: int = 0  # tokens generated (usage.completion_tokens, else the chunk count)
    expected_output_len: int = 0
    ttft_s: float = float("nan")
    e2e_s: float = float("nan")
    itl_s: list[float] = field(default_factory=list)  # gaps between chunks after the first
    error: str = ""
    sent_at_s: float = 0.0  # from the start of the rate's run

    @property
    def tpot_s(self) -> float:
        return (self.e2e_s - self.ttft_s) / (self.output_len - 1) if self.output_len > 1 else 0.0


def _dist(values_s: list[float]) -> dict:
    ms = [v * 1000.0 for v in values_s]
    d = {"mean": sum(ms) / len(ms) if ms else float("nan")}
    d.update({f"p{q}": percentile(ms, q) for q in PERCENTILES})
    return d


def summarize(results: list[RequestResult], duration_s: float, ttft_ms: float, tpot_ms: float) -> dict:
    """Per-rate figures; latencies in ms, over completed requests only."""
    done = [r for r in results if r.ok]
    errors: dict[str, int] = {}
    for r in results:
        if not r.ok:
            errors[r.error] = errors.get(r.error, 0) + 1
    good = [r for r in done if r.ttft_s * 1000 <= ttft_ms and r.tpot_s * 1000 <= tpot_ms]
    out_tokens = sum(r.output_len for r in done)
    dur = max(duration_s, 1e-9)
    return {
        "num_requests": len(results), "completed": len(done), "failed": len(results) - len(done), "errors": errors,
        "duration_s": duration_s, "prompt_tokens": sum(r.prompt_len for r in done), "output_tokens": out_tokens,
        "request_throughput": len(done) / dur, "output_throughput": out_tokens / dur,
        "total_token_throughput": (out_tokens + sum(r.prompt_len for r in done)) / dur,
        "goodput": len(good) / dur, "good_requests": len(good),
        "ttft_ms": _dist([r.ttft_s for r in done]), "tpot_ms": _dist([r.tpot_s for r in done if r.output_len > 1]),
        "itl_ms": _dist([g for r in done for g in r.itl_s]), "e2el_ms": _dist([r.e2e_s for r in done]),
    }


# ---- the client ------------------------------------------------------------------------------------
def _httpx():
    try:
        import httpx
    except ImportError:  # newer openai releases ship the client as httpx2
        import httpx2 as httpx
    return httpx


def completion_body(model: str, req: BenchRequest) -> dict:
    return {"model": model, "prompt": req.prompt, "max_tokens": req.output_len, "temperature": 0.0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}


async def send_request(client, url: str, model: str, req: BenchRequest, headers: dict | None = None) -> RequestResult:
    """One streaming completion. Never raises (cancellation aside): failures land in `error`."""
    res = RequestResult(prompt_len=req.prompt_len, expected_output_len=req.output_len)
    t0 = time.perf_counter()
    last = t0
    chunks, usage_tokens, done = 0, None, False
    try:
        async with client.stream("POST", url, json=completion_body(model, req), headers=headers) as resp:
            if resp.status_code != 200:
                body = (await resp.aread())[:200].decode(errors="replace")
                res.error = f"HTTP {resp.status_code}" + (f": {body}" if resp.status_code < 500 else "")
                return res
            async for line in resp.aiter_lines():
                line = line.strip()
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    done = True
                    break
                msg = json.loads(data)
                now = time.perf_counter()
                if msg.get("choices"):
                    if chunks == 0:
                        res.ttft_s = now - t0
                    else:
                        res.itl_s.append(now - last)
                    chunks, last = chunks + 1, now
                if msg.get("usage"):
                    usage_tokens = msg["usage"].get("completion_tokens")
                if msg.get("error"):
                    res.error = f"stream error: {str(msg['error'])[:120]}"
                    return res
        res.e2e_s = last - t0 if chunks else float("nan")
        res.output_len = usage_tokens if usage_tokens is not None else chunks
        if not done:
            res.error = "stream ended without [DONE]"
        elif chunks == 0:
            res.error = "no tokens"
        elif res.output_len != req.output_len:
            res.error = f"wrong output length ({res.output_len} != {req.output_len})"
        else:
            res.ok = True
    except asyncio.CancelledError:
        raise
    except Exception as exc:  # noqa: BLE001 - connection errors, timeouts, bad JSON: counted, never fatal
        res.error = type(exc).__name__
    return res


class _Progress:
    """tqdm when installed, else a line on stderr every 10%."""

    def __init__(self, total: int, desc: str, enabled: bool = True):
        self.total, self.desc, self.n, self.bar = total, desc, 0, None
        self.enabled = enabled
        if enabled:
            try:
                from tqdm import tqdm

                self.bar = tqdm(total=total, desc=desc, file=sys.stderr, leave=False)
            except ImportError:
                pass

    def update(self) -> None:
        self.n += 1
        if self.bar is not None:
            self.bar.update(1)
        elif self.enabled and (self.n == self.total or self.n % max(1, self.total // 10) == 0):
            print(f"{self.desc}: {self.n}/{self.total}", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


async def run_rate(url: str, model: str, requests: list[BenchRequest], rate: float, *, seed: int = 0,
                   burstiness: float = 1.0, max_seconds: float = 300.0, request_timeout_s: float = 120.0,
                   headers: dict | None = None, progress: bool = True) -> tuple[list[RequestResult], float]:
    """Send `requests` at their arrival times (open loop) and collect results. Whatever has not finished
    `max_seconds` after the start is cancelled and counted as failed ("time limit")."""
    httpx = _httpx()
    times = arrival_times(len(requests), rate, seed, burstiness)
    bar = _Progress(len(requests), f"rate {rate:g}", progress)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    timeout = httpx.Timeout(request_timeout_s, connect=min(10.0, request_timeout_s))
    async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
        start = time.perf_counter()

        async def one(req: BenchRequest, at: float) -> RequestResult:
            await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
            sent = time.perf_counter() - start
            res = await send_request(client, url, model, req, headers)
            res.sent_at_s = sent
            bar.update()
            return res

        tasks = [asyncio.create_task(one(r, t)) for r, t in zip(requests, times)]
        finished, pending = await asyncio.wait(tasks, timeout=max_seconds)
        for t in pending:
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        duration = time.perf_counter() - start
    bar.close()
    results = []
    for req, t in zip(requests, tasks):
        if t in finished and t.exception() is None:
            results.append(t.result())
        else:
            results.append(RequestResult(prompt_len=req.prompt_len, expected_output_len=req.output_len,
                                         error="time limit"))
    if pending:  # requests cut by the time limit: the run lasted max_seconds, not until the last finished
        duration = min(duration, max_seconds)
    return results, duration


# ---- environment, endpoint discovery, reporting ----------------------------------------------------
def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def git_commit(repo: Path | None = None) -> str | None:
    repo = repo or Path(__file__).resolve().parents[1]
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=repo, capture_output=True,
                               text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return (sha + ("-dirty" if dirty else "")) if sha else None


CPU_FLAGS = ("avx2", "avx512f", "avx512bw", "avx512_bf16", "avx_ne_convert", "amx_bf16")  # what bf16 speed hangs on


def environment() -> dict:
    cpu, flags = "", []
    try:
        info = Path("/proc/cpuinfo").read_text().splitlines()
        cpu = next((line.split(":", 1)[1].strip() for line in info if line.startswith("model name")), "")
        have = next((set(line.split(":", 1)[1].split()) for line in info if line.startswith("flags")), set())
        flags = [f for f in CPU_FLAGS if f in have]
    except OSError:
        pass
    mem = None
    try:
        mem = round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
    except (ValueError, OSError):
        pass
    return {"project": "moe-serve", "project_version": _version("moe-serve"), "git_commit": git_commit(),
            "torch": _version("torch"), "triton": _version("triton"), "transformers": _version("transformers"),
            "python": platform.python_version(), "platform": platform.platform(), "machine": platform.machine(),
            "cpu": cpu, "cpu_flags": flags, "cpu_count": os.cpu_count(), "memory_gib": mem, "hostname": platform.node()}


def check_loopback(base_url: str) -> None:
    host = urlparse(base_url).hostname or ""
    if host not in LOOPBACK_HOSTS and not host.startswith("127."):
        raise ValueError(f"--base-url {base_url} is not a loopback address; benchmarks send traffic only to "
                         "127.0.0.1 / localhost here (pass --allow-remote to override)")


def discover(base_url: str, headers: dict | None = None) -> tuple[str | None, dict]:
    """(first served model id, server version info) from GET /v1/models and /version; (None, {}) if absent."""
    httpx = _httpx()
    model, info = None, {}
    try:
        r = httpx.get(base_url + "/v1/models", headers=headers, timeout=10)
        if r.status_code == 200 and r.json().get("data"):
            model = r.json()["data"][0]["id"]
        r = httpx.get(base_url + "/version", timeout=10)
        if r.status_code == 200:
            info = r.json()
    except Exception:  # noqa: BLE001 - discovery is best effort
        pass
    return model, info


def format_table(rows: list[dict], title: str = "") -> str:
    head = (f"{'rate':>6} {'ok':>5} {'fail':>5} {'req/s':>6} {'out tok/s':>9} {'goodput':>7} "
            f"{'TTFT p50':>8} {'p90':>7} {'p99':>7} {'TPOT p50':>8} {'p90':>6} {'p99':>6} {'ITL p99':>7}")
    lines = [title] if title else []
    lines += [head, "-" * len(head)]
    for r in rows:
        s, t, p, i = r["summary"], r["summary"]["ttft_ms"], r["summary"]["tpot_ms"], r["summary"]["itl_ms"]
        lines.append(f"{r['rate']:>6g} {s['completed']:>5} {s['failed']:>5} {s['request_throughput']:>6.2f} "
                     f"{s['output_throughput']:>9.1f} {s['goodput']:>7.2f} {t['p50']:>8.0f} {t['p90']:>7.0f} "
                     f"{t['p99']:>7.0f} {p['p50']:>8.1f} {p['p90']:>6.1f} {p['p99']:>6.1f} {i['p99']:>7.1f}")
    lines.append("(latencies in ms; goodput = requests/s meeting the TTFT and TPOT targets)")
    return "\n".join(lines)


# ---- entry points ----------------------------------------------------------------------------------
def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="server root (loopback only)")
    p.add_argument("--model", default=None, help="model name for requests (default: the first of GET /v1/models)")
    p.add_argument("--api-key", default=None)
    p.add_argument("--request-rates", type=float, nargs="+", default=[0.5, 1, 2, 4, math.inf],
                   help="requests/s, one run each; inf = all at once")
    p.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of the gaps (1 = Poisson)")
    p.add_argument("--dataset", default=None, help="JSONL request set (else generated)")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64, help="generated set; also the JSONL default")
    p.add_argument("--input-dist", default="uniform", choices=["fixed", "uniform"])
    p.add_argument("--output-dist", default="fixed", choices=["fixed", "uniform"])
    p.add_argument("--range-ratio", type=float, default=0.5, help="uniform lengths: mean * [1 - r, 1 + r]")
    p.add_argument("--prefix-fraction", type=float, default=0.0, help="share of input_len that is a common prefix")
    p.add_argument("--vocab-size", type=int, default=None, help="generated ids below this (default: from --model-dir)")
    p.add_argument("--model-dir", default=None, help="checkpoint dir to read vocab_size from")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ttft-ms", type=float, default=500.0)
    p.add_argument("--tpot-ms", type=float, default=50.0)
    p.add_argument("--max-seconds-per-rate", type=float, default=300.0, help="cut-off per rate (cut requests fail)")
    p.add_argument("--request-timeout-s", type=float, default=120.0)
    p.add_argument("--warmup-requests", type=int, default=2, help="sent one by one before the first rate")
    p.add_argument("--result-json", default=None, help="write the results here")
    p.add_argument("--label", default=None, help="name of the engine under test, for the JSON and the table")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--allow-remote", action="store_true", help=argparse.SUPPRESS)


def build_request_set(args: argparse.Namespace) -> list[BenchRequest]:
    if args.dataset:
        return load_jsonl(args.dataset, args.num_prompts, args.output_len)
    vocab = args.vocab_size
    if vocab is None and args.model_dir:
        vocab = json.loads((Path(args.model_dir) / "config.json").read_text())["vocab_size"]
    if vocab is None:
        raise ValueError("generated prompts need --vocab-size or --model-dir (or give --dataset)")
    return generate_requests(args.num_prompts, args.input_len, args.output_len, vocab, input_dist=args.input_dist,
                             output_dist=args.output_dist, range_ratio=args.range_ratio,
                             prefix_fraction=args.prefix_fraction, seed=args.seed)


def run_benchmark(args: argparse.Namespace, requests: list[BenchRequest] | None = None) -> dict:
    """Warm-up, then one open-loop run per rate; returns the result document (also written if asked)."""
    base = args.base_url.rstrip("/")
    if not args.allow_remote:
        check_loopback(base)
    requests = requests if requests is not None else build_request_set(args)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else None
    found, server_info = discover(base, headers)
    model = args.model or found
    if model is None:
        raise ValueError(f"no --model given and GET {base}/v1/models answered nothing usable")
    url = base + "/v1/completions"
    if args.warmup_requests:
        warm = [BenchRequest(r.prompt, r.prompt_len, min(r.output_len, 4)) for r in requests[: args.warmup_requests]]
        asyncio.run(run_rate(url, model, warm, math.inf, max_seconds=min(120.0, args.max_seconds_per_rate),
                             request_timeout_s=args.request_timeout_s, headers=headers, progress=False))
    rows = []
    for rate in args.request_rates:
        load_before = os.getloadavg()[0]  # shared machine: how busy it was (the server under test included)
        results, duration = asyncio.run(run_rate(
            url, model, requests, rate, seed=args.seed, burstiness=args.burstiness,
            max_seconds=args.max_seconds_per_rate, request_timeout_s=args.request_timeout_s, headers=headers,
            progress=not args.no_progress))
        summary = summarize(results, duration, args.ttft_ms, args.tpot_ms)
        summary["loadavg_1m"] = [round(load_before, 2), round(os.getloadavg()[0], 2)]  # before, after
        rows.append({"rate": rate, "summary": summary,
                     "requests": [{k: v for k, v in asdict(r).items() if k != "itl_s"} | {"tpot_s": r.tpot_s}
                                  for r in results]})
        print(format_table(rows[-1:]).splitlines()[-2], file=sys.stderr, flush=True)
    config = {k: v for k, v in vars(args).items() if k not in ("api_key", "func")}
    doc = {"schema": "moe-bench-serve/1", "label": args.label, "model": model, "base_url": base,
           "server_info": server_info, "config": config, "environment": environment(),
           "slo": {"ttft_ms": args.ttft_ms, "tpot_ms": args.tpot_ms},
           "request_set": {"num_requests": len(requests), "prompt_tokens": sum(r.prompt_len for r in requests),
                           "output_tokens": sum(r.output_len for r in requests)},
           "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "rates": rows}
    if args.result_json:
        Path(args.result_json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.result_json).write_text(json.dumps(to_json(doc), indent=1))
    return doc


def to_json(x):
    """Strict-JSON copy: inf -> "inf", nan -> null, anything unknown -> str."""
    if isinstance(x, dict):
        return {str(k): to_json(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [to_json(v) for v in x]
    if isinstance(x, float):
        return None if math.isnan(x) else ("inf" if x == math.inf else "-inf" if x == -math.inf else x)
    if x is None or isinstance(x, (bool, int, str)):
        return x
    return str(x)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench_serving", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    return run_cli(p.parse_args(argv))


def run_cli(args: argparse.Namespace) -> int:
    """`moe bench serve` and scripts/bench_serving.py: run, print the table, 2 on bad input."""
    try:
        doc = run_benchmark(args)
    except ValueError as exc:
        print(f"bench serve: error: {exc}", file=sys.stderr)
        return 2
    print(format_table(doc["rates"], f"{args.label or doc['model']} at {doc['base_url']}: "
                                     f"{doc['request_set']['num_requests']} requests per rate, "
                                     f"SLO TTFT <= {args.ttft_ms:g} ms, TPOT <= {args.tpot_ms:g} ms"))
    return 0
