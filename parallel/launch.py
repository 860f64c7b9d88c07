"""Start a small world of local processes as torchrun would (for tests, benchmarks and demos).

Children are forked from a forkserver that has imported torch (and nothing else ran there, so no thread
pools are inherited); the first call pays for that import, later worlds start in about a second.
Each child gets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT in its environment, then calls
`target(*args)`. Unlike torch.multiprocessing.spawn, a child that fails does not take the others down:
the caller sees every exit code, which is what the watchdog tests need.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child(target: Callable, args: tuple, rank: int, world_size: int, port: int, log_dir: str | None, env: dict) -> None:
    if log_dir is not None:  # send this process's stdout and stderr (fds, so C++ output too) to rank<R>.log
        fd = os.open(os.path.join(log_dir, f"rank{rank}.log"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
    os.environ.update(env)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    try:
        target(*args)
    except BaseException:
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # skip interpreter teardown (process-group destructors can take seconds)


def spawn_ranks(
    target: Callable[..., Any],
    world_size: int,
    args: tuple = (),
    timeout_s: float = 60.0,
    log_dir: str | Path | None = None,
    env: dict[str, str] | None = None,
) -> list[int]:
    """Run target(*args) in `world_size` fresh processes; returns their exit codes, in rank order.

    `target` must be importable (a module-level function). Processes still alive after `timeout_s`
    are killed (exit code -9). With log_dir, rank R's output goes to log_dir/rank<R>.log.
    """
    ctx = mp.get_context("forkserver")  # children fork from a server that imported torch once: fast starts
    ctx.set_forkserver_preload(["torch", "torch.distributed", "msgpack"])
    port = free_port()
    log_dir = None if log_dir is None else str(log_dir)
    procs = [
        ctx.Process(target=_child, args=(target, args, r, world_size, port, log_dir, dict(env or {})), daemon=False)
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout_s
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    return [p.exitcode for p in procs]


def kill_job(master_port: int, grace_s: float = 10.0) -> None:
    """End every local process of a torchrun job (found by its MASTER_PORT): SIGTERM, then SIGKILL.
    torchrun starts its workers in their own sessions, so killing the launcher's group can orphan them."""
    import signal

    def members() -> list[int]:
        pids = []
        for entry in os.listdir("/proc"):
            if not entry.isdigit() or int(entry) == os.getpid():
                continue
            try:
                env = open(f"/proc/{entry}/environ", "rb").read().split(b"\0")
            except OSError:
                continue
            if f"MASTER_PORT={master_port}".encode() in env:
                pids.append(int(entry))
        return pids

    for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 0.0)):
        for pid in members():
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + wait
        while members() and time.monotonic() < deadline:
            time.sleep(0.2)
