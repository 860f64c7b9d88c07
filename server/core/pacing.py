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

Pure arithmetic; the scheduler calls it with what it knows (tokens left, seconds left, the recent step time).
"""

from __future__ import annotations

import math
from collections.abc import Iterable


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


class StepTimer:
    """A running mean of recent step times (exponentially forgotten); None before the first step."""

    def __init__(self, forget: float = 0.8):
        self.forget, self.seconds = forget, None

    def observe(self, seconds: float) -> None:
        if not math.isfinite(seconds) or seconds <= 0:
            return
        self.seconds = seconds if self.seconds is None else self.forget * self.seconds + (1 - self.forget) * seconds
