"""Placement maps and measures (balancer/placement.py) on hand-worked examples."""

import pytest
import torch

from moe_serve.balancer.placement import (ReplicaChooser, balancedness, build_log2phy, gpu_loads, logical_to_physical, moved_slots,
                                replica_counts, validate_plan)


def test_build_log2phy_lists_replicas_by_slot_and_pads():
    # 3 experts in 4 slots; expert 0 sits in slots 0 and 3.
    phy2log = torch.tensor([[0, 1, 2, 0]])
    log2phy, logcnt = build_log2phy(phy2log, 3)
    assert logcnt.tolist() == [[2, 1, 1]]
    assert log2phy.tolist() == [[[0, 3], [1, -1], [2, -1]]]
    validate_plan(phy2log, log2phy, logcnt, 3)


def test_build_log2phy_pads_to_the_most_replicas_over_all_layers():
    phy2log = torch.tensor([[0, 1, 1, 1], [0, 1, 0, 1]])
    log2phy, logcnt = build_log2phy(phy2log, 2)
    assert log2phy.shape == (2, 2, 3)
    assert log2phy[0].tolist() == [[0, -1, -1], [1, 2, 3]]
    assert log2phy[1].tolist() == [[0, 2, -1], [1, 3, -1]]


def test_balancedness_hand_example():
    # Expert 0 (load 6) has two replicas of 3 each; experts 1 and 2 have load 2.
    weight = torch.tensor([[6.0, 2.0, 2.0]])
    phy2log = torch.tensor([[0, 0, 1, 2]])
    # 2 GPUs: GPU 0 holds slots 0, 1 -> 3 + 3 = 6; GPU 1 holds slots 2, 3 -> 2 + 2 = 4. Mean 5, max 6.
    assert gpu_loads(weight, phy2log, 2).tolist() == [[6.0, 4.0]]
    assert balancedness(weight, phy2log, 2).item() == pytest.approx(5 / 6)
    # 4 GPUs: loads 3, 3, 2, 2. Mean 2.5, max 3.
    assert balancedness(weight, phy2log, 4).item() == pytest.approx(2.5 / 3)
    # Moving a replica of expert 0 next to expert 1 balances 2 GPUs perfectly: 3 + 2 each.
    assert balancedness(weight, torch.tensor([[0, 1, 0, 2]]), 2).item() == pytest.approx(1.0)


def test_balancedness_of_a_layer_without_load_is_one():
    weight = torch.tensor([[0.0, 0.0], [1.0, 3.0]])
    phy2log = torch.tensor([[0, 1], [0, 1]])
    assert balancedness(weight, phy2log, 2).tolist() == pytest.approx([1.0, 2 / 3])


def test_moved_slots_counts_changed_slots():
    assert moved_slots(torch.tensor([[0, 1, 2, 0]]), torch.tensor([[0, 2, 1, 0]])) == 2
    assert moved_slots(torch.tensor([[0, 1]]), torch.tensor([[0, 1]])) == 0
    with pytest.raises(ValueError, match="differ in shape"):
        moved_slots(torch.tensor([[0, 1]]), torch.tensor([[0, 1, 1]]))


def test_validate_plan_rejects_broken_maps():
    phy2log = torch.tensor([[0, 1, 2, 0]])
    log2phy, logcnt = build_log2phy(phy2log, 3)
    with pytest.raises(ValueError, match="expert 2 of layer 0 has no slot"):
        bad = torch.tensor([[0, 1, 1, 0]])
        validate_plan(bad, *build_log2phy(bad, 3), 3)
    with pytest.raises(ValueError, match="logcnt"):
        validate_plan(phy2log, log2phy, torch.tensor([[1, 1, 2]]), 3)
    with pytest.raises(ValueError, match="holds expert"):
        swapped = log2phy.clone()
        swapped[0, 1, 0], swapped[0, 2, 0] = 2, 1
        validate_plan(phy2log, swapped, logcnt, 3)
    with pytest.raises(ValueError, match="padded with -1"):
        padded = log2phy.clone()
        padded[0, 1, 1] = 3
        validate_plan(phy2log, padded, logcnt, 3)
    with pytest.raises(ValueError, match="appears 2 times"):
        twice = log2phy.clone()
        twice[0, 0, 1] = 0
        validate_plan(phy2log, twice, logcnt, 3)
    with pytest.raises(ValueError, match="not an expert id"):
        validate_plan(torch.tensor([[0, 1, 2, 3]]), log2phy, logcnt, 3)


