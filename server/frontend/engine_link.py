"""The front end's end of the engine link: the socket, which engine is attached, and when it is lost.

The front end binds a ROUTER socket (message types in server/frontend/engine_loop.py) in one of two ways:
  - `spawn()`: ipc in a private temporary directory (mode 0700), and it starts the engine process itself
    (`moe serve MODEL`: the front end in rank 0 of the job);
  - `listen(address)`: TCP (`moe serve MODEL --frontend-only --frontend-address tcp://HOST:PORT`); engine
    jobs started on their own (`torchrun ... moe serve MODEL --frontend-address ...`) attach to it, and a
    job torchrun restarts after losing a rank attaches again. Beyond loopback a shared secret is required.
An engine says `hello` (with the secret; answered `welcome`, with the last exported expert placement, or
`rejected`) and, once loaded, `ready`: it is then *attached*. Messages from any other peer are dropped. It
is detached when its connection closes (a ZMQ monitor event for that connection's descriptor) or after
`heartbeat_timeout_s` of silence; `alive` is then False. A detachment that outlasts `reattach_timeout_s`
fails the requests in flight; the spawned process's exit fails them at once (it is not restarted).

`EngineClient` (server/frontend/engine_client.py) is this link plus the requests: it supplies `sinks`,
`_resubmit` (run on each attachment), `_on_engine_message`, `_fail_requests` and `_fail_pending_calls`.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import multiprocessing
import os
import secrets
import shutil
import tempfile
import threading
import time
from urllib.parse import urlsplit

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from moe_serve.server.frontend.engine_loop import pack, run_engine_process, unpack

log = logging.getLogger(__name__)

LOOPBACK = ("127.0.0.1", "localhost", "::1", "[::1]")
MAX_MESSAGE_BYTES = 1 << 28  # a bound on what an unauthenticated peer can make this process buffer


def check_listen_address(address: str, secret: str | None) -> None:
    """A TCP address the front end may bind: a shared secret is required beyond loopback."""
    parts = urlsplit(address)
    if parts.scheme != "tcp" or not parts.hostname or not parts.port:
        raise ValueError(f"--frontend-address must look like tcp://HOST:PORT, got {address!r}")
    if parts.hostname not in LOOPBACK and not secret:
        raise ValueError(f"--frontend-address {address} listens beyond loopback: set --frontend-secret (or "
                         "MOE_FRONTEND_SECRET) on the front end and on the engine job")


class EngineLink:
    def __init__(self, engine_kwargs: dict, heartbeat_timeout_s: float = 30.0, log_level: int = logging.WARNING,
                 secret: str | None = None, reattach_timeout_s: float = 300.0):
        self.engine_kwargs, self.heartbeat_timeout_s, self.log_level = engine_kwargs, heartbeat_timeout_s, log_level
        self.secret, self.reattach_timeout_s = secret, reattach_timeout_s
        self.info: dict = {}
        self.last_message = 0.0
        self.dead_reason: str | None = None  # the spawned engine process is gone (it is not restarted)
        self.process = None
        self.ipc_dir: str | None = None
        self.engine: bytes | None = None  # the attached engine's routing id
        self.engine_fd: int | None = None  # and the file descriptor of its connection (to notice it close)
        self.hellos: dict[bytes, dict] = {}  # peers that gave the secret, by routing id
        self.generation = 0  # engines attached so far
        self.detached_since: float | None = time.time()  # wall clock, for /health; None while attached
        self.gave_up = False  # no engine re-attached within reattach_timeout_s
        self.placement: dict | None = None  # the last placement an engine exported; the next job starts from it
        self.on_attach: list = []  # callbacks(info), run when an engine attaches (the API sizes itself from it)
        self._attached: asyncio.Event | None = None
        self._startup_error: str | None = None
        self._tasks: list[asyncio.Task] = []

    # ---- life cycle -------------------------------------------------------------------------------
    def _bind(self, address: str) -> None:
        self.ctx = zmq.asyncio.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.SNDHWM, 0)
        self.sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        self.sock.bind(address)
        self._attached = asyncio.Event()
        self._monitor = self.sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self._tasks = [asyncio.create_task(self._read_loop()), asyncio.create_task(self._watch()),
                       asyncio.create_task(self._watch_connection())]

    def spawn(self) -> None:
        """Bind an ipc socket and start the engine process (it loads the model meanwhile; see `wait_ready`)."""
        self.ipc_dir = tempfile.mkdtemp(prefix="moe-serve-")
        os.chmod(self.ipc_dir, 0o700)
        self.secret = secrets.token_hex(16)
        address = f"ipc://{self.ipc_dir}/engine"
        self._bind(address)
        self.process = multiprocessing.get_context("spawn").Process(
            target=run_engine_process, name="moe-engine", daemon=True,
            args=(self.engine_kwargs, address, self.secret, self.log_level))
        self.process.start()

    def listen(self, address: str) -> None:
        """Bind a TCP socket for engine jobs to attach to (`moe serve --frontend-only`)."""
        check_listen_address(address, self.secret)
        self._bind(address)
        log.warning("front end waiting for engine jobs at %s%s", address,
                    " (shared secret required)" if self.secret else "")

    async def wait_ready(self, timeout_s: float = 3600.0) -> dict:
        """Wait until an engine has loaded the model and attached; returns its `ready` info."""
        deadline = time.monotonic() + timeout_s
        while not self._attached.is_set():
            if self._startup_error is not None:
                raise RuntimeError(f"the engine failed to start: {self._startup_error}")
            if self.process is not None and not self.process.is_alive():
                raise RuntimeError(f"the engine process exited with code {self.process.exitcode} while starting")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the engine did not start within {timeout_s:.0f} s")
            try:
                await asyncio.wait_for(self._attached.wait(), 0.5)
            except asyncio.TimeoutError:
                pass
        return self.info

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)  # no read left pending on a socket we close
        if self._attached is None:
            return
        if self.engine is not None and (self.process is None or self.process.is_alive()):
            try:
                await self.sock.send_multipart([self.engine, pack({"type": "shutdown"})])
            except zmq.ZMQError:
                pass
        if self.process is not None:
            await asyncio.get_running_loop().run_in_executor(None, self.process.join, 10)
            if self.process.is_alive():
                self.process.kill()
        self.sock.disable_monitor()
        self._monitor.close(linger=0)
        self.sock.close(linger=0)
        # Every socket is closed, yet libzmq's term() now and then waits forever (about 1 run in 25 of
        # tests/test_security.py, with nothing left open that pyzmq knows of): terminate from a daemon thread
        # and go on after a bounded wait, so that shutting down never hangs the server or a test.
        closer = threading.Thread(target=self.ctx.term, name="zmq-term", daemon=True)
        closer.start()
        await asyncio.get_running_loop().run_in_executor(None, closer.join, 2.0)
        if closer.is_alive():
            log.warning("the engine link's ZMQ context did not terminate within 2 s; leaving it to process exit")
        if self.ipc_dir is not None:
            shutil.rmtree(self.ipc_dir, ignore_errors=True)

    @property
    def attached(self) -> bool:
        return self.engine is not None and self.detached_since is None

    @property
    def alive(self) -> bool:
        return (self.dead_reason is None and self.attached
                and (self.process is None or self.process.is_alive())
                and time.monotonic() - self.last_message < self.heartbeat_timeout_s)

    def why_not_alive(self) -> str:
        """One line for /health and the 503s."""
        if self.dead_reason is not None:
            return self.dead_reason
        since = time.strftime("%H:%M:%S", time.gmtime(self.detached_since or time.time()))
        if self.gave_up:
            return (f"no engine attached since {since} UTC and none re-attached within {self.reattach_timeout_s:.0f} s "
                    "(--reattach-timeout): the engine job's restarts are exhausted or it was stopped; start an "
                    "engine job with --frontend-address to serve again")
        if self.generation == 0:
            return f"no engine attached yet (waiting since {since} UTC for an engine job to attach)"
        return (f"no engine attached since {since} UTC (the engine job was lost); waiting for the engine job to "
                f"re-attach; {len(self.sinks)} request(s) in flight will continue then")

    def _send(self, msg: dict) -> None:
        """To the attached engine; without one, nothing is sent (requests wait in `sinks` for the next)."""
        if self.engine is not None:
            self.sock.send_multipart([self.engine, pack(msg)])

    # ---- what comes back --------------------------------------------------------------------------
    async def _read_loop(self) -> None:
        while True:
            frames = await self.sock.recv_multipart(copy=False)
            try:
                peer, raw = frames
                fd = raw.get(zmq.SRCFD)
                peer, msg = peer.bytes, unpack(raw.bytes)
                kind = msg["type"]
            except Exception:  # noqa: BLE001 - malformed: not from an engine of ours
                log.warning("dropped a malformed message on the engine socket")
                continue
            if kind == "hello":
                self._hello(peer, msg)
            elif peer not in self.hellos:
                log.warning("dropped a %r message from a peer that has not given the secret", kind)
            elif kind == "ready":
                self._attach(peer, msg)
                self.engine_fd = fd
            elif kind == "startup_error":
                log.error("engine job (pid %s) failed to start: %s", self.hellos[peer].get("pid"), msg["message"])
                self._startup_error = msg["message"]
            elif peer != self.engine:
                continue  # a previous engine's last words
            else:
                self._heard_from_engine()
                if kind == "placement":
                    self.placement = msg["data"]
                else:
                    self._on_engine_message(msg)

    def _hello(self, peer: bytes, msg: dict) -> None:
        given = str(msg.get("secret") or "").encode()
        if self.secret and not hmac.compare_digest(given, self.secret.encode()):
            log.warning("rejected an engine (pid %s): wrong or missing shared secret", msg.get("pid"))
            self.sock.send_multipart([peer, pack({"type": "rejected", "message": "wrong or missing shared secret "
                                                  "(--frontend-secret / MOE_FRONTEND_SECRET)"})])
            return
        self.hellos[peer] = msg
        log.log(logging.INFO if self.process is not None else logging.WARNING,
                "engine connected (pid %s, job %r, restart %s); loading", msg.get("pid"), msg.get("job"),
                msg.get("restart"))
        self.sock.send_multipart([peer, pack({"type": "welcome", "placement": self.placement})])

    def _attach(self, peer: bytes, info: dict) -> None:
        """A loaded engine takes over: the requests in flight go to it (and a previous engine still connected,
        e.g. a second job started by mistake, is told to shut down: one engine serves at a time)."""
        lost = self.detached_since
        if self.engine is not None and self.engine != peer:
            self.sock.send_multipart([self.engine, pack({"type": "shutdown"})])
            if self.detached_since is None:
                lost = time.time()  # the new job was ready before the old one's loss was noticed
        self.engine, self.info, self.generation = peer, info, self.generation + 1
        self.detached_since, self.gave_up = None, False
        self.last_message = time.monotonic()
        self._fail_pending_calls("the engine job was replaced")
        n = self._resubmit()
        for callback in self.on_attach:
            callback(info)
        if self.generation > 1:
            log.warning("engine job attached (pid %s, generation %d) %.1f s after the last one was lost; "
                        "re-submitted %d request(s) in flight", info.get("pid"), self.generation,
                        time.time() - (lost or time.time()), n)
        self._attached.set()

    def _heard_from_engine(self) -> None:
        self.last_message = time.monotonic()
        if self.detached_since is not None and not self.gave_up:
            log.warning("the engine is answering again")
            self.detached_since = None

    async def _watch(self) -> None:
        """The spawned process's exit fails everything (it is not restarted); an attached engine's silence
        detaches it; a detachment that outlasts reattach_timeout_s fails the requests in flight."""
        while True:
            await asyncio.sleep(0.25)
            if self.process is not None:
                if not self.process.is_alive() and self.dead_reason is None and self._attached.is_set():
                    self._fail_all(f"the engine process exited (code {self.process.exitcode})")
                continue
            now = time.monotonic()
            if self.attached and now - self.last_message > self.heartbeat_timeout_s:
                self._detach(f"the engine job is silent for {self.heartbeat_timeout_s:.0f} s",
                             time.time() - (now - self.last_message))
            if (self.detached_since is not None and self.generation > 0 and not self.gave_up
                    and time.time() - self.detached_since > self.reattach_timeout_s):
                self.gave_up = True
                reason = self.why_not_alive()
                log.error("%s; failing %d request(s)", reason, len(self.sinks))
                self._fail_requests(reason)

    async def _watch_connection(self) -> None:
        """The attached engine's connection closing (its process ended) detaches it at once."""
        while True:
            event = parse_monitor_message(await self._monitor.recv_multipart())
            if event["event"] == zmq.EVENT_DISCONNECTED and event["value"] == self.engine_fd and self.attached:
                self._detach("the engine job's connection closed", time.time())
                self.engine = None  # gone for good: what it still had queued is dropped

    def _detach(self, why: str, since: float) -> None:
        self.detached_since = since
        log.error("%s: detached; %d request(s) in flight wait for the next job (at most %.0f s)", why,
                  len(self.sinks), self.reattach_timeout_s)
        self._fail_pending_calls("the engine job was lost")

    def _fail_all(self, reason: str) -> None:
        self.dead_reason = reason
        log.error("%s; failing %d requests", reason, len(self.sinks))
        self._fail_requests(reason)
        self._fail_pending_calls(reason)
