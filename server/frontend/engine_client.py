"""The front end's side of the engine process: spawns it, sends it messages, routes what comes back.

Sockets live in a private temporary directory (mode 0700): `input` (front end PUSH -> engine PULL) and
`output` (engine PUSH -> front end PULL); message types are listed in server/frontend/engine_loop.py. Each request
registers a `Sink` (an asyncio queue shared by the sub-requests of one API call); `call()` sends a
command and awaits its reply. Any message from the engine counts as a heartbeat; `alive` is false once
the process has exited or has been silent for `heartbeat_timeout_s`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import multiprocessing
import os
import shutil
import tempfile
import time
from dataclasses import dataclass, field

import zmq
import zmq.asyncio

from moe_serve.server.frontend.engine_loop import pack, run_engine_process, unpack
from moe_serve.server.frontend.metrics import Metrics
from moe_serve.server.core.outputs import EngineOutput
from moe_serve.server.core.sampling_params import SamplingParams

log = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    pass


@dataclass
class EngineFailure:
    """A request the engine rejected (status 400), failed while running (500) or lost with its process (503)."""
    message: str
    status: int = 400


def engine_output(item: dict) -> EngineOutput:
    """The engine loop's wire item (server/frontend/engine_loop.py) as the engine core's output."""
    lp = item["lp"]
    return EngineOutput(item["id"], item["t"], None if lp is None else [dict(step) for step in lp],
                        item.get("finish"), item.get("stop"), item.get("cached", 0))


@dataclass
class Sink:
    """Where one engine request's outputs go: (index, item) pairs on a queue shared by an API call."""
    queue: asyncio.Queue
    index: int
    prompt_len: int
    track_metrics: bool = True
    arrival: float = field(default_factory=time.monotonic)
    first_token: float | None = None
    last_token: float | None = None