def test_logical_to_physical_worked_example():
    # Expert 0 has replicas in slots 0 and 3; experts 1 and 2 have one slot each.
    log2phy = torch.tensor([[0, 3], [1, -1], [2, -1]])
    logcnt = torch.tensor([2, 1, 1])
    topk_ids = torch.tensor([[0, 1],    # token 0: expert 0 -> replica 0 % 2 = 0 -> slot 0; expert 1 -> slot 1
                             [0, 2],    # token 1: expert 0 -> replica 1 % 2 = 1 -> slot 3; expert 2 -> slot 2
                             [2, 0]])   # token 2: expert 2 -> slot 2; expert 0 -> replica 2 % 2 = 0 -> slot 0
    assert logical_to_physical(topk_ids, log2phy, logcnt).tolist() == [[0, 1], [3, 2], [2, 0]]
    # With global token positions 5, 6, 7 the replica choice follows the positions: 5 % 2 = 1 -> slot 3.
    positions = torch.tensor([5, 6, 7])
    assert logical_to_physical(topk_ids, log2phy, logcnt, positions).tolist() == [[3, 1], [0, 2], [2, 3]]


def test_logical_to_physical_spreads_a_hot_expert_evenly():
    phy2log = torch.tensor([[0, 1, 0, 2, 0, 0]])  # expert 0 in 4 slots
    log2phy, logcnt = build_log2phy(phy2log, 3)
    topk_ids = torch.zeros(100, 1, dtype=torch.int64)
    slots = logical_to_physical(topk_ids, log2phy[0], logcnt[0])
    assert torch.bincount(slots.flatten(), minlength=6).tolist() == [25, 0, 25, 0, 25, 25]
    assert (phy2log[0][slots] == topk_ids).all()


def test_replica_chooser_balances_each_batch_within_own_slots():
    """Per-batch choice: only an expert's own slots; the batch's busiest rank never busier than with the even split
    (over random batches and placements), and the same batch always gets the same choice."""
    gen = torch.Generator().manual_seed(0)
    for trial in range(20):
        num_experts, num_ranks, redundant = 12, 4, 4
        phy2log = torch.cat([torch.randperm(num_experts, generator=gen),
                             torch.randint(0, num_experts, (redundant,), generator=gen)])
        phy2log = phy2log[torch.randperm(len(phy2log), generator=gen)].unsqueeze(0)
        log2phy, logcnt = build_log2phy(phy2log, num_experts)
        if (logcnt == 0).any():
            continue
        chooser = ReplicaChooser(log2phy[0], logcnt[0], num_ranks)
        shares = torch.rand(num_experts, generator=gen) ** 3
        topk_ids = torch.multinomial(shares.expand(64, -1), 2, generator=gen)
        slots = chooser(topk_ids)
        assert (phy2log[0][slots] == topk_ids).all()
        assert torch.equal(slots, chooser(topk_ids.clone()))
        per_rank = len(phy2log[0]) // num_ranks
        busiest = (slots.flatten() // per_rank).bincount(minlength=num_ranks).max()
        even = logical_to_physical(topk_ids, log2phy[0], logcnt[0])
        assert busiest <= (even.flatten() // per_rank).bincount(minlength=num_ranks).max(), trial


def test_replica_counts():
    assert replica_counts(torch.tensor([[0, 0, 2], [1, 2, 0]]), 3).tolist() == [[2, 0, 1], [1, 1, 1]]
