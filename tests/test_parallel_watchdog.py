"""A lost or hung rank ends the others within the collective timeout, with a message naming it."""

from __future__ import annotations

import os
import re
import signal
import time

import pytest
import torch

TIMEOUT_S = 5.0


def _lost_rank_worker(out_dir: str, role: dict) -> None:
    """role: {"exit": rank that exits after start-up}, {"hang": rank that sleeps hang_s before joining},
    or {"stop": rank that SIGSTOPs itself (alive, but its heartbeat stops)}."""
    from moe_serve.experts.dispatch import dispatch
    from moe_serve.parallel import comm
    from moe_serve.parallel.config import ParallelConfig
    from moe_serve.parallel.state import init_parallel

    world = int(os.environ["WORLD_SIZE"])
    state = init_parallel(ParallelConfig(data_parallel_size=world, enable_expert_parallel=True,
                                         collective_timeout_s=TIMEOUT_S), heartbeat_interval_s=0.5)
    comm.barrier(state.world)  # everyone is up
    if state.rank == role.get("exit"):
        os._exit(3)
    if state.rank == role.get("stop"):
        os.kill(os.getpid(), signal.SIGSTOP)
    if state.rank == role.get("hang"):
        time.sleep(role["hang_s"])
    with open(os.path.join(out_dir, f"start{state.rank}"), "w") as f:
        f.write(repr(time.time()))
    x = torch.randn(4, 8)
    ids = torch.randint(0, 2 * world, (4, 2))
    dispatch(x, ids, torch.rand(4, 2), 2, state.ep)  # counts all-to-all: cannot complete
    print("collective completed unexpectedly", flush=True)


def _run(tmp_path, world: int, role: dict, limit_s: float):
    from moe_serve.parallel.launch import spawn_ranks

    codes = spawn_ranks(_lost_rank_worker, world, args=(str(tmp_path), role), timeout_s=limit_s, log_dir=tmp_path)
    all_exited = time.time()
    logs = {r: (tmp_path / f"rank{r}.log").read_text() for r in range(world)}
    return codes, logs, all_exited


def _seconds_to_exit(tmp_path, all_exited: float) -> float:
    """From the first rank entering the doomed collective until every process had exited."""
    starts = [float(p.read_text()) for p in tmp_path.glob("start*")]
    return all_exited - min(starts)


@pytest.mark.slow
def test_rank_that_exits_is_named_by_the_others(tmp_path):
    codes, logs, all_exited = _run(tmp_path, 4, {"exit": 3}, limit_s=25)
    assert codes == [1, 1, 1, 3], logs
    for r in range(3):
        line = [ln for ln in logs[r].splitlines() if "lost rank(s)" in ln]
        assert line, logs[r]
        assert re.match(rf"\[rank {r}\] collective all_to_all_uneven\(ep\) (failed|timed out) after [\d.]+s "
                        rf"\(timeout 5s\); lost rank\(s\): 3;", line[0]), line[0]
    assert _seconds_to_exit(tmp_path, all_exited) < TIMEOUT_S


@pytest.mark.slow
def test_store_host_rank_0_lost(tmp_path):
    codes, logs, all_exited = _run(tmp_path, 2, {"exit": 0}, limit_s=25)
    assert codes == [3, 1], logs
    assert re.search(r"\[rank 1\] collective all_to_all_uneven\(ep\) .* lost rank\(s\): 0;", logs[1]), logs[1]
    assert _seconds_to_exit(tmp_path, all_exited) < TIMEOUT_S


@pytest.mark.slow
def test_hung_rank_times_out(tmp_path):
    # rank 1 is alive (its heartbeat is fresh) but joins 8 s late: rank 0 gives up at the 5 s timeout
    codes, logs, _ = _run(tmp_path, 2, {"hang": 1, "hang_s": 8.0}, limit_s=25)
    assert codes == [1, 1], logs
    m = re.search(r"\[rank 0\] collective all_to_all_uneven\(ep\) timed out after ([\d.]+)s \(timeout 5s\); "
                  r"lost rank\(s\): none with a stale heartbeat; peers \[1\] are alive", logs[0])
    assert m, logs[0]
    assert TIMEOUT_S - 0.5 <= float(m.group(1)) <= TIMEOUT_S + 2
    assert "collective completed unexpectedly" not in logs[1]


