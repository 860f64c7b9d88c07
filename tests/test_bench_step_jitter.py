"""scripts/bench_step.py --jitter's statistics: steps over their local median, and other processes' CPU time."""

import os

import pytest


@pytest.fixture(scope="module")
def bench_step(script):
    return script("bench_step")


def test_local_median_follows_a_drift_and_shows_a_stall(bench_step):
    times = [10.0 + 0.01 * i for i in range(100)]  # slow growth of the contexts
    times[50] *= 1.5  # one stalled step
    rel = bench_step.over_local_median(times)
    assert rel[50] == pytest.approx(1.5, rel=0.01)
    assert max(r for i, r in enumerate(rel) if i != 50) < 1.02
    assert "p90 1.00, p99 1.00" in bench_step.jitter_line([10.0] * 100)


def test_other_processes_cpu_time(bench_step):
    before = {("1", "1"): ("agent", 1_000_000, 5), ("2", "2"): ("idle", 0, 0)}
    after = {("1", "1"): ("agent", 4_000_000, 8), ("2", "2"): ("idle", 0, 0), ("3", "3"): ("new", 2_000_000, 2)}
    text = bench_step.other_cpu_text(before, after, 2.0)
    assert text.startswith("other processes ran 5.0 ms of CPU in 2.0 s")
    assert "agent 3.0 ms in 3" in text and "new 2.0 ms in 2" in text and "idle" not in text
    assert bench_step.other_cpu_text({}, {}, 1.0).endswith("not readable here")
    if os.path.isdir("/proc/self/task"):  # Linux
        snapshot = bench_step.other_threads_cpu()
        assert str(os.getpid()) not in {pid for pid, _ in snapshot}
        assert all(ran >= 0 and slices >= 0 for _, ran, slices in snapshot.values())
