"""Process groups per parallel axis, built once from the torchrun environment and passed around explicitly.

Rank layout: world = pp x dp x tp with tp varying fastest:
    rank = (pp_rank * dp + dp_rank) * tp + tp_rank
Worked example, tp=2, dp=2, pp=2 (8 ranks):
    rank:     0 1 2 3 4 5 6 7
    pp_rank:  0 0 0 0 1 1 1 1
    dp_rank:  0 0 1 1 0 0 1 1
    tp_rank:  0 1 0 1 0 1 0 1
    tp groups [0,1] [2,3] [4,5] [6,7]; dp groups [0,2] [1,3] [4,6] [5,7]; pp groups [0,4] [1,5] [2,6] [3,7];
    ep (stage) groups [0,1,2,3] [4,5,6,7], ep_rank = dp_rank * tp + tp_rank.
Device groups use NCCL on CUDA and gloo on CPU; the `cpu` group (gloo, the whole world) carries control
messages. Nothing here touches module globals: `init_parallel` returns a frozen `ParallelState`.
"""

from __future__ import annotations

import atexit
import logging
import os
import socket
from dataclasses import dataclass
from datetime import timedelta
from typing import Mapping

import torch
import torch.distributed as dist

from moe_serve.parallel import comm
from moe_serve.parallel.comm import Group, all_gather_object
from moe_serve.parallel.config import ParallelConfig
from moe_serve.parallel.watchdog import Watchdog

log = logging.getLogger(__name__)
AXES = ("tp", "dp", "pp", "ep")


@dataclass(frozen=True)
class RankCoordinates:
    rank: int
    pp_rank: int
    dp_rank: int
    tp_rank: int
    ep_rank: int  # index among the dp * tp ranks of this pipeline stage (the EP rank when EP is on)


def rank_coordinates(rank: int, tp: int, dp: int, pp: int) -> RankCoordinates:
    """rank_coordinates(5, tp=2, dp=2, pp=2) -> pp_rank 1, dp_rank 0, tp_rank 1, ep_rank 1."""
    if not 0 <= rank < tp * dp * pp:
        raise ValueError(f"rank {rank} is outside a world of pp {pp} x dp {dp} x tp {tp} = {tp * dp * pp} ranks")
    tp_rank, rest = rank % tp, rank // tp
    dp_rank, pp_rank = rest % dp, rest // dp
    return RankCoordinates(rank, pp_rank, dp_rank, tp_rank, dp_rank * tp + tp_rank)


def group_layout(tp: int, dp: int, pp: int) -> dict[str, list[tuple[int, ...]]]:
    """Every group of every axis (global ranks), in the order all ranks create them. See the module example."""
    r = lambda p, d, t: (p * dp + d) * tp + t  # noqa: E731
    return {
        "tp": [tuple(r(p, d, t) for t in range(tp)) for p in range(pp) for d in range(dp)],
        "dp": [tuple(r(p, d, t) for d in range(dp)) for p in range(pp) for t in range(tp)],
        "pp": [tuple(r(p, d, t) for p in range(pp)) for d in range(dp) for t in range(tp)],
        "ep": [tuple(r(p, d, t) for d in range(dp) for t in range(tp)) for p in range(pp)],
    }


@dataclass(frozen=True)
class ParallelState:
    config: ParallelConfig
    coords: RankCoordinates
    local_rank: int
    device: torch.device
    world: Group  # device group over all ranks
    cpu: Group  # gloo group over all ranks, for control messages
    tp: Group
    dp: Group
    pp: Group
    ep: Group  # the dp * tp ranks of this stage when expert parallelism is on, else this rank alone
    watchdog: Watchdog | None

    @property
    def rank(self) -> int:
        return self.coords.rank

    @property
    def is_first_stage(self) -> bool:
        return self.coords.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.coords.pp_rank == self.config.pipeline_parallel_size - 1


class RankFilter(logging.Filter):
    """Adds `record.rank` so a format string can say which rank speaks."""

    def __init__(self, rank: int):
        super().__init__()
        self.rank = rank

    def filter(self, record: logging.LogRecord) -> bool:
        record.rank = self.rank
        return True


def install_rank_logging(rank: int, level: int = logging.INFO) -> logging.Handler:
    """A stderr handler on the root logger printing `... [rank N] LEVEL name: message` (replaces an earlier one)."""
    root = logging.getLogger()
    for h in list(root.handlers):
        if getattr(h, "_moe_rank_handler", False):
            root.removeHandler(h)
    handler = logging.StreamHandler()
    handler._moe_rank_handler = True  # type: ignore[attr-defined]
    handler.addFilter(RankFilter(rank))
    handler.setFormatter(logging.Formatter("%(asctime)s [rank %(rank)s] %(levelname)s %(name)s: %(message)s"))
    root.addHandler(handler)
    root.setLevel(min(root.level, level) if root.level else level)
    return handler


def _local_state(config: ParallelConfig, device: torch.device) -> ParallelState:
    one = Group.single("local", 0, device)
    return ParallelState(config, rank_coordinates(0, 1, 1, 1), 0, device, one, Group.single("cpu"), one, one, one, one, None)


