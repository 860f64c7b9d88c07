"""Turn a hung or broken collective into a prompt exit that names the rank(s) it was waiting on.

Each rank, at start-up:
  - runs a daemon thread that writes `time.time()` to the job's TCPStore under `moe_serve/heartbeat/<rank>`
    every `interval_s` seconds: a rank whose Python stops (dead, or wedged holding the GIL) stops beating;
  - opens a liveness socket (accepts and closes connections, nothing more) and publishes its address in
    the store; every rank reads all addresses once, at start-up. Connecting to a dead process's socket is
    refused at once, so a killed rank is identified in milliseconds, even after the store is gone (under
    torchrun the store's host may be the launcher of the dead rank, which then exits too).

`Watchdog.watch(name, ranks)` wraps one collective:
  - gloo raises when a peer's connection closes, or after the process group's timeout. The wrapper
    catches that and names the lost rank(s): peers whose liveness socket refuses (process gone) and that
    did not report the failure themselves before exiting, else peers whose heartbeat is stale or missing
    (polling up to `stale_after_s + interval_s`), else says all peers are alive but did not join. It prints
        [rank R] collective X failed after Ns (timeout Ts); lost rank(s): 3; group ranks [...]; cause: ...
    ("timed out" instead of "failed" when the timeout expired) to stderr and ends the process with
    os._exit(1): no atexit hooks, no hanging destructors. The rank hosting the store first waits (at most
    a few heartbeats) for its group's live peers to report, so they can still read the heartbeats;
  - a backend that never raises (an NCCL op that blocks the host) is caught by the heartbeat thread:
    a collective still in flight `timeout_s + 2 * interval_s` after it started ends the process the
    same way.
Errors that are not communication failures (a bad split size, a dtype the backend lacks) re-raise.
"""

from __future__ import annotations

import os
import re
import socket
import sys
import threading
import time
from contextlib import contextmanager
from datetime import timedelta

import torch.distributed as dist

HEARTBEAT_KEY = "moe_serve/heartbeat/{}"
LIVENESS_KEY = "moe_serve/liveness/{}"
REPORTED_KEY = "moe_serve/reported/{}"
_COMM_FAILURE = re.compile(r"timed out|timeout|connection|closed|reset by peer|broken pipe|peer|socket", re.I)


def is_comm_failure(err: BaseException) -> bool:
    """Whether an exception from a collective means a peer is gone or late (rather than a local bug)."""
    return isinstance(err, RuntimeError) and bool(_COMM_FAILURE.search(str(err)))


