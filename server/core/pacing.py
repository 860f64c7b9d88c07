"""How many prompt tokens a step carries while decodes run: prompts spread thin over their time budget.

A step that carries a long prompt chunk beside running decodes makes every one of those streams wait for it:
an inter-token-latency spike (on a 2-core CPU, a 256-token chunk of the bench model took ~100 ms beside
~7 ms decode steps, a p99 / median inter-token latency of 13x). Cutting every chunk short does not help on
its own: a small chunk of a MoE model still reads most experts' weights, so prefill throughput collapses
and the queue grows. What keeps the steps even is to give each prompt a due time (its arrival + the spread)
and compute, every step, the same smallest number of prompt tokens that finishes every pending prompt by
its due time: the earliest-deadline-first rate. The steps then differ little from one another (thin slices
in most of them, not a rare fat one), and a prompt that waits past its due time gets everything the token
budget allows.

Every prompt then starts about `spread` after it arrives, even at light load. A latency budget lets prompts
go faster where the steps have room: `StepCost` fits a step's time to its decodes and prompt tokens over the
recent steps, and `prompt_tokens_within` says how many prompt tokens keep a step within `slowdown` x what its
decodes alone take. With one (`prompt_slowdown`), the scheduler gives pending prompts that many every step,
and the due-time rate where that is more. Prompts start sooner, but the steps differ more (a step carries
prompt tokens up to the budget, or none): a trade, measured in docs/benchmarks.md.

A cluster of arrivals is what still makes steps uneven at high load: every prompt must be done by its due
time, and prompt tokens lengthen the steps that carry them, so a step carries about R T / (1 - R c) of them (R
prompt tokens arriving a second, T the decodes' step time, c a prompt token's cost), several times the mean when
arrivals bunch up. A latest due time (`prompt_spread_max`) lets such a cluster stretch: while every prompt can
still be done by arrival + that, a step carries at most BURST x the prompt tokens steps have carried lately (a
`RunningMean` over about 50 steps), else the rate that meets the latest due times. Prompts start by arrival +
spread where arrivals are even, and later only where they bunch; a prompt that arrives to a queue longer than a
bunch (OVERLOAD) keeps arrival + spread as its latest, so that saturation is not slowed.

Pure arithmetic; the scheduler calls it with what it knows (tokens left, seconds left, the recent steps).
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch


def prompt_tokens_per_step(pending: Iterable[tuple[int, float]], step_seconds: float) -> int:
    """The fewest prompt tokens per step that, the same every step, compute each prompt by its due time.

    `pending`: (prompt tokens left, seconds until it is due) per prompt, in the order the scheduler serves
    them (first come, first served). A step is assumed to take `step_seconds`. A prompt already due counts
    as due at the end of this step.
    """
    if step_seconds <= 0:
        raise ValueError(f"step_seconds must be positive, got {step_seconds!r}")
    need, rate = 0, 0
    for tokens, seconds_left in pending:
        need += tokens
        steps = max(1, math.floor(seconds_left / step_seconds))
        rate = max(rate, -(-need // steps))
    return rate


# The most prompt tokens a step carries, over their recent mean, while a latest due time allows. Simulated
# (bench_itl.py --simulate, the bench model's step costs, 14.4 req/s, spreads 300 / 450 ms): 1.2 took 32-request
# streams above an inter-token p99 / p50 of 1.5 from 38% to 15% (128-request ones from 53% to 13%); 1.5 to 12% /
# 17%, 2 to 33% / 37% (docs/benchmarks.md).
BURST = 1.2
# A prompt does not stretch where, even by the latest due times, it and those before it would need more than
# OVERLOAD x that cap a step: a queue that long is overload, where stretching only delays every first token.
# Simulated with the requests of a saturation run arriving over 160 ms after a stretch of 14.5 req/s: TTFT p99
# 457 ms (519 without this guard, 452 without a latest due time) for the same inter-token gains at 9-14.4 req/s.
OVERLOAD = 2


class RunningMean:
    """A running mean (exponentially forgotten); None before the first value."""

    def __init__(self, forget: float):
        self.forget, self.value = forget, None

    def observe(self, x: float) -> None:
        self.value = x if self.value is None else self.forget * self.value + (1 - self.forget) * x


class StepTimer(RunningMean):
    """Recent step time in seconds (times that are not positive and finite are left out)."""

    def __init__(self, forget: float = 0.8):
        super().__init__(forget)

    @property
    def seconds(self) -> float | None:
        return self.value

    def observe(self, seconds: float) -> None:
        if math.isfinite(seconds) and seconds > 0:
            super().observe(seconds)


class StepCost:
    """A step's time fitted as a + b * decodes + c * prompt_tokens by least squares over the steps seen, each
    weighed by forget ** (steps since), so the fit follows the load and the machine (about 1 / (1 - forget)
    steps). A small prior pulls b to 0 while the number of decodes barely changes; c needs prompt tokens
    that vary from step to step (none when they do not)."""

    def __init__(self, forget: float = 0.98):
        if not 0 < forget < 1:
            raise ValueError(f"forget must be in (0, 1), got {forget!r}")
        self.forget = forget
        self.gram = [[0.0] * 3 for _ in range(3)]   # sum of w x x^T, x = (1, decodes, prompt tokens)
        self.moment = [0.0] * 3                     # sum of w x seconds

    def observe(self, decodes: int, prompt_tokens: int, seconds: float) -> None:
        if not math.isfinite(seconds) or seconds <= 0:
            return
        x = (1.0, float(decodes), float(prompt_tokens))
        for i in range(3):
            self.moment[i] = self.forget * self.moment[i] + x[i] * seconds
            for j in range(3):
                self.gram[i][j] = self.forget * self.gram[i][j] + x[i] * x[j]

    def fit(self, min_steps: float = 8.0, min_prompt_var: float = 1.0) -> tuple[float, float, float] | None:
        """(a, b, c) in seconds, or None: fewer than `min_steps` (weighted) steps, or prompt tokens per
        step varying by less than `min_prompt_var` (tokens squared), or a fit with c <= 0."""
        g, m = self.gram, self.moment
        w = g[0][0]
        if w < min_steps:
            return None
        mean_p = g[0][2] / w
        if g[2][2] / w - mean_p * mean_p < min_prompt_var:
            return None
        gram = torch.tensor(g, dtype=torch.float64)
        gram[1, 1] += 0.01 * w    # the prior on b: as if 1% of the steps had seen b = 0 over one decode of spread
        try:
            a, b, c = torch.linalg.solve(gram, torch.tensor(m, dtype=torch.float64)).tolist()
        except torch.linalg.LinAlgError:  # singular: the steps do not tell the three terms apart
            return None
        return (a, b, c) if c > 0 and math.isfinite(a + b + c) else None


def prompt_tokens_within(coef: tuple[float, float, float], decodes: int, slowdown: float) -> int | None:
    """The most prompt tokens a step of `decodes` decodes may carry and take at most `slowdown` x the time its
    decodes alone would, by the fitted cost (a, b, c); None where the fit says nothing useful (a step of
    decodes alone fitted at no time)."""
    a, b, c = coef
    alone = a + b * decodes
    if alone <= 0 or c <= 0:
        return None
    return max(0, int((slowdown - 1.0) * alone / c + 1e-6))  # (a whole number of tokens survives rounding)
