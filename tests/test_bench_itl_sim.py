"""scripts/bench_itl.py's simulation (the real scheduler on a virtual clock) and the step-cost fit that
scripts/bench_step.py --mixed prints for it."""

import pytest


@pytest.fixture(scope="module")
def bench_itl(script):
    return script("bench_itl")


def test_step_cost_fit_recovers_the_model(bench_itl):
    coef = (3.0, 0.2, 0.1, 6.0, 0.8)
    points = [(d, p, bench_itl.step_cost_ms(coef, d, p)) for d in (1, 4, 16, 32) for p in (0, 4, 8, 16, 32, 64)]
    fitted, rms = bench_itl.fit_step_cost(points)
    assert rms < 1e-6
    assert fitted == pytest.approx(coef, abs=1e-6)
    assert bench_itl.parse_cost("3,0.2,0.1,6,0.8") == coef
    with pytest.raises(SystemExit, match="bad --cost"):
        bench_itl.parse_cost("3,0.2,0.1,6,1.5")


def test_simulated_pacing_evens_out_inter_token_latency(bench_itl):
    requests = bench_itl.make_requests(24, 10.0, 128, 32, 0.5, 512, seed=3)
    cost = (3.0, 0.2, 0.1, 6.0, 0.8)
    runs = {}
    for name, text in (("paced", "budget=1024,spread=300,minchunk=4"), ("unpaced", "budget=1024")):
        setting = bench_itl.parse_setting(text)
        runs[name] = bench_itl.simulate(setting, requests, 32, cost, noise=0.0, seed=0)
        assert runs[name] == bench_itl.simulate(setting, requests, 32, cost, noise=0.0, seed=1)  # no noise: exact
    # a whole prompt in one step stalls every running stream for it; slices a step keep the pace even, and each
    # prompt then starts within the spread
    assert runs["unpaced"]["ratio"] > 2.0 > 1.5 > runs["paced"]["ratio"]
    assert runs["unpaced"]["ttft_p99"] < 100 and 200 < runs["paced"]["ttft_p99"] <= 300 + 20
    noisy = bench_itl.simulate(bench_itl.parse_setting("budget=1024,spread=300,minchunk=4"), requests, 32, cost,
                               noise=0.15, seed=0)
    assert noisy["ratio"] > runs["paced"]["ratio"]
