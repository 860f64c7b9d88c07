"""Inter-token latency of the engine alone: a Poisson stream of requests replayed in process through
`EngineCore.step()`, no HTTP, so scheduler settings can be compared in seconds. Not a test.

    OMP_NUM_THREADS=2 .venv/bin/python scripts/bench_itl.py --rates 6 9 14
    OMP_NUM_THREADS=2 .venv/bin/python scripts/bench_itl.py --rates 9 \
        --settings "budget=256" "budget=64" "budget=256,spread=300,minchunk=4"

Requests as `vllm bench serve --dataset-name random` makes them for scripts/bench_peer.py: prompts of
input-len x [1 - range-ratio, 1 + range-ratio] random token ids, output-len new tokens (EOS ignored), arriving
at exponential gaps (seeded: every setting gets the same stream). A token's time is when the step that made it
returns; the gaps between a request's tokens are its inter-token latencies (ITL), as a streaming client sees
them less the HTTP path. Per setting and rate: TTFT p50 / p99, TPOT p50, ITL p50 / p99 and their ratio, output
tokens per second, and the steps: how many carried prompt tokens, and the median step time with and without.
floor_ratio is p99 / p50 of the gaps that steps without prompt tokens make (one per token they give): what the
changing number of running streams alone does to inter-token latency, the part no prefill scheduling removes.

`--burn 200:1000 200:1300` runs, beside the engine, one process per pair that busy-loops for the first number
of microseconds and sleeps for the second, over and over (about 0.35 of a core for these two): contention like
a server's front end and its clients, without their HTTP.

`--simulate` replays the same requests through the real scheduler on a virtual clock instead, each step
taking what a model of the machine's step cost says (`--cost a,b,c,w,q` in ms: a + b x decodes + c x prompt
tokens + w x (1 - q ^ (decodes + prompt tokens)), the last term the routed experts' weights, read once per step
for the experts its tokens use; `bench_step.py --mixed` fits it), times a random factor of spread `--noise`
(log-normal sigma; 0: none). It shows what a setting and the request stream alone do to inter-token latency,
apart from the machine's noise, over as many seeded streams (--repeats) as wanted, in seconds.

A setting is comma-separated key=value: budget (max_num_batched_tokens), spread (prompt_spread_ms), seqs
(max_num_seqs), minchunk (min_prompt_chunk), slowdown (prompt_slowdown), spreadmax (prompt_spread_max_ms).
Settings and rates alternate in rounds (--repeats); medians over the rounds.
"""

from __future__ import annotations

import argparse
import functools
import math
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO.parent))  # the checkout as the moe_serve package (see scripts/bench_step.py)

import torch  # noqa: E402

from moe_serve.moe.tiny import ensure_checkpoint  # noqa: E402
from moe_serve.server import LLM, SamplingParams  # noqa: E402
from moe_serve.server.tools.bench import percentile  # noqa: E402

KEYS = {"budget": "max_num_batched_tokens", "spread": "prompt_spread_ms", "seqs": "max_num_seqs",
        "minchunk": "min_prompt_chunk", "slowdown": "prompt_slowdown",
        "spreadmax": "prompt_spread_max_ms"}
DEFAULTS = {"max_num_batched_tokens": 256, "prompt_spread_ms": 0.0, "max_num_seqs": 64, "min_prompt_chunk": 16,
            "prompt_slowdown": 0.0, "prompt_spread_max_ms": 0.0}


def parse_setting(text: str) -> dict:
    out = dict(DEFAULTS)
    for part in filter(None, text.split(",")):
        key, _, value = part.partition("=")
        if key not in KEYS or not value:
            raise SystemExit(f"bad setting {part!r}: use key=value with key one of {', '.join(KEYS)}")
        out[KEYS[key]] = float(value) if key in ("spread", "slowdown", "spreadmax") else int(value)
    return out


