"""The front end's side of the engine: requests in, outputs back to each request's queue, commands answered.

Built on the link (server/frontend/engine_link.py: the socket, which engine is attached, when it is lost).
Each request registers a `Sink` (an asyncio queue shared by the sub-requests of one API call), which keeps what
a re-submission needs; `call()` sends a command and awaits its reply. When an engine attaches, every request
still in flight is sent to it again, its prompt followed by the tokens it already produced
(`num_prior_outputs`), so it continues where it stopped (server/core/request.py). While none is attached
nothing is sent: new API calls get 503 with Retry-After, requests in flight wait.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import time
from dataclasses import dataclass, field

from moe_serve.server.core.outputs import EngineOutput
from moe_serve.server.core.sampling_params import SamplingParams
from moe_serve.server.frontend.engine_link import EngineLink
from moe_serve.server.frontend.metrics import Metrics



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
    """Where one engine request's outputs go: (index, item) pairs on a queue shared by an API call. It keeps
    what a re-submission needs: the prompt, the parameters and the tokens produced so far."""
    queue: asyncio.Queue
    index: int
    prompt_len: int
    track_metrics: bool = True
    arrival: float = field(default_factory=time.monotonic)
    first_token: float | None = None
    last_token: float | None = None
    prompt_token_ids: list[int] = field(default_factory=list)
    params: SamplingParams | None = None
    produced: list[int] = field(default_factory=list)  # output tokens received so far
    cached: int | None = None  # prompt tokens the first engine served from its prefix cache


class EngineClient(EngineLink):
    def __init__(self, engine_kwargs: dict, metrics: Metrics, heartbeat_timeout_s: float = 30.0,
                 log_level: int = logging.WARNING, secret: str | None = None, reattach_timeout_s: float = 300.0):
        super().__init__(engine_kwargs, heartbeat_timeout_s, log_level, secret, reattach_timeout_s)
        self.metrics = metrics
        self.sinks: dict[str, Sink] = {}
        self.pending: dict[int, asyncio.Future] = {}
        self._nonce = itertools.count()

    # ---- requests ---------------------------------------------------------------------------------
    def add(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, sink: Sink) -> None:
        if self.dead_reason is not None:
            raise EngineDeadError(self.dead_reason)
        sink.prompt_token_ids, sink.params = list(prompt_token_ids), params
        self.sinks[request_id] = sink
        self._send({"type": "add", "request_id": request_id, "prompt_token_ids": prompt_token_ids,
                    "params": dataclasses.asdict(params)})

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
            self._send({"type": "abort", "request_ids": ids})

    async def call(self, kind: str, timeout_s: float = 10.0, **kw) -> dict:
        """Send a command (stats, expert_load) and await the engine's reply."""
        if self.dead_reason is not None:
            raise EngineDeadError(self.dead_reason)
        if self.engine is None:
            raise EngineDeadError(self.why_not_alive())
        nonce = next(self._nonce)
        fut = asyncio.get_running_loop().create_future()
        self.pending[nonce] = fut
        self._send({"type": kind, "nonce": nonce, **kw})
        try:
            reply = await asyncio.wait_for(fut, timeout_s)
        finally:
            self.pending.pop(nonce, None)
        if "error" in reply:
            raise ValueError(reply["error"])
        return reply["data"]

    def _resubmit(self) -> int:
        """Send every request in flight to the engine that has just attached, after what it produced."""
        for rid, sink in self.sinks.items():
            params = dataclasses.replace(sink.params, prompt_logprobs=None) if sink.produced else sink.params
            self._send({"type": "add", "request_id": rid, "prompt_token_ids": sink.prompt_token_ids + sink.produced,
                        "params": dataclasses.asdict(params), "num_prior_outputs": len(sink.produced)})
        return len(self.sinks)

    def _on_engine_message(self, msg: dict) -> None:
        now = self.last_message
        kind = msg["type"]
        if kind == "outputs":
            for item in msg["outputs"]:
                sink = self.sinks.get(item["id"])
                if sink is None:  # aborted meanwhile
                    continue
                if sink.cached is None:
                    sink.cached = item.get("cached", 0)
                item["cached"] = sink.cached  # a re-submission's prompt holds its own outputs: not the client's
                sink.produced.extend(item["t"])
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

    def _fail_pending_calls(self, reason: str) -> None:
        for fut in self.pending.values():
            if not fut.done():
                fut.set_exception(EngineDeadError(reason))

    def _fail_requests(self, reason: str) -> None:
        for sink in self.sinks.values():
            sink.queue.put_nowait((sink.index, EngineFailure(reason, 503)))
        self.sinks.clear()