def init_parallel(
    config: ParallelConfig,
    env: Mapping[str, str] | None = None,
    device: str | torch.device | None = None,
    heartbeat_interval_s: float = 1.0,
) -> ParallelState:
    """Initialise torch.distributed from RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT (torchrun's)
    and build every axis' groups. Call once per process; every rank must call it.

    Without RANK in the environment and a world of one, no process group is made (all groups are local).
    device: defaults to cuda:LOCAL_RANK when CUDA is available, else cpu.
    """
    env = os.environ if env is None else env
    local_rank = int(env.get("LOCAL_RANK", 0))
    if device is None:
        device = f"cuda:{local_rank}" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    if "RANK" not in env:
        if config.world_size != 1:
            raise ValueError(
                f"parallel layout needs {config.world_size} ranks but RANK is not set; "
                f"launch with torchrun --nproc-per-node {config.world_size}"
            )
        return _local_state(config, device)
    rank, world_size = int(env["RANK"]), int(env["WORLD_SIZE"])
    if world_size != config.world_size:
        raise ValueError(
            f"torchrun started {world_size} ranks but the layout pp {config.pipeline_parallel_size} x "
            f"dp {config.data_parallel_size} x tp {config.tensor_parallel_size} needs {config.world_size}"
        )
    install_rank_logging(rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    timeout = timedelta(seconds=config.collective_timeout_s)
    host, port = env["MASTER_ADDR"], int(env["MASTER_PORT"])
    # Our own store (as torch's env:// rendezvous would make it) so the heartbeat can use it too. Under
    # torchrun's agent store every rank is a client; otherwise rank 0 hosts it.
    agent_store = env.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(host, port, world_size, is_master=(rank == 0 and not agent_store),
                          timeout=timedelta(seconds=max(300.0, config.collective_timeout_s)), multi_tenant=True)
    # torchrun --max-restarts starts the job again on the same store: each attempt keeps its own keys, or the
    # new ranks would read the lost ones' addresses (gloo's mesh, the watchdog's heartbeats)
    prefix = f"moe_serve/attempt{env.get('TORCHELASTIC_RESTART_COUNT', '0')}/"
    store = dist.PrefixStore(prefix, store)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
    atexit.register(comm.drain)  # before the interpreter finalises: see parallel/comm.py
    watchdog = Watchdog(rank, host, port, config.collective_timeout_s, heartbeat_interval_s,
                        store_host_rank=None if agent_store else 0, world_size=world_size, key_prefix=prefix).start()

    per_node = config.ranks_per_node or int(env.get("LOCAL_WORLD_SIZE", world_size))
    if world_size % per_node:
        raise ValueError(f"{world_size} ranks do not split into nodes of {per_node} (ranks_per_node or torchrun's "
                         "--nproc-per-node must divide the world)")

    def nodes(ranks: tuple[int, ...]) -> tuple[int, ...]:
        return tuple(r // per_node for r in ranks)

    world_ranks = tuple(range(world_size))
    world = Group("world", world_ranks, rank, dist.group.WORLD, device, watchdog, nodes(world_ranks))
    cpu_pg = dist.group.WORLD if backend == "gloo" else dist.new_group(list(world_ranks), timeout=timeout, backend="gloo")
    cpu = Group("cpu", world_ranks, rank, cpu_pg, torch.device("cpu"), watchdog)

    tp, dp, pp = config.tensor_parallel_size, config.data_parallel_size, config.pipeline_parallel_size
    layout = group_layout(tp, dp, pp)
    if not config.enable_expert_parallel:
        layout["ep"] = [(r,) for r in world_ranks]
    groups: dict[str, Group] = {}
    for axis in AXES:  # every rank creates every group, in the same order (torch requires it)
        for ranks in layout[axis]:
            pg = dist.new_group(list(ranks), timeout=timeout, backend=backend) if len(ranks) > 1 else None
            if rank in ranks:
                groups[axis] = Group(axis, ranks, rank, pg, device, watchdog if pg is not None else None, nodes(ranks))
    state = ParallelState(config, rank_coordinates(rank, tp, dp, pp), local_rank, device, world, cpu,
                          groups["tp"], groups["dp"], groups["pp"], groups["ep"], watchdog)
    atexit.register(_close_at_exit, state)  # runs before the drain registered above (atexit is LIFO)
    return state


def _close_at_exit(state: ParallelState) -> None:
    """At interpreter exit, once the backend holds none of our tensors (nothing in flight), destroy the
    process groups, so gloo's worker threads are joined while the interpreter is whole rather than torn
    down during finalisation (which can abort a finished job: "terminate called without an active
    exception"). If something is still in flight, leave them: joining could wait for a collective's timeout."""
    if comm.drain():
        shutdown(state)


def rank_table(state: ParallelState) -> str | None:
    """Every rank's coordinates as a text table, gathered over the cpu group; returned on rank 0, else None."""
    c = state.coords
    mine = dict(rank=c.rank, host=socket.gethostname(), local_rank=state.local_rank, pp=c.pp_rank, dp=c.dp_rank,
                tp=c.tp_rank, ep=state.ep.index, device=str(state.device))
    rows = all_gather_object(mine, state.cpu)
    if state.rank != 0:
        return None
    cols = list(mine)
    widths = {k: max(len(k), *(len(str(r[k])) for r in rows)) for k in cols}
    lines = ["  ".join(k.rjust(widths[k]) for k in cols)]
    lines += ["  ".join(str(r[k]).rjust(widths[k]) for k in cols) for r in rows]
    return "\n".join(lines)


def log_rank_table(state: ParallelState) -> None:
    """At start-up: every rank takes part; rank 0 prints the table."""
    table = rank_table(state)
    if table is not None:
        cfg = state.config
        log.info("parallel layout pp %d x dp %d x tp %d, ep %d:\n%s", cfg.pipeline_parallel_size,
                 cfg.data_parallel_size, cfg.tensor_parallel_size, cfg.ep_size, table)


def shutdown(state: ParallelState) -> None:
    comm.drain()
    if state.watchdog is not None:
        state.watchdog.stop()
    if dist.is_initialized():
        dist.destroy_process_group()