@pytest.mark.slow
def test_frozen_rank_is_named_by_its_stale_heartbeat(tmp_path):
    # rank 1 is stopped: its sockets stay open (so it looks alive) but its heartbeat stops
    codes, logs, _ = _run(tmp_path, 2, {"stop": 1}, limit_s=14)
    assert codes == [1, -9], logs  # the launcher kills the stopped rank at the end
    assert re.search(r"\[rank 0\] collective all_to_all_uneven\(ep\) timed out after [\d.]+s \(timeout 5s\); "
                     r"lost rank\(s\): 1 \(heartbeat stale\);", logs[0]), logs[0]


def _stuck_worker() -> None:
    """A 'collective' that neither completes nor raises (as an NCCL op can block the host)."""
    from moe_serve.parallel.config import ParallelConfig
    from moe_serve.parallel.state import init_parallel

    state = init_parallel(ParallelConfig(collective_timeout_s=1.0), heartbeat_interval_s=0.25)
    with state.watchdog.watch("stuck_op(world)", (0,)):
        time.sleep(30)


@pytest.mark.slow
def test_collective_that_never_returns_is_ended_by_the_heartbeat_thread(tmp_path):
    from moe_serve.parallel.launch import spawn_ranks

    t0 = time.time()
    codes = spawn_ranks(_stuck_worker, 1, timeout_s=25, log_dir=tmp_path)
    log = (tmp_path / "rank0.log").read_text()
    assert codes == [1], log
    assert re.search(r"\[rank 0\] collective stuck_op\(world\) timed out after 1\.\ds \(timeout 1s\); "
                     r"lost rank\(s\): none with a stale heartbeat; peers \[\] .*cause: no progress", log), log
    assert time.time() - t0 < 20


def test_local_errors_are_not_treated_as_lost_ranks():
    from moe_serve.parallel.watchdog import Watchdog, is_comm_failure

    assert is_comm_failure(RuntimeError("Timed out waiting 5000ms for recv operation to complete"))
    assert is_comm_failure(RuntimeError("Connection closed by peer [127.0.0.1]:1234"))
    assert not is_comm_failure(RuntimeError("Split sizes doesn't match total dim 0 size"))
    assert not is_comm_failure(ValueError("connection"))
    wd = Watchdog(0, "127.0.0.1", 1, timeout_s=5)  # never started: watch() only guards
    with pytest.raises(RuntimeError, match="Split sizes"):
        with wd.watch("all_to_all_uneven(ep)", (0, 1)):
            raise RuntimeError("Split sizes doesn't match total dim 0 size")
    assert wd._inflight is None


def test_peers_that_reported_and_exited_are_not_named_as_lost():
    # Rank 3 dies; ranks 1 and 2 see it first, report and exit before rank 0 probes: all three liveness
    # sockets refuse, but only rank 3 left no report, so rank 3 alone is the lost one.
    import socket
    from datetime import timedelta

    import torch.distributed as dist

    from moe_serve.parallel.watchdog import REPORTED_KEY, Watchdog

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=5))
    wd = Watchdog(0, "127.0.0.1", store.port, timeout_s=5)
    # Addresses that refuse connections: sockets bound but not listening, held open for the whole test (a closed
    # one's port could be handed out again, even as the probe's own source port, which then connects to itself).
    bound = []
    for r in (1, 2, 3):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        wd._liveness[r] = s.getsockname()
        bound.append(s)
    assert wd._diagnose((0, 1, 2, 3)) == ([1, 2, 3], "1, 2, 3")  # no reports: every gone rank is named
    store.set(REPORTED_KEY.format(1), "1")
    store.set(REPORTED_KEY.format(2), "1")
    lost, text = wd._diagnose((0, 1, 2, 3))
    assert lost == [3]
    assert text == "3; already reported and exited: 1, 2"
    for s in bound:
        s.close()
