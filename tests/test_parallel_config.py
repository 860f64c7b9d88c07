"""ParallelConfig validation and the rank layout maths; no process groups."""

from __future__ import annotations

import pytest

from moe_serve.parallel.config import ParallelConfig
from moe_serve.parallel.state import group_layout, rank_coordinates


def test_sizes():
    c = ParallelConfig(tensor_parallel_size=2, pipeline_parallel_size=3, data_parallel_size=4, enable_expert_parallel=True)
    assert (c.world_size, c.ep_size) == (24, 8)
    assert ParallelConfig(tensor_parallel_size=2, data_parallel_size=4).ep_size == 1
    assert ParallelConfig().world_size == 1 and ParallelConfig().collective_timeout_s == 60


@pytest.mark.parametrize(
    "kw, model, message",
    [
        (dict(data_parallel_size=3, enable_expert_parallel=True), (256, 16, 6, 1024), "expert parallel size 3 does not divide 256 experts"),
        (dict(tensor_parallel_size=3), (255, 16, 6, 1023), "tensor parallel size 3 does not divide 16 heads"),
        (dict(tensor_parallel_size=2), (256, 16, 6, 1023), "tensor parallel size 2 does not divide the vocabulary of 1023 tokens"),
        (dict(pipeline_parallel_size=8), (256, 16, 6, 1024), "pipeline parallel size 8 exceeds 6 layers"),
    ],
)
def test_validate_against_messages(kw, model, message):
    with pytest.raises(ValueError, match=message):
        ParallelConfig(**kw).validate_against(*model)


def test_validate_against_ok():
    # DeepSeek-V3: 256 experts, 128 heads, 61 layers, vocab 129280; EP 32 over dp 4 x tp 8, 2 stages
    ParallelConfig(tensor_parallel_size=8, data_parallel_size=4, pipeline_parallel_size=2,
                   enable_expert_parallel=True).validate_against(256, 128, 61, 129280)
    # without EP, 3 DP replicas each hold all experts
    ParallelConfig(data_parallel_size=3).validate_against(256, 16, 6, 1024)


@pytest.mark.parametrize(
    "kw, message",
    [
        (dict(tensor_parallel_size=0), "tensor_parallel_size must be a positive integer, got 0"),
        (dict(data_parallel_size=1.5), "data_parallel_size must be a positive integer"),
        (dict(collective_timeout_s=0), "collective_timeout_s must be > 0"),
    ],
)
def test_bad_fields(kw, message):
    with pytest.raises(ValueError, match=message):
        ParallelConfig(**kw)


def test_from_dict():
    assert ParallelConfig.from_dict({"tensor_parallel_size": 2}).tensor_parallel_size == 2
    with pytest.raises(ValueError, match=r"unknown parallel config field\(s\) \['tp'\]"):
        ParallelConfig.from_dict({"tp": 2})


def test_rank_coordinates_worked_example():
    # tp=2, dp=2, pp=2; tp varies fastest: rank = (pp_rank * dp + dp_rank) * tp + tp_rank
    got = [(c.pp_rank, c.dp_rank, c.tp_rank, c.ep_rank) for c in (rank_coordinates(r, tp=2, dp=2, pp=2) for r in range(8))]
    assert got == [(0, 0, 0, 0), (0, 0, 1, 1), (0, 1, 0, 2), (0, 1, 1, 3),
                   (1, 0, 0, 0), (1, 0, 1, 1), (1, 1, 0, 2), (1, 1, 1, 3)]
    c = rank_coordinates(11, tp=4, dp=3, pp=1)
    assert (c.pp_rank, c.dp_rank, c.tp_rank, c.ep_rank) == (0, 2, 3, 11)
    with pytest.raises(ValueError, match="rank 8 is outside a world of pp 2 x dp 2 x tp 2 = 8 ranks"):
        rank_coordinates(8, 2, 2, 2)


def test_group_layout_worked_example():
    g = group_layout(tp=2, dp=2, pp=2)
    assert g["tp"] == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert g["dp"] == [(0, 2), (1, 3), (4, 6), (5, 7)]
    assert g["pp"] == [(0, 4), (1, 5), (2, 6), (3, 7)]
    assert g["ep"] == [(0, 1, 2, 3), (4, 5, 6, 7)]


@pytest.mark.parametrize("tp, dp, pp", [(1, 1, 1), (2, 3, 1), (4, 1, 3), (2, 2, 2), (1, 5, 2)])
def test_group_layout_partitions_the_world(tp, dp, pp):
    g = group_layout(tp, dp, pp)
    for axis, size in (("tp", tp), ("dp", dp), ("pp", pp), ("ep", dp * tp)):
        ranks = sorted(r for grp in g[axis] for r in grp)
        assert ranks == list(range(tp * dp * pp)) and all(len(grp) == size for grp in g[axis])
    for r in range(tp * dp * pp):  # a rank's groups hold exactly the ranks that differ from it on that axis only
        c = rank_coordinates(r, tp, dp, pp)
        (tp_g,) = [grp for grp in g["tp"] if r in grp]
        assert all((rank_coordinates(o, tp, dp, pp).pp_rank, rank_coordinates(o, tp, dp, pp).dp_rank) == (c.pp_rank, c.dp_rank) for o in tp_g)


def test_init_parallel_without_torchrun_is_local():
    from moe_serve.parallel.state import init_parallel

    state = init_parallel(ParallelConfig(), env={}, device="cpu")
    assert state.rank == 0 and state.watchdog is None and state.is_first_stage and state.is_last_stage
    assert all(getattr(state, a).size == 1 and getattr(state, a).pg is None for a in ("tp", "dp", "pp", "ep", "world"))
    with pytest.raises(ValueError, match="needs 2 ranks but RANK is not set; launch with torchrun --nproc-per-node 2"):
        init_parallel(ParallelConfig(tensor_parallel_size=2), env={})
    with pytest.raises(ValueError, match="torchrun started 4 ranks but the layout pp 1 x dp 1 x tp 2 needs 2"):
        init_parallel(ParallelConfig(tensor_parallel_size=2), env={"RANK": "0", "WORLD_SIZE": "4"})
