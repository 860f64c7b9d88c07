"""The expert balancer (balancer/eplb.py): valid plans, near-perfect balance where the slots allow it, few moves
with `previous`. The comparison with DeepSeek's EPLB itself is a benchmark (scripts/bench_balancer.py), run
against EPLB as vLLM installs it: no copy of it lives in this repository."""

import pytest
import torch

from moe_serve.balancer import balancedness, moved_slots, rebalance_experts, validate_plan


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def zipf_load(num_layers: int, num_experts: int, s: float, seed: int, tokens: int = 65536) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    ranks = torch.arange(1, num_experts + 1, dtype=torch.float64) ** -s
    shares = torch.stack([ranks[torch.randperm(num_experts, generator=gen)] for _ in range(num_layers)])
    return torch.poisson(shares / shares.sum(1, keepdim=True) * tokens, generator=gen)


def drifted(weight: torch.Tensor, sigma: float, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    noise = torch.exp(sigma * torch.randn(weight.shape, generator=gen, dtype=torch.float64))
    return torch.poisson(weight.double() * noise, generator=gen)


def check(weight, num_replicas, num_gpus, num_groups=4, num_nodes=1, **kwargs):
    phy2log, log2phy, logcnt = rebalance_experts(weight, num_replicas, num_groups, num_nodes, num_gpus, **kwargs)
    num_layers, num_experts = weight.shape
    assert phy2log.shape == (num_layers, num_replicas) and phy2log.dtype == torch.int64
    assert logcnt.shape == (num_layers, num_experts)
    assert log2phy.shape[:2] == (num_layers, num_experts) and log2phy.shape[2] == logcnt.max()
    validate_plan(phy2log, log2phy, logcnt, num_experts)
    return phy2log


@pytest.mark.parametrize("num_replicas,num_gpus,num_experts", [(24, 4, 16), (20, 4, 16), (16, 4, 16), (96, 16, 64),
                                                              (18, 1, 16), (40, 8, 16)])
def test_plans_valid_on_random_loads(num_replicas, num_gpus, num_experts):
    gen = torch.Generator().manual_seed(num_replicas)
    for scale in (1.0, 100.0):
        weight = torch.poisson(torch.rand(3, num_experts, generator=gen) * scale, generator=gen)
        check(weight, num_replicas, num_gpus)


@pytest.mark.parametrize("name", ["zeros", "one_expert", "all_equal", "sparse", "huge"])
def test_plans_valid_on_edge_loads(name):
    num_layers, num_experts = 3, 16
    weight = {
        "zeros": torch.zeros(num_layers, num_experts),
        "one_expert": torch.zeros(num_layers, num_experts).index_fill_(1, torch.tensor([5]), 1000.0),
        "all_equal": torch.full((num_layers, num_experts), 7.0),
        "sparse": (torch.arange(num_layers * num_experts).view(num_layers, num_experts) % 5 == 0).float(),
        "huge": torch.full((num_layers, num_experts), 1e30),
    }[name]
    for num_replicas, num_gpus in ((24, 4), (16, 4), (24, 1), (48, 4)):
        phy2log = check(weight, num_replicas, num_gpus)
        if name == "one_expert" and num_replicas > num_experts:
            # The busy expert gets a multiple of num_gpus replicas (8 of 24 slots, not EPLB's 9), spread evenly.
            assert balancedness(weight, phy2log, num_gpus).tolist() == [1.0] * num_layers
    assert balancedness(weight, check(weight, 24, 4), 4).min() > 0


def test_one_gpu_and_no_redundancy():
    weight = zipf_load(2, 16, 1.0, seed=1)
    assert balancedness(weight, check(weight, 16, 1), 1).tolist() == [1.0, 1.0]  # one GPU holds everything
    phy2log = check(weight, 16, 4)  # R == E: a permutation of the experts in each layer
    assert (phy2log.sort(1).values == torch.arange(16)).all()


def test_deterministic_and_dtype_agnostic():
    weight = zipf_load(4, 64, 1.1, seed=2)
    first = rebalance_experts(weight, 96, 8, 2, 16)
    second = rebalance_experts(weight.clone(), 96, 8, 2, 16)
    as_int = rebalance_experts(weight.long(), 96, 8, 2, 16)
    for a, b, c in zip(first, second, as_int):
        assert torch.equal(a, b) and torch.equal(a, c)


def test_bad_arguments_say_what_is_wrong():
    weight = torch.ones(2, 16)
    with pytest.raises(ValueError, match="num_gpus 3 does not divide 20 slots"):
        rebalance_experts(weight, 20, 4, 1, 3)
    with pytest.raises(ValueError, match="cannot hold 16 experts"):
        rebalance_experts(weight, 12, 4, 1, 4)
    with pytest.raises(ValueError, match="num_nodes 3 does not divide 4 GPUs"):
        rebalance_experts(weight, 16, 4, 3, 4)
    with pytest.raises(ValueError, match="non-negative"):
        rebalance_experts(-weight, 16, 4, 1, 4)
    with pytest.raises(ValueError, match=r"previous must be the current phy2log \[2, 20\]"):
        rebalance_experts(weight, 20, 4, 1, 4, previous=torch.zeros(2, 16, dtype=torch.int64))
    with pytest.raises(ValueError, match="without a slot"):
        rebalance_experts(weight, 20, 4, 1, 4, previous=torch.zeros(2, 20, dtype=torch.int64))


@pytest.mark.parametrize("num_replicas,num_gpus,num_experts", [(288, 32, 256), (320, 64, 256), (80, 8, 64)])
def test_balance_near_perfect_with_redundant_slots(num_replicas, num_gpus, num_experts):
    """With 12-25% redundant slots, Zipf loads up to s=1.4 fit within a few percent of a perfect split (EPLB's
    global policy reaches 0.82-0.99 on these loads, its hierarchical one 0.2-0.99: docs/benchmarks.md).
    (With several nodes the plan trades balance above a target for locality: tests/test_node_placement.py.)"""
    for seed, s in enumerate((0.0, 1.0, 1.4)):
        weight = zipf_load(4, num_experts, s, seed=seed)
        ours = balancedness(weight, check(weight, num_replicas, num_gpus, 8), num_gpus)
        assert ours.mean() >= 0.98 and ours.min() >= 0.93, (s, ours.tolist())


def test_without_redundancy_the_heaviest_expert_bounds_balance():
    """R = E: no expert can be split, so some GPU holds the heaviest expert and 7 others, at least the 7 lightest;
    on a skewed load our plan's max GPU load is within 1% of that bound (or of a perfect split)."""
    weight = zipf_load(4, 256, 1.0, seed=7)
    plan = check(weight, 256, 32, 8)
    ascending = weight.sort(1).values
    floor = torch.maximum(ascending[:, -1] + ascending[:, :7].sum(1), weight.sum(1) / 32)
    assert (balancedness(weight, plan, 32) >= weight.sum(1) / 32 / floor * 0.99).all()


def test_previous_with_the_same_load_moves_nothing():
    weight = zipf_load(4, 64, 1.0, seed=3)
    plan = check(weight, 96, 16)
    assert moved_slots(plan, check(weight, 96, 16, previous=plan)) == 0


@pytest.mark.parametrize("num_replicas,num_gpus,num_experts,s", [(288, 32, 256, 1.0), (320, 64, 256, 1.0),
                                                                 (80, 8, 64, 1.2), (256, 32, 256, 0.5)])
def test_previous_under_drift_keeps_balance_and_most_slots(num_replicas, num_gpus, num_experts, s):
    weight = zipf_load(6, num_experts, s, seed=4)
    plan = check(weight, num_replicas, num_gpus)
    for window in range(2):
        weight = drifted(weight, 0.15, seed=10 + window)
        fresh = balancedness(weight, check(weight, num_replicas, num_gpus), num_gpus)
        replanned = check(weight, num_replicas, num_gpus, previous=plan)
        kept = balancedness(weight, replanned, num_gpus)
        assert kept.mean() >= fresh.mean() - 0.02
        assert moved_slots(plan, replanned) <= replanned.numel() / 3
        plan = replanned


def test_previous_may_be_any_valid_plan():
    """A poorly balanced plan in service (each expert in its own slot, the spare slots on the least loaded
    experts) is repaired to within 0.01 of a fresh plan."""
    weight = zipf_load(4, 256, 1.0, seed=5)
    coldest = weight.argsort(1)[:, :32]
    poor = torch.cat([torch.arange(256).expand(4, -1), coldest], 1)
    replanned = check(weight, 288, 32, 8, 4, previous=poor)
    fresh = balancedness(weight, check(weight, 288, 32, 8, 4), 32)
    assert balancedness(weight, poor, 32).mean() < fresh.mean() - 0.1  # the case is not trivially balanced
    assert balancedness(weight, replanned, 32).mean() >= fresh.mean() - 0.01 - 1e-9
