"""The engine's side of the front end <-> engine link, and the engine loop every rank runs.

One ZMQ connection: the front end binds a ROUTER (ipc in a private directory when it spawns the engine
itself; TCP when it runs on its own, `moe serve --frontend-only`), the engine leader (global rank 0)
connects a DEALER to it. Messages are msgpack maps with a "type" (never pickle). Engine -> front end:
    hello        {secret, pid, job, restart}      (first, before loading; the front end answers welcome
                                                  or rejected: a wrong secret ends the engine with that line)
    ready        {max_model_len, vocab_size, eos_token_id, kv_cache_tokens_total, max_num_seqs,
                  data_parallel_size, pid, startup: {phase: seconds}}   (once, after loading: the engine is
                  attached; the front end then re-sends the requests it still has in flight)
    startup_error {message}
    outputs      {outputs: [{id, t: new token ids, lp: new logprobs [[[id, logprob], ...] per token] | None,
                             cached: prompt tokens from the prefix cache, and when finished: finish, stop}]}
                 (what is new this step only, as the engine core reports it; text is the front end's)
    error        {request_id, message, status}  (that request only; the loop goes on): status 400 for a
                                                request the engine rejected, 500 for one that failed while running
    reply        {nonce, data}
    placement    {data}                         (after each completed rebalance: the placement file's JSON for
                                                every MoE layer, balancer/placement_file.py; the front end keeps
                                                the last one; server/frontend/placement_handoff.py)
    heartbeat    {}                             (every HEARTBEAT_S, busy or idle)
Front end -> engine:
    welcome      {placement: the last `placement` data it holds, or None}   (the job starts from it)
    rejected     {message}
    add          {request_id, prompt_token_ids, params (SamplingParams fields), num_prior_outputs (optional:
                  tokens at the end of the prompt the request had produced in an earlier job)}
    abort        {request_ids}
    stats        {nonce}                        -> reply: engine.stats() + expert-load summary
    expert_load  {nonce, op: window|total|record|start|stop|reset}  -> reply: ExpertLoadRecorder.to_json / state
    shutdown     {}

The loop runs steps while there is work; otherwise it blocks on the socket (waking for heartbeats).
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import time
import traceback

import msgpack
import zmq

from moe_serve.parallel import comm
from moe_serve.server.core.startup import freeze_startup_heap
from moe_serve.server.frontend.placement_handoff import PlacementExport, start_from_placement

HEARTBEAT_S = 0.5

log = logging.getLogger(__name__)


def pack(msg: dict) -> bytes:
    return msgpack.packb(msg, use_bin_type=True)


def unpack(raw: bytes) -> dict:
    return msgpack.unpackb(raw, raw=False, strict_map_key=False)


def _job_identity() -> dict:
    """Which engine job this is, for the front end's log: torchrun's run id and restart count when under it."""
    return {"pid": os.getpid(), "job": os.environ.get("TORCHELASTIC_RUN_ID", ""),
            "restart": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)}


def attach(ctx: zmq.Context, address: str, secret: str | None, timeout_s: float = 600.0) -> tuple[zmq.Socket, dict]:
    """Engine leader: connect to the front end at `address`, say hello, wait for its welcome. Returns the
    socket and the welcome; raises RuntimeError with one line when rejected or when nobody answers."""
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.SNDHWM, 0)  # never block a step on a slow reader
    sock.setsockopt(zmq.LINGER, 1000)
    sock.connect(address)
    sock.send(pack({"type": "hello", "secret": secret or "", **_job_identity()}))
    if not sock.poll(int(timeout_s * 1000)):
        sock.close(linger=0)
        raise RuntimeError(f"no front end answered at {address} within {timeout_s:.0f} s; start it with "
                           "`moe serve MODEL --frontend-only --frontend-address ADDRESS` first")
    welcome = unpack(sock.recv())
    if welcome.get("type") != "welcome":
        sock.close(linger=0)
        raise RuntimeError(f"the front end at {address} refused this engine: {welcome.get('message', welcome)}")
    return sock, welcome


def run_engine_process(engine_kwargs: dict, address: str, secret: str | None, log_level: int = logging.WARNING,
                       log_tag: str = "engine") -> None:
    """The engine leader: the process the front end spawns, or rank 0 of an engine job that attaches to a
    front end running on its own (`moe serve --frontend-address`)."""
    logging.basicConfig(level=log_level, format=f"%(asctime)s [{log_tag}] %(name)s: %(message)s", datefmt="%H:%M:%S")
    ctx = zmq.Context()
    try:
        sock, welcome = attach(ctx, address, secret)
    except RuntimeError as exc:
        ctx.term()
        raise SystemExit(f"moe serve: {exc}") from None
    try:
        from moe_serve.server.core.config import EngineConfig
        from moe_serve.server.core.engine import EngineCore
        from moe_serve.server.core.startup import since_process_start

        engine_import_s = since_process_start()
        engine = EngineCore(EngineConfig(**engine_kwargs))
        recorder = engine.expert_load_recorder  # on by default (None without MoE layers); the engine closes its steps
        start_from_placement(engine, welcome.get("placement"))
    except Exception as exc:  # noqa: BLE001 - reported to the front end, which exits with it
        log.exception("engine failed to start")
        sock.send(pack({"type": "startup_error", "message": f"{type(exc).__name__}: {exc}"}))
        sock.close()
        ctx.term()
        return
    sock.send(pack({"type": "ready", "max_model_len": engine.max_model_len,
                    "vocab_size": engine.model_config.vocab_size, "eos_token_id": engine.eos_token_id,
                    "kv_cache_tokens_total": engine.kv_cache_tokens_total, "pid": os.getpid(),
                    "max_num_seqs": engine.config.max_num_seqs,
                    "data_parallel_size": engine.config.data_parallel_size,
                    "startup": {"engine_import": engine_import_s, **engine.startup_seconds}}))
    freeze_startup_heap()
    try:
        EngineLoop(engine, recorder, sock, sock).run()
    finally:
        sock.close(linger=0)
        ctx.term()


def run_follower(engine_kwargs: dict) -> None:
    """Ranks other than 0 under torchrun: the same engine loop, fed by rank 0's broadcasts."""
    from moe_serve.server.core.config import EngineConfig
    from moe_serve.server.core.engine import EngineCore

    engine = EngineCore(EngineConfig(**engine_kwargs))
    start_from_placement(engine, None)  # rank 0 broadcasts what the front end's welcome carried
    freeze_startup_heap()
    EngineLoop(engine, engine.expert_load_recorder, None, None).run()