def parse_cost(text: str) -> tuple[float, ...]:
    try:
        coef = tuple(float(v) for v in text.split(","))
    except ValueError:
        coef = ()
    if len(coef) != 5 or not 0 < coef[4] < 1:
        raise SystemExit(f"bad --cost {text!r}: give a,b,c,w,q in ms with 0 < q < 1, e.g. 3.79,0.195,0.110,5.77,0.78")
    return coef


def make_requests(n: int, rate: float, input_len: int, output_len: int, range_ratio: float, vocab: int, seed: int):
    """[(arrival seconds, prompt ids)], the same for every setting."""
    rng = random.Random(seed)
    lo, hi = int(input_len * (1 - range_ratio)), int(input_len * (1 + range_ratio))
    t, out = 0.0, []
    for _ in range(n):
        out.append((t, [rng.randrange(vocab) for _ in range(rng.randint(lo, hi))]))
        t += rng.expovariate(rate) if rate != float("inf") else 0.0
    return out


def replay(engine, requests, output_len: int) -> dict:
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    arrival, times, steps = {}, {}, []
    sched = engine.scheduler
    start = time.perf_counter()
    pending = list(requests)
    while pending or engine.has_unfinished_requests():
        now = time.perf_counter() - start
        while pending and pending[0][0] <= now:
            t, ids = pending.pop(0)
            rid = engine.add_request(ids, params)
            arrival[rid], times[rid] = start + t, []
        if not engine.has_unfinished_requests():
            time.sleep(max(0.0, pending[0][0] - (time.perf_counter() - start)))
            continue
        # prompt tokens left to compute: the step carries some (every step gives waiting prompts at least
        # min_prompt_chunk tokens)
        prompts = bool(sched.waiting) or any(r.num_tokens - r.num_computed_tokens > 1 for r in sched.running)
        t0 = time.perf_counter()
        outputs = engine.step()
        t1 = time.perf_counter()
        for out in outputs:
            times[out.request_id].append(t1)
        steps.append((t1 - t0, len(outputs), prompts))
    return summarize(arrival, times, steps, time.perf_counter() - start)


def summarize(arrival: dict, times: dict, steps: list, elapsed: float) -> dict:
    """The figures of one replay: arrival and token times per request, (seconds, tokens out, carried prompt
    tokens) per step."""
    ttft = [ts[0] - arrival[r] for r, ts in times.items() if ts]
    itl = [b - a for ts in times.values() for a, b in zip(ts, ts[1:])]
    tpot = [(ts[-1] - ts[0]) / (len(ts) - 1) for ts in times.values() if len(ts) > 1]
    with_prompt = [s for s, _, p in steps if p]
    without = [s for s, _, p in steps if not p]
    # the floor: gaps as steps without prompt tokens make them (one per token out), the spread that the number
    # of running streams alone gives the inter-token latency
    floor = [s for s, n, p in steps if not p for _ in range(n)]
    return {"ttft_p50": percentile(ttft, 50) * 1e3, "ttft_p99": percentile(ttft, 99) * 1e3,
            "tpot_p50": percentile(tpot, 50) * 1e3, "itl_p50": percentile(itl, 50) * 1e3,
            "itl_p99": percentile(itl, 99) * 1e3, "ratio": percentile(itl, 99) / max(percentile(itl, 50), 1e-9),
            "floor_ratio": percentile(floor, 99) / max(percentile(floor, 50), 1e-9),
            "tok_s": sum(map(len, times.values())) / elapsed,
            "steps": len(steps), "prompt_steps": len(with_prompt),
            "step_prompt_ms": percentile(with_prompt, 50) * 1e3, "step_decode_ms": percentile(without, 50) * 1e3}


def step_cost_ms(coef: tuple[float, ...], decodes: int, prompt_tokens: int) -> float:
    """The step-cost model of --simulate (module doc), in ms."""
    a, b, c, w, q = coef
    return a + b * decodes + c * prompt_tokens + w * (1.0 - q ** (decodes + prompt_tokens))


