"""Pipeline stage maths: pure functions, no process group."""

import pytest

from moe_serve.parallel.pipeline import split_micro_batches, stage_layer_range


def test_stage_layer_range_covers_every_layer_once():
    assert [stage_layer_range(7, 3, r) for r in range(3)] == [(0, 3), (3, 5), (5, 7)]
    assert [stage_layer_range(4, 2, r) for r in range(2)] == [(0, 2), (2, 4)]
    with pytest.raises(ValueError, match="pipeline parallel size 5 exceeds 4 layers"):
        stage_layer_range(4, 5, 0)


def test_micro_batches_balance_tokens_and_keep_their_count():
    assert split_micro_batches(["a", "b", "c"], [8, 1, 1], 2) == [["a"], ["b", "c"]]
    assert split_micro_batches(list("abcd"), [1, 1, 1, 1], 2) == [["a", "b"], ["c", "d"]]
    assert split_micro_batches(["a"], [5], 2) == [["a"], []]  # always 2 parts: the 2nd is a dummy batch
    assert split_micro_batches([], [], 3) == [[], [], []]
    parts = split_micro_batches(list(range(10)), [3] * 10, 3)
    assert sum(parts, []) == list(range(10)) and len(parts) == 3 and all(parts)