class EngineLoop:
    """One rank's engine loop. The leader (global rank 0, or the only rank) talks to the front end;
    under torchrun every other rank runs the same loop with `pull`/`push` None: each iteration the
    leader's messages are broadcast to all ranks (an add goes to the DP rank the leader picked), all
    ranks step together while any has work, and the DP ranks' outputs are gathered to the leader."""

    def __init__(self, engine, recorder, pull: zmq.Socket | None, push: zmq.Socket | None):
        self.engine, self.recorder, self.pull, self.push = engine, recorder, pull, push
        self.last_heartbeat = 0.0
        self.events: list[dict] = []  # outputs and errors of this iteration, on their way to the leader
        state = engine.parallel
        self.cpu, self.dp = state.cpu, state.dp
        self.leader = state.rank == 0
        self.reports = state.coords.pp_rank == 0 and state.coords.tp_rank == 0  # one rank per DP group
        self.next_dp_rank = 0
        self.has_work = False
        self.placements = PlacementExport(engine)

    def run(self) -> None:
        poller = zmq.Poller()
        if self.pull is not None:
            poller.register(self.pull, zmq.POLLIN)
        parent = multiprocessing.parent_process()
        while True:
            msgs = []
            if self.leader:
                timeout_ms = 0 if self.has_work else int(HEARTBEAT_S * 1000)
                while poller.poll(timeout_ms):  # drain everything queued; block only when idle
                    msgs.append(self.route(unpack(self.pull.recv())))
                    timeout_ms = 0
                if parent is not None and not parent.is_alive():
                    log.warning("front end is gone; engine loop exits")
                    msgs.append({"type": "shutdown"})  # every rank stops with it
            if self.cpu.size > 1:
                msgs = comm.broadcast_object(msgs, self.cpu, src=0)
            for msg in msgs:
                if not self.handle(msg):
                    return
            self.has_work = self.engine.any_rank_has_work()
            if self.has_work:
                self.step()
                self.export_placement()
            self.flush()
            if self.leader:
                now = time.monotonic()
                if now - self.last_heartbeat >= HEARTBEAT_S:
                    self.last_heartbeat = now
                    self.push.send(pack({"type": "heartbeat"}))

    def export_placement(self) -> None:
        """Once a rebalance has moved every layer it planned: send the placement of every MoE layer and the
        load it was planned from to the front end, which hands it to the next job (every rank takes part:
        server/frontend/placement_handoff.py)."""
        data = self.placements.after_step()
        if data is not None and self.leader:
            self.push.send(pack({"type": "placement", "data": data}))

    def route(self, msg: dict) -> dict:
        """Leader: pick the DP rank that takes a new request (round robin)."""
        if msg.get("type") == "add":
            msg["dp_rank"] = self.next_dp_rank
            self.next_dp_rank = (self.next_dp_rank + 1) % self.dp.size
        return msg

    def flush(self) -> None:
        """Bring this iteration's outputs and errors to the leader, which sends them to the front end."""
        events, self.events = self.events, []
        if self.dp.size > 1 and self.reports:
            events = [e for share in comm.all_gather_object(events, self.dp) for e in share]
        if not self.leader:
            return
        outputs = [e for e in events if "type" not in e]
        for e in events:
            if "type" in e:
                self.push.send(pack(e))
        if outputs:
            self.push.send(pack({"type": "outputs", "outputs": outputs}))

    def reply(self, msg: dict, data=None, error: str | None = None) -> None:
        if self.leader:
            body = {"type": "reply", "nonce": msg.get("nonce")}
            body.update({"error": error} if error is not None else {"data": data})
            self.push.send(pack(body))

    def handle(self, msg: dict) -> bool:
        """Apply one message; False means shut down."""
        kind = msg.get("type")
        if kind == "add":
            if msg.get("dp_rank", 0) == self.dp.index:
                self.add(msg)
        elif kind == "abort":
            for rid in msg.get("request_ids", []):
                self.engine.abort_request(rid)
        elif kind in ("stats", "expert_load"):
            try:
                data = self.stats() if kind == "stats" else self.expert_load(msg.get("op", "window"))
                self.reply(msg, data)
            except Exception as exc:  # noqa: BLE001 - the caller gets the message, the loop goes on
                self.reply(msg, error=str(exc))
        elif kind == "shutdown":
            return False
        else:
            log.warning("ignoring message of unknown type %r", kind)
        return True

    def add(self, msg: dict) -> None:
        from moe_serve.server.core.sampling_params import SamplingParams

        rid = msg.get("request_id")
        try:
            params = SamplingParams(**msg["params"])
            self.engine.add_request(list(msg["prompt_token_ids"]), params, request_id=rid,
                                    num_prior_outputs=msg.get("num_prior_outputs", 0))
        except Exception as exc:  # noqa: BLE001 - a bad request fails alone
            self.events.append({"type": "error", "request_id": rid, "message": str(exc), "status": 400})

    def step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as exc:  # noqa: BLE001 - fail the requests in flight, keep serving
            log.error("engine step failed; aborting %d requests:\n%s", len(self.engine.requests), traceback.format_exc())
            for rid in list(self.engine.requests):
                self.engine.abort_request(rid)
                self.events.append({"type": "error", "request_id": rid, "message": f"engine step failed: {exc}",
                                    "status": 500})
            return
        for out in outputs:  # (the engine closes the expert-load recorder's step itself)
            if out.error is not None:  # this request failed alone
                self.events.append({"type": "error", "request_id": out.request_id, "message": out.error,
                                    "status": 500})
                continue
            item = {"id": out.request_id, "t": out.new_token_ids, "cached": out.num_cached_tokens,
                    "lp": None if out.new_logprobs is None else [list(d.items()) for d in out.new_logprobs]}
            if out.finished:
                item.update(finish=out.finish_reason, stop=out.stop_reason)
            self.events.append(item)

    def stats(self) -> dict:
        data = dict(self.engine.stats())
        if self.recorder is not None:
            window = self.recorder.to_json("window")
            total = self.recorder.to_json("total")
            data["expert"] = {"layer_ids": window["layer_ids"], "balancedness": window["balancedness"],
                              "ep_size": window["ep_size"],
                              "rank_tokens_total": [sum(col) for col in zip(*total["rank_tokens"])]}
        return data

    def expert_load(self, op: str) -> dict:
        if self.recorder is None:
            raise ValueError("this model has no MoE layers: there is no expert load to report")
        if op == "start":  # every rank records; the leader answers
            self.recorder.start_record()
            return {"recording": True}
        if op == "stop":
            self.recorder.stop_record()
            return {"recording": False}
        if op == "reset":  # after the warm-up generation: its routing is not load
            self.recorder.reset()
            return {"reset": True}
        if op not in ("window", "total", "record"):
            raise ValueError(f"unknown expert_load op {op!r}")
        return self.recorder.to_json(op, sum_over=self.dp)  # every DP rank's tokens (all ranks run this)
