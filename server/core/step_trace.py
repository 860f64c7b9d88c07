"""A line per engine step, for telling the engine's share of inter-token latency from the serving path's.

`moe serve --step-trace FILE` (EngineConfig.step_trace) appends, for every step that ran tokens:

    start end decodes prompt_tokens outputs

start / end: when the model ran, in seconds of CLOCK_MONOTONIC (Python's time.monotonic() and
time.perf_counter() on Linux), the clock a benchmark client on the same machine stamps its tokens with, so its
inter-token gaps can be split into the gaps between the steps that made the tokens and the delay from a step's
end to the token's arrival (scripts/bench_peer.py --step-trace). decodes: requests that computed one token;
prompt_tokens: tokens of prompt chunks; outputs: requests that got a token. Under a multi-rank job each rank
writes FILE.rankN.
"""

from __future__ import annotations

import time
from pathlib import Path

from moe_serve.server.core.scheduler import SchedulerOutput


def trace_path(path: str, rank: int, world_size: int) -> Path:
    return Path(path if world_size == 1 else f"{path}.rank{rank}")


class StepTrace:
    """Appends one line per recorded step (line-buffered: a trace read while the server runs is whole lines)."""

    def __init__(self, path: Path):
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(path, "a", buffering=1)  # noqa: SIM115 - open for the engine's life

    @staticmethod
    def clock() -> float:
        return time.monotonic()

    def record(self, start: float, sched: SchedulerOutput, outputs: int) -> None:
        """A step that began at `start` (clock()) and ends now; an empty one (a dummy batch) is not written."""
        if sched.is_empty:
            return
        decodes, prompt_tokens = sched.shape
        self._file.write(f"{start:.6f} {self.clock():.6f} {decodes} {prompt_tokens} {outputs}\n")


def read_trace(path: Path) -> list[tuple[float, float, int, int, int]]:
    """The steps of a trace file, in order of their start."""
    steps = []
    for line in Path(path).read_text().splitlines():
        parts = line.split()
        if len(parts) == 5:
            steps.append((float(parts[0]), float(parts[1]), int(parts[2]), int(parts[3]), int(parts[4])))
    return sorted(steps)