def fit_step_cost(points: list[tuple[int, int, float]]) -> tuple[tuple[float, ...], float]:
    """Least squares of step_cost_ms to [(decodes, prompt tokens, ms)]: linear in a, b, c, w for each q on a grid
    of 0.01 steps, the q with the smallest residual kept. Returns ((a, b, c, w, q), rms residual in ms)."""
    y = torch.tensor([ms for *_, ms in points], dtype=torch.float64)
    best = None
    for q in torch.arange(0.01, 1.0, 0.01, dtype=torch.float64).tolist():
        x = torch.tensor([[1.0, d, p, 1.0 - q ** (d + p)] for d, p, _ in points], dtype=torch.float64)
        coef = torch.linalg.lstsq(x, y.unsqueeze(1)).solution.squeeze(1)
        rms = float(((x @ coef - y) ** 2).mean().sqrt())
        if best is None or rms < best[1]:
            best = ((*coef.tolist(), q), rms)
    return best


def simulate(setting: dict, requests, output_len: int, coef: tuple[float, ...], noise: float, seed: int) -> dict:
    """`replay` on a virtual clock: the real scheduler, each step taking step_cost_ms x a log-normal factor."""
    from moe_serve.server.core.block_manager import BlockManager
    from moe_serve.server.core.request import Request, RequestStatus
    from moe_serve.server.core.scheduler import Scheduler, SchedulerConfig

    config = SchedulerConfig(max_num_seqs=setting["max_num_seqs"], prompt_spread_s=setting["prompt_spread_ms"] / 1e3,
                             max_num_batched_tokens=setting["max_num_batched_tokens"],
                             min_prompt_chunk=setting["min_prompt_chunk"], prompt_slowdown=setting["prompt_slowdown"],
                             prompt_spread_max_s=setting["prompt_spread_max_ms"] / 1e3)
    clock = [0.0]
    sched = Scheduler(config, BlockManager(65536 // 16, 16, enable_prefix_caching=False), clock=lambda: clock[0])
    rng = random.Random(seed)
    params = SamplingParams(max_tokens=output_len, ignore_eos=True)
    arrival, times, steps = {}, {}, []
    pending = list(requests)
    while pending or sched.has_unfinished():
        while pending and pending[0][0] <= clock[0]:
            t, ids = pending.pop(0)
            rid = f"r{len(arrival)}"
            sched.add_request(Request(rid, ids, params, arrival_time=t))
            arrival[rid], times[rid] = t, []
        if not sched.has_unfinished():
            clock[0] = pending[0][0]
            continue
        out = sched.schedule()
        decodes, prompt_tokens = out.shape
        seconds = step_cost_ms(coef, decodes, prompt_tokens) / 1e3 * (math.exp(rng.gauss(0.0, noise)) if noise else 1.0)
        clock[0] += seconds
        sched.record_step(out, seconds)
        sampled = {s.request.request_id: 0 for s in out.scheduled
                   if s.request.num_computed_tokens + s.num_new_tokens == s.request.num_tokens}
        sched.update_from_output(out, sampled)
        for rid in sampled:
            times[rid].append(clock[0])
            request = sched.requests[rid]
            if request.num_output_tokens >= output_len:
                sched.finish_request(request, RequestStatus.FINISHED_LENGTH)
        steps.append((seconds, len(sampled), prompt_tokens > 0))
    return summarize(arrival, times, steps, clock[0] - requests[0][0])


BURNER = ("import sys, time\nbusy, rest = int(sys.argv[1]) / 1e6, int(sys.argv[2]) / 1e6\n"
          "while True:\n    t = time.perf_counter()\n    while time.perf_counter() - t < busy:\n        pass\n"
          "    time.sleep(rest)\n")


def start_burners(specs: list[str]) -> list[subprocess.Popen]:
    """One busy-loop process per "busy_us:sleep_us" (see the module's doc)."""
    procs = []
    for spec in specs:
        busy, _, rest = spec.partition(":")
        if not (busy.isdigit() and rest.isdigit()):
            raise SystemExit(f"bad --burn {spec!r}: use busy_us:sleep_us, e.g. 200:1000")
        procs.append(subprocess.Popen([sys.executable, "-c", BURNER, busy, rest]))
    return procs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=".cache/bench")
    ap.add_argument("--rates", type=float, nargs="+", default=[6.0, 9.0, 14.0])
    ap.add_argument("--settings", nargs="+", default=["budget=256"])
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--range-ratio", type=float, default=0.5)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--burn", nargs="*", default=[], metavar="BUSY_US:SLEEP_US",
                    help="busy-loop processes beside the engine while it is measured")
    ap.add_argument("--simulate", action="store_true",
                    help="the scheduler alone on a virtual clock, steps timed by --cost (module doc)")
    ap.add_argument("--cost", default="3.79,0.195,0.110,5.77,0.78",
                    help="with --simulate: a,b,c,w,q of the step-cost model in ms (bench_step.py --mixed fits them; "
                         "the default is the bench model on the Intel Xeon VM of docs/benchmarks.md)")
    ap.add_argument("--noise", type=float, default=0.0, help="with --simulate: log-normal sigma of each step's time")
    args = ap.parse_args()
    settings = [(text, parse_setting(text)) for text in args.settings]
    coef = parse_cost(args.cost)
    if args.simulate:
        vocab = 512
        run = {text: functools.partial(simulate, kw, output_len=args.output_len, coef=coef, noise=args.noise)
               for text, kw in settings}
        print(f"simulated: step cost {args.cost} ms (a,b,c,w,q), noise sigma {args.noise:g}")
    else:
        if args.model == ".cache/bench":
            ensure_checkpoint(Path(args.model), "bench")
        engines = {text: LLM(args.model, dtype="bfloat16", kv_cache_tokens=65536, enable_prefix_caching=False,
                             **kw).engine for text, kw in settings}
        vocab = next(iter(engines.values())).model_config.vocab_size
        warm = make_requests(8, float("inf"), args.input_len, 8, args.range_ratio, vocab, args.seed + 1)
        for engine in engines.values():
            replay(engine, warm, 8)
        run = {text: functools.partial(replay, engine, output_len=args.output_len) for text, engine in engines.items()}
        print(f"{args.model}, {torch.get_num_threads()} thread(s)")
    print(f"{args.num_prompts} requests per rate, prompts {args.input_len} x [1 +- {args.range_ratio}], "
          f"{args.output_len} new tokens; medians of {args.repeats}")
    if args.burn:
        print(f"beside busy-loop processes (busy us:sleep us): {' '.join(args.burn)}")
    results: dict[tuple, list[dict]] = {}
    burners = start_burners(args.burn)
    try:
        for rnd in range(args.repeats):
            order = settings if rnd % 2 == 0 else settings[::-1]
            for rate in args.rates:
                reqs = make_requests(args.num_prompts, rate, args.input_len, args.output_len, args.range_ratio, vocab,
                                     args.seed + (int(rate * 100) if rate != float("inf") else 99_999) + 1000 * rnd)
                for text, _ in order:
                    kw = {"seed": args.seed + rnd} if args.simulate else {}
                    results.setdefault((text, rate), []).append(run[text](requests=reqs, **kw))
    finally:
        for proc in burners:
            proc.kill()
            proc.wait()
    cols = ["ttft_p50", "ttft_p99", "tpot_p50", "itl_p50", "itl_p99", "ratio", "floor_ratio", "tok_s", "prompt_steps",
            "steps", "step_prompt_ms", "step_decode_ms"]
    print("| setting | rate | " + " | ".join(cols) + " |")
    print("|" + "---|" * (len(cols) + 2))
    for (text, rate), runs in results.items():
        med = {c: statistics.median(r[c] for r in runs) for c in cols}
        cells = (f"{med[c]:.2f}" if "ratio" in c else f"{med[c]:.1f}" for c in cols)
        print(f"| {text} | {rate:g} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