def _route_ip(host: str) -> str:
    """This machine's address on the route to `host` (the master): what peers can reach us at."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((host, 9))  # UDP: no packet is sent
            return s.getsockname()[0]
    except OSError:
        return socket.gethostbyname(socket.gethostname())


def _serve_liveness(srv: socket.socket) -> None:
    while True:
        try:
            conn, _ = srv.accept()
            conn.close()
        except OSError:
            return


class Watchdog:
    def __init__(self, rank: int, host: str, port: int, timeout_s: float, interval_s: float = 1.0,
                 store_host_rank: int | None = 0, world_size: int = 1, key_prefix: str = ""):
        """host, port: the job's TCPStore. store_host_rank: the rank whose process hosts that store (0
        without torchrun's agent store, None when the launcher hosts it). key_prefix: this attempt's keys
        (torchrun restarts a job on the same store: the last attempt's heartbeats must not count)."""
        self.rank, self.host, self.port, self.store_host_rank = rank, host, port, store_host_rank
        self.key_prefix = key_prefix
        self.world_size = world_size
        self.timeout_s, self.interval_s = float(timeout_s), float(interval_s)
        self.stale_after_s = 3 * self.interval_s
        self._inflight: tuple[str, tuple[int, ...], float] | None = None  # (name, ranks, monotonic start)
        self._stop = threading.Event()
        self._failing = threading.Lock()
        self._thread: threading.Thread | None = None
        self._reader_store: dist.TCPStore | None = None
        self._liveness: dict[int, tuple[str, int]] = {}  # rank -> (ip, port), read once at start-up

    def _client(self, timeout_s: float) -> dist.Store:
        store = dist.TCPStore(self.host, self.port, is_master=False, timeout=timedelta(seconds=timeout_s))
        return dist.PrefixStore(self.key_prefix, store) if self.key_prefix else store

    # ---- start-up: heartbeat thread, liveness socket ---------------------------------------------
    def start(self) -> "Watchdog":
        """Every rank of the job must call this at about the same time (it waits for all liveness addresses)."""
        store = self._client(300)  # the heartbeat's own connection: never shares a socket with the main thread
        store.set(HEARTBEAT_KEY.format(self.rank), repr(time.time()))
        srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        srv.bind(("0.0.0.0", 0))
        srv.listen(128)
        threading.Thread(target=_serve_liveness, args=(srv,), name=f"liveness-{self.rank}", daemon=True).start()
        store.set(LIVENESS_KEY.format(self.rank), f"{_route_ip(self.host)}:{srv.getsockname()[1]}")
        keys = [LIVENESS_KEY.format(r) for r in range(self.world_size)]
        store.wait(keys)
        for r, value in enumerate(store.multi_get(keys)):
            ip, port = value.decode().rsplit(":", 1)
            self._liveness[r] = (ip, int(port))
        # A second connection, opened now, for the failure path: if the store's host dies later, its ops fail
        # at once, where opening a connection then would retry for seconds.
        self._reader_store = self._client(max(2.0, 2 * self.interval_s))
        self._thread = threading.Thread(target=self._beat, args=(store,), name=f"heartbeat-{self.rank}", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2 * self.interval_s)

    def _beat(self, store: dist.TCPStore) -> None:
        key = HEARTBEAT_KEY.format(self.rank)
        beating = True
        while not self._stop.wait(self.interval_s):
            if beating:
                try:
                    store.set(key, repr(time.time()))
                except Exception:  # noqa: BLE001 - the store's host is gone; the collective that notices reports it
                    beating = False
            inflight = self._inflight
            if inflight is not None and time.monotonic() - inflight[2] > self.timeout_s + 2 * self.interval_s:
                name, ranks, start = inflight
                self.fail(name, ranks, time.monotonic() - start, None)

    # ---- detection --------------------------------------------------------------------------------
    def gone_ranks(self, ranks: tuple[int, ...], wait_s: float = 0.5) -> list[int]:
        """Peers among `ranks` whose process is gone: their liveness socket refuses or cannot be reached.
        A dying process may still be closing its sockets when its collective peers notice, so this probes
        again for up to `wait_s` while every peer still answers."""
        peers = [r for r in ranks if r != self.rank and r in self._liveness]
        deadline = time.monotonic() + wait_s
        while True:
            gone = []
            for r in peers:
                try:
                    socket.create_connection(self._liveness[r], timeout=1.0).close()
                except OSError:
                    gone.append(r)
            if gone or not peers or time.monotonic() >= deadline:
                return gone
            time.sleep(0.05)

    def _reader(self) -> dist.TCPStore:
        if self._reader_store is None:  # not started; only the failing thread gets here (under self._failing)
            self._reader_store = self._client(max(2.0, 2 * self.interval_s))
        return self._reader_store

    def stale_ranks(self, ranks: tuple[int, ...], wait_s: float | None = None) -> list[int]:
        """Peers among `ranks` whose heartbeat is stale or missing. A peer that stopped a moment ago still has
        a fresh beat, so this polls for up to `wait_s` (default stale_after_s + interval_s) until one goes
        stale. Raises if the store is unreachable."""
        peers = [r for r in ranks if r != self.rank]
        deadline = time.monotonic() + (self.stale_after_s + self.interval_s if wait_s is None else wait_s)
        store = self._reader()
        while True:
            now = time.time()
            stale = []
            for r in peers:
                key = HEARTBEAT_KEY.format(r)
                if not store.check([key]) or now - float(store.get(key)) > self.stale_after_s:
                    stale.append(r)
            if stale or time.monotonic() >= deadline:
                return stale
            time.sleep(min(0.25, self.interval_s / 4))

    def _reported(self, ranks: list[int]) -> set[int]:
        """Those of `ranks` that reported a failed collective themselves (empty if the store is unreachable)."""
        try:
            store = self._reader()
            return {r for r in ranks if store.check([REPORTED_KEY.format(r)])}
        except Exception:  # noqa: BLE001 - the store's host is gone: no way to tell, name every gone rank
            return set()

    def _diagnose(self, ranks: tuple[int, ...]) -> tuple[list[int], str]:
        """(lost ranks, text for the report)."""
        gone = self.gone_ranks(ranks)
        if gone:
            # A peer that saw the same failure first has reported it and exited: it is gone too, but it is
            # not the rank that was lost. Name the gone ranks that did not report (all of them if unsure).
            reported = self._reported(gone)
            lost = [r for r in gone if r not in reported] or gone
            text = ", ".join(map(str, lost))
            also = [r for r in gone if r not in lost]
            if also:
                text += "; already reported and exited: " + ", ".join(map(str, also))
            return lost, text
        try:
            stale = self.stale_ranks(ranks)
        except Exception as err:  # noqa: BLE001 - the store itself is unreachable
            if self.store_host_rank is None:
                return [], f"unknown (the launcher's TCPStore at {self.host}:{self.port} is unreachable: {type(err).__name__})"
            host = self.store_host_rank
            return [host], f"{host} (the TCPStore at {self.host}:{self.port} that rank {host} hosts is unreachable: {type(err).__name__})"
        if stale:
            return stale, ", ".join(map(str, stale)) + " (heartbeat stale)"
        peers = [r for r in ranks if r != self.rank]
        return [], f"none with a stale heartbeat; peers {peers} are alive but did not join (hung, or in another collective)"

    def lost_ranks(self, ranks: tuple[int, ...]) -> str:
        return self._diagnose(ranks)[1]

    def _linger_for_peers(self, ranks: tuple[int, ...], lost: list[int]) -> None:
        """Mark this rank as having reported; the store's host then waits (bounded) until the group's other
        live ranks have reported too, so they can still read the heartbeats before the store goes away."""
        try:
            store = self._reader()
            store.set(REPORTED_KEY.format(self.rank), "1")
            if self.rank != self.store_host_rank:
                return
            waiting = [r for r in ranks if r != self.rank and r not in lost]
            deadline = time.monotonic() + self.stale_after_s + 2 * self.interval_s
            while waiting and time.monotonic() < deadline:
                time.sleep(0.05)
                waiting = [r for r in waiting if not store.check([REPORTED_KEY.format(r)])]
        except Exception:  # noqa: BLE001 - best effort: we are exiting anyway
            pass

    # ---- the guard --------------------------------------------------------------------------------
    @contextmanager
    def watch(self, name: str, ranks: tuple[int, ...]):
        start = time.monotonic()
        self._inflight = (name, ranks, start)
        try:
            yield
        except Exception as err:
            if not is_comm_failure(err):
                raise
            self.fail(name, ranks, time.monotonic() - start, err)
        finally:
            self._inflight = None

    def fail(self, name: str, ranks: tuple[int, ...], elapsed_s: float, err: BaseException | None) -> None:
        """Report which rank(s) were lost and end the process (exit code 1). Never returns."""
        self._inflight = None  # the heartbeat goes on while we report and linger: this rank is not lost
        if not self._failing.acquire(blocking=False):  # the other thread is already reporting
            time.sleep(self.stale_after_s + 5 * self.interval_s)
            os._exit(1)
        lost, lost_text = self._diagnose(ranks)
        timed_out = err is None or elapsed_s >= 0.9 * self.timeout_s or "timed out" in str(err).lower()
        what = "timed out" if timed_out else "failed"
        cause = "no progress" if err is None else str(err).strip().splitlines()[0][:200]
        line = (
            f"[rank {self.rank}] collective {name} {what} after {elapsed_s:.1f}s (timeout {self.timeout_s:g}s); "
            f"lost rank(s): {lost_text}; group ranks {list(ranks)}; cause: {cause}\n"
        )
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os.write(2, line.encode())
            self._linger_for_peers(ranks, lost)
            os._exit(1)