class EngineClient:
    def __init__(self, engine_kwargs: dict, metrics: Metrics, heartbeat_timeout_s: float = 30.0,
                 log_level: int = logging.WARNING):
        self.engine_kwargs, self.metrics = engine_kwargs, metrics
        self.heartbeat_timeout_s, self.log_level = heartbeat_timeout_s, log_level
        self.sinks: dict[str, Sink] = {}
        self.pending: dict[int, asyncio.Future] = {}
        self._nonce = itertools.count()
        self.info: dict = {}
        self.last_message = 0.0
        self.dead_reason: str | None = None
        self.process = None
        self._tasks: list[asyncio.Task] = []

    # ---- life cycle -------------------------------------------------------------------------------
    def spawn(self) -> None:
        """Bind the sockets and start the engine process (it loads the model meanwhile; see `wait_ready`)."""
        self.ipc_dir = tempfile.mkdtemp(prefix="moe-serve-")
        os.chmod(self.ipc_dir, 0o700)
        self.ctx = zmq.asyncio.Context()
        self.input = self.ctx.socket(zmq.PUSH)
        self.output = self.ctx.socket(zmq.PULL)
        input_addr, output_addr = f"ipc://{self.ipc_dir}/input", f"ipc://{self.ipc_dir}/output"
        self.input.bind(input_addr)
        self.output.bind(output_addr)
        self.process = multiprocessing.get_context("spawn").Process(
            target=run_engine_process, name="moe-engine", daemon=True,
            args=(self.engine_kwargs, input_addr, output_addr, self.log_level))
        self.process.start()

    async def wait_ready(self, timeout_s: float = 3600.0) -> dict:
        """Wait until the engine process has loaded the model; returns its `ready` info."""
        deadline = time.monotonic() + timeout_s
        while True:
            if await self.output.poll(500):
                msg = unpack(await self.output.recv())
                if msg["type"] == "ready":
                    self.info = msg
                    break
                if msg["type"] == "startup_error":
                    raise RuntimeError(f"the engine failed to start: {msg['message']}")
            elif not self.process.is_alive():
                raise RuntimeError(f"the engine process exited with code {self.process.exitcode} while starting")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the engine did not start within {timeout_s:.0f} s")
        self.last_message = time.monotonic()
        self._tasks = [asyncio.create_task(self._read_loop()), asyncio.create_task(self._watch_process())]
        return self.info

    async def close(self) -> None:
        if self.process is None:
            return
        for task in self._tasks:
            task.cancel()
        if self.process is not None and self.process.is_alive():
            try:
                await self.input.send(pack({"type": "shutdown"}))
            except zmq.ZMQError:
                pass
            await asyncio.get_running_loop().run_in_executor(None, self.process.join, 10)
            if self.process.is_alive():
                self.process.kill()
        self.input.close(linger=0)
        self.output.close(linger=0)
        self.ctx.term()
        shutil.rmtree(self.ipc_dir, ignore_errors=True)

    @property
    def alive(self) -> bool:
        return (self.dead_reason is None and self.process is not None and self.process.is_alive()
                and time.monotonic() - self.last_message < self.heartbeat_timeout_s)

    # ---- requests ---------------------------------------------------------------------------------
    def add(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, sink: Sink) -> None:
        if self.dead_reason is not None:
            raise EngineDeadError(self.dead_reason)
        self.sinks[request_id] = sink
        self.input.send(pack({"type": "add", "request_id": request_id, "prompt_token_ids": prompt_token_ids,
                              "params": dataclasses.asdict(params)}))

    def abort(self, request_ids: list[str], reason: str = "abort") -> None:
        """Abort requests still running (finished ones are ignored); their KV blocks are freed. `reason` is the
        finish reason the metrics count ("stop" when the front end matched a stop string)."""
        ids = [rid for rid in request_ids if rid in self.sinks]
        if not ids:
            return
        now = time.monotonic()
        for rid in ids:
            sink = self.sinks.pop(rid)
            if sink.track_metrics:
                self.metrics.on_finish(sink, reason, now)
        if self.dead_reason is None:
            self.input.send(pack({"type": "abort", "request_ids": ids}))

    async def call(self, kind: str, timeout_s: float = 10.0, **kw) -> dict:
        """Send a command (stats, expert_load) and await the engine's reply."""
        if self.dead_reason is not None:
            raise EngineDeadError(self.dead_reason)
        nonce = next(self._nonce)
        fut = asyncio.get_running_loop().create_future()
        self.pending[nonce] = fut
        await self.input.send(pack({"type": kind, "nonce": nonce, **kw}))
        try:
            reply = await asyncio.wait_for(fut, timeout_s)
        finally:
            self.pending.pop(nonce, None)
        if "error" in reply:
            raise ValueError(reply["error"])
        return reply["data"]

    # ---- what comes back --------------------------------------------------------------------------
    async def _read_loop(self) -> None:
        while True:
            msg = unpack(await self.output.recv())
            now = self.last_message = time.monotonic()
            kind = msg["type"]
            if kind == "outputs":
                for item in msg["outputs"]:
                    sink = self.sinks.get(item["id"])
                    if sink is None:  # aborted meanwhile
                        continue
                    if sink.track_metrics:
                        self.metrics.on_tokens(sink, len(item["t"]), now)
                    if "finish" in item:
                        del self.sinks[item["id"]]
                        if sink.track_metrics:
                            self.metrics.on_finish(sink, item["finish"], now)
                    sink.queue.put_nowait((sink.index, engine_output(item)))
            elif kind == "error":
                sink = self.sinks.pop(msg["request_id"], None)
                if sink is not None:
                    sink.queue.put_nowait((sink.index, EngineFailure(msg["message"], msg.get("status", 400))))
            elif kind == "reply":
                fut = self.pending.get(msg["nonce"])
                if fut is not None and not fut.done():
                    fut.set_result(msg)

    async def _watch_process(self) -> None:
        while self.process.is_alive():
            await asyncio.sleep(0.5)
        self._fail_all(f"the engine process exited (code {self.process.exitcode})")

    def _fail_all(self, reason: str) -> None:
        self.dead_reason = reason
        log.error("%s; failing %d requests", reason, len(self.sinks))
        for sink in self.sinks.values():
            sink.queue.put_nowait((sink.index, EngineFailure(reason, 503)))
        self.sinks.clear()
        for fut in self.pending.values():
            if not fut.done():
                fut.set_exception(EngineDeadError(reason))
