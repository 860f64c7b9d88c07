"""Thin collectives, each on an explicit `Group`, each guarded by the group's watchdog.

Legend: N rows along dim 0, W ranks in the group. `src` / `dst` are indices WITHIN the group (0..W-1),
not global ranks. A group of one rank has no process group (`pg is None`) and every call is local.
Control messages travel as msgpack bytes in uint8 tensors: nothing is pickled across ranks.
"""

from __future__ import annotations

import collections
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import msgpack
import torch
import torch.distributed as dist

from moe_serve.parallel.watchdog import Watchdog

log = logging.getLogger(__name__)

_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32, torch.int16,
           torch.int8, torch.uint8, torch.bool, torch.float8_e4m3fn)
_MAX_NDIM = 6


@dataclass(frozen=True, eq=False)
class Group:
    """One axis' process group as this rank sees it."""

    name: str  # "tp", "dp", "pp", "ep", "world", "cpu", or "local"
    ranks: tuple[int, ...]  # global ranks in group order
    rank: int  # this process's global rank
    pg: dist.ProcessGroup | None = None  # None only for a group of one rank
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))  # where its tensors live
    watchdog: Watchdog | None = None
    nodes: tuple[int, ...] = ()  # the node (machine) of each member, in group order; () = all on one node

    def __post_init__(self):
        if self.nodes and len(self.nodes) != len(self.ranks):
            raise ValueError(f"group {self.name}: {len(self.nodes)} node ids for {len(self.ranks)} ranks")
        if self.rank not in self.ranks:
            raise ValueError(f"group {self.name}: rank {self.rank} is not among its ranks {list(self.ranks)}")
        if self.pg is None and len(self.ranks) > 1:
            raise ValueError(f"group {self.name} of {len(self.ranks)} ranks needs a process group")

    @classmethod
    def single(cls, name: str = "local", rank: int = 0, device: torch.device | str = "cpu") -> "Group":
        return cls(name, (rank,), rank, None, torch.device(device))

    @property
    def size(self) -> int:
        return len(self.ranks)

    @property
    def index(self) -> int:
        """This rank's position in the group (what torch calls the group rank)."""
        return self.ranks.index(self.rank)

    @property
    def num_nodes(self) -> int:
        return len(set(self.nodes)) if self.nodes else 1


# ---- tensors the backend may still hold -----------------------------------------------------------
# gloo runs collectives on its own worker threads, and a worker drops its hold on an op's tensors just
# after `wait()` has returned here. If Python has already let go of such a tensor, the worker must take the
# GIL to free it; during interpreter shutdown that kills the thread inside a destructor ("terminate called
# without an active exception", SIGABRT: a failed job after correct results). So the last few CPU tensors
# handed to each group's backend stay referenced here, and `drain()`, run before the interpreter finalises
# (parallel.state registers it at exit), waits until the backend holds none of them. Only a worker's latest
# ops can be unreleased, so a short queue per group suffices; CUDA tensors (NCCL) are not held.
_HELD_PER_GROUP = 16
_held: dict[str, collections.deque[torch.Tensor]] = {}


def _hold(group: Group, *tensors: torch.Tensor) -> None:
    if group.device.type == "cpu":
        _held.setdefault(group.name, collections.deque(maxlen=_HELD_PER_GROUP)).extend(tensors)


def drain(timeout_s: float = 5.0) -> bool:
    """Wait (sleeping, so backend threads can run) until no backend thread holds a tensor given to it
    through this module, then let go of them. False if some were still held after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    held = [t for q in _held.values() for t in q]
    while any(t._use_count() > 1 for t in held):
        if time.monotonic() >= deadline:
            log.warning("the collective backend still holds tensors %.0f s after the last op", timeout_s)
            return False
        time.sleep(0.005)
    _held.clear()
    return True


def _guarded(op: str, group: Group, fn: Callable[[], Any], *tensors: torch.Tensor) -> Any:
    _hold(group, *tensors)
    if group.watchdog is None:
        return fn()
    with group.watchdog.watch(f"{op}({group.name})", group.ranks):
        return fn()


def barrier(group: Group) -> None:
    if group.size > 1:
        one = torch.ones(1, device=group.device)
        _guarded("barrier", group, lambda: dist.all_reduce(one, group=group.pg), one)


def all_reduce(x: torch.Tensor, group: Group, op: dist.ReduceOp = dist.ReduceOp.SUM) -> torch.Tensor:
    """In place; returns x."""
    if group.size > 1:
        _guarded("all_reduce", group, lambda: dist.all_reduce(x, op=op, group=group.pg), x)
    return x


def all_gather(x: torch.Tensor, group: Group, dim: int = -1) -> torch.Tensor:
    """Concatenate every rank's x (same shape everywhere) along `dim`, in group order (TP outputs, logits)."""
    if group.size == 1:
        return x
    parts, x = [torch.empty_like(x) for _ in range(group.size)], x.contiguous()
    _guarded("all_gather", group, lambda: dist.all_gather(parts, x, group=group.pg), x, *parts)
    return torch.cat(parts, dim=dim)


