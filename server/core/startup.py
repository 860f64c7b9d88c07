"""Start-up timing: where the seconds from process start to `/ready` go.

Phases (seconds, each measured where it happens and reported once the server is ready):
  frontend_import  front-end process start -> its app is being built (interpreter, CLI, FastAPI, uvicorn)
  engine_import    engine process start -> engine modules imported (interpreter, torch, transformers)
  parallel_init    process groups, watchdog, rank table (0 for one process)
  weight_load      building the model and reading the checkpoint's tensors
  kv_cache         allocating the paged latent cache
  engine_other     the rest of the engine's construction (config, tokenizer, scheduler, balancer)
  warmup           one tiny greedy generation through the whole path
  total            front-end process start -> ready (the phases overlap where processes run side by side)
"""

from __future__ import annotations

import gc
import os
import time
from contextlib import contextmanager

_IMPORTED_AT = time.time()


def process_start_time() -> float:
    """This process's start as a Unix time: from /proc on Linux, else when this module was imported."""
    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22: start time, clock ticks after boot
        with open("/proc/stat") as f:
            boot = next(int(line.split()[1]) for line in f if line.startswith("btime "))
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return _IMPORTED_AT


def freeze_startup_heap() -> int:
    """Once a process has started (modules, model, tokenizer): collect, then hide everything left from the
    garbage collector (gc.freeze). A full collection walks every tracked object; over the engine's 220 000
    start-up objects (bench model) it took 50-75 ms, a stall of every stream whenever the collector chose to
    run one; frozen, a full collection walks only what serving made since. Returns the objects frozen."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def since_process_start() -> float:
    return max(0.0, time.time() - process_start_time())


class PhaseTimer:
    """Named phase durations in seconds, in the order they were first timed."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextmanager
    def phase(self, name: str):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - t0


def summary(seconds: dict[str, float]) -> str:
    """'total 7.9 s (frontend_import 2.1, engine_import 3.0, ...)' for one log line."""
    parts = ", ".join(f"{k} {v:.1f}" for k, v in seconds.items() if k != "total")
    return f"total {seconds.get('total', 0.0):.1f} s ({parts})"