def all_to_all_uneven(x_NX: torch.Tensor, send_splits: list[int], recv_splits: list[int], group: Group) -> torch.Tensor:
    """Rows send_splits[w] of x (in order) go to group index w; returns the rows received, by source index.

    x [N, ...] with N = sum(send_splits); result [sum(recv_splits), ...]. Empty splits (and N = 0) are fine.
    """
    W = group.size
    if len(send_splits) != W or len(recv_splits) != W:
        raise ValueError(f"all_to_all_uneven on {W} ranks needs {W} send and recv splits, got {send_splits}, {recv_splits}")
    if sum(send_splits) != x_NX.shape[0]:
        raise ValueError(f"send_splits {send_splits} sum to {sum(send_splits)}, but x has {x_NX.shape[0]} rows")
    if W == 1:
        return x_NX
    out, x_NX = x_NX.new_empty((sum(recv_splits), *x_NX.shape[1:])), x_NX.contiguous()
    _guarded(
        "all_to_all_uneven", group,
        lambda: dist.all_to_all_single(out, x_NX, recv_splits, send_splits, group=group.pg), out, x_NX,
    )
    return out


# ---- control messages: msgpack bytes in uint8 tensors -------------------------------------------------
def _to_bytes_tensor(obj: Any, device: torch.device) -> torch.Tensor:
    data = msgpack.packb(obj, use_bin_type=True)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device)


def _from_bytes_tensor(t: torch.Tensor) -> Any:
    return msgpack.unpackb(t.cpu().numpy().tobytes(), raw=False, strict_map_key=False)


def broadcast_object(obj: Any, group: Group, src: int = 0) -> Any:
    """Send a msgpack-able object (dicts, lists, str, bytes, numbers) from group index `src` to all."""
    if group.size == 1:
        return obj
    is_src = group.index == src
    payload = _to_bytes_tensor(obj, group.device) if is_src else None
    n = torch.tensor([payload.numel() if is_src else 0], dtype=torch.int64, device=group.device)
    _guarded("broadcast_object.size", group, lambda: dist.broadcast(n, group=group.pg, group_src=src), n)
    if not is_src:
        payload = torch.empty(int(n.item()), dtype=torch.uint8, device=group.device)
    _guarded("broadcast_object", group, lambda: dist.broadcast(payload, group=group.pg, group_src=src), payload)
    return obj if is_src else _from_bytes_tensor(payload)


def all_gather_object(obj: Any, group: Group) -> list[Any]:
    """Every rank's msgpack-able object, in group order."""
    if group.size == 1:
        return [obj]
    payload = _to_bytes_tensor(obj, group.device)
    sizes = all_gather(torch.tensor([payload.numel()], dtype=torch.int64, device=group.device), group, dim=0).tolist()
    padded = torch.zeros(max(sizes), dtype=torch.uint8, device=group.device)
    padded[: payload.numel()] = payload
    gathered = all_gather(padded, group, dim=0).view(group.size, -1)
    return [_from_bytes_tensor(gathered[i, :n]) for i, n in enumerate(sizes)]


# ---- pipeline stages: hidden states point to point ----------------------------------------------------
def send_tensor(x: torch.Tensor, dst: int, group: Group) -> None:
    """Send x (any shape up to 6 dims, a dtype from _DTYPES) to group index `dst`; a header carries its shape."""
    if x.dim() > _MAX_NDIM:
        raise ValueError(f"send_tensor handles at most {_MAX_NDIM} dims, got {x.dim()}")
    header = torch.zeros(2 + _MAX_NDIM, dtype=torch.int64)
    header[0], header[1] = _DTYPES.index(x.dtype), x.dim()
    header[2 : 2 + x.dim()] = torch.tensor(x.shape, dtype=torch.int64)
    header = header.to(group.device)
    _guarded("send.header", group, lambda: dist.send(header, group=group.pg, group_dst=dst), header)
    if x.numel():
        x = x.contiguous()
        _guarded("send", group, lambda: dist.send(x, group=group.pg, group_dst=dst), x)


def isend_tensor(x: torch.Tensor, dst: int, group: Group) -> Callable[[], None]:
    """Start sending x as send_tensor does, without waiting (so the sender can compute on while the
    receiver takes it); returns a function that waits for the send to finish."""
    if x.dim() > _MAX_NDIM:
        raise ValueError(f"isend_tensor handles at most {_MAX_NDIM} dims, got {x.dim()}")
    header = torch.zeros(2 + _MAX_NDIM, dtype=torch.int64)
    header[0], header[1] = _DTYPES.index(x.dtype), x.dim()
    header[2 : 2 + x.dim()] = torch.tensor(x.shape, dtype=torch.int64)
    header, payload = header.to(group.device), x.contiguous()
    _hold(group, header, payload)
    works = [dist.isend(header, group=group.pg, group_dst=dst)]
    if payload.numel():
        works.append(dist.isend(payload, group=group.pg, group_dst=dst))

    def wait() -> None:
        in_flight = (header, payload)  # keep both alive until the send is done
        for work in works:
            _guarded("isend", group, work.wait)
        del in_flight

    return wait


def recv_tensor(src: int, group: Group) -> torch.Tensor:
    """Receive what send_tensor sent from group index `src`, on this group's device."""
    header = torch.empty(2 + _MAX_NDIM, dtype=torch.int64, device=group.device)
    _guarded("recv.header", group, lambda: dist.recv(header, group=group.pg, group_src=src), header)
    code, ndim, *dims = header.tolist()
    x = torch.empty(dims[:ndim], dtype=_DTYPES[code], device=group.device)
    if x.numel():
        _guarded("recv", group, lambda: dist.recv(x, group=group.pg, group_src=src), x)
    return x
