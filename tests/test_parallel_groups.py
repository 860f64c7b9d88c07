"""Process groups under 4 gloo ranks (tp=2 x dp=2, and pp=2 x tp=2): membership, and the thin collectives.

Each rank checks its groups by actually communicating over them (an all_reduce of the global ranks sums to
the sum of the expected members), then writes what it saw to a JSON file that the test reads.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

LAYOUTS = {"tp2dp2": dict(tensor_parallel_size=2, data_parallel_size=2), "pp2tp2": dict(tensor_parallel_size=2, pipeline_parallel_size=2)}


def _groups_worker(out_dir: str, layout: str) -> None:
    from moe_serve.parallel import comm
    from moe_serve.parallel.config import ParallelConfig
    from moe_serve.parallel.state import init_parallel, log_rank_table, rank_table, shutdown

    state = init_parallel(ParallelConfig(**LAYOUTS[layout], enable_expert_parallel=True, collective_timeout_s=30))
    log_rank_table(state)
    c, seen = state.coords, {}
    seen["coords"] = [c.pp_rank, c.dp_rank, c.tp_rank, c.ep_rank]
    for axis in ("tp", "dp", "pp", "ep", "world", "cpu"):
        g = getattr(state, axis)
        summed = comm.all_reduce(torch.tensor([state.rank], dtype=torch.int64), g).item()
        gathered = comm.all_gather(torch.tensor([[state.rank]]), g, dim=1).flatten().tolist()
        seen[axis] = dict(ranks=list(g.ranks), index=g.index, has_pg=g.pg is not None, summed=summed, gathered=gathered)
    seen["broadcast"] = comm.broadcast_object({"from": state.rank, "blob": b"\x00\xff", "ids": [1, 2]}, state.cpu, src=3)
    seen["gather_obj"] = comm.all_gather_object({"r": state.rank}, state.dp)
    if state.pp.size > 1:  # stage 0 sends its hidden states to stage 1 (dynamic shape, bf16)
        if state.is_first_stage:
            comm.send_tensor(torch.full((state.rank + 1, 3), float(state.rank), dtype=torch.bfloat16), 1, state.pp)
            comm.send_tensor(torch.empty(0, 3), 1, state.pp)
        else:
            x = comm.recv_tensor(0, state.pp)
            empty = comm.recv_tensor(0, state.pp)
            seen["recv"] = dict(shape=list(x.shape), dtype=str(x.dtype), values=sorted(set(x.float().flatten().tolist())),
                                empty=list(empty.shape))
    seen["table"] = rank_table(state)
    comm.barrier(state.world)
    with open(os.path.join(out_dir, f"rank{state.rank}.json"), "w") as f:
        json.dump(seen, f, default=lambda b: list(b))
    shutdown(state)


@pytest.fixture(scope="module")
def layout_results(tmp_path_factory):
    from moe_serve.parallel.launch import spawn_ranks

    made = {}

    def get(layout: str) -> list[dict]:
        if layout not in made:
            d = tmp_path_factory.mktemp(layout)
            codes = spawn_ranks(_groups_worker, 4, args=(str(d), layout), timeout_s=120, log_dir=d)
            logs = {r: (d / f"rank{r}.log").read_text() for r in range(4)}
            assert codes == [0] * 4, f"exit codes {codes}\n" + "\n".join(v[-2000:] for v in logs.values())
            made[layout] = [json.loads((d / f"rank{r}.json").read_text()) | {"log": logs[r]} for r in range(4)]
        return made[layout]

    return get


EXPECTED = {  # rank -> (tp group, dp group, pp group, ep group)
    "tp2dp2": {0: ([0, 1], [0, 2], [0], [0, 1, 2, 3]), 1: ([0, 1], [1, 3], [1], [0, 1, 2, 3]),
               2: ([2, 3], [0, 2], [2], [0, 1, 2, 3]), 3: ([2, 3], [1, 3], [3], [0, 1, 2, 3])},
    "pp2tp2": {0: ([0, 1], [0], [0, 2], [0, 1]), 1: ([0, 1], [1], [1, 3], [0, 1]),
               2: ([2, 3], [2], [0, 2], [2, 3]), 3: ([2, 3], [3], [1, 3], [2, 3])},
}
COORDS = {"tp2dp2": [[0, 0, 0, 0], [0, 0, 1, 1], [0, 1, 0, 2], [0, 1, 1, 3]],  # pp, dp, tp, ep
          "pp2tp2": [[0, 0, 0, 0], [0, 0, 1, 1], [1, 0, 0, 0], [1, 0, 1, 1]]}


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_every_rank_groups_hold_the_right_ranks(layout_results, layout):
    for rank, seen in enumerate(layout_results(layout)):
        assert seen["coords"] == COORDS[layout][rank]
        for axis, want in zip(("tp", "dp", "pp", "ep"), EXPECTED[layout][rank]):
            g = seen[axis]
            assert g["ranks"] == want, f"rank {rank} {axis}"
            assert g["summed"] == sum(want), f"rank {rank} {axis}: the process group's members differ"
            assert g["gathered"] == want and g["index"] == want.index(rank)
            assert g["has_pg"] == (len(want) > 1)
        for axis in ("world", "cpu"):
            assert seen[axis]["ranks"] == [0, 1, 2, 3] and seen[axis]["summed"] == 6


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_control_messages_and_rank_table(layout_results, layout):
    results = layout_results(layout)
    for rank, seen in enumerate(results):
        assert seen["broadcast"] == {"from": 3, "blob": [0, 255], "ids": [1, 2]}
        assert seen["gather_obj"] == [{"r": r} for r in EXPECTED[layout][rank][1]]
        assert (seen["table"] is not None) == (rank == 0)
    table = results[0]["table"].splitlines()
    assert table[0].split() == ["rank", "host", "local_rank", "pp", "dp", "tp", "ep", "device"]
    rows = [line.split() for line in table[1:]]
    assert [[int(v) for v in (row[0], *row[3:7])] for row in rows] == [[r, *COORDS[layout][r]] for r in range(4)]
    assert "[rank 0] INFO moe_serve.parallel.state: parallel layout" in results[0]["log"]
    assert "parallel layout" not in results[1]["log"]


@pytest.mark.slow
def test_pipeline_send_recv(layout_results):
    results = layout_results("pp2tp2")
    assert results[2]["recv"] == dict(shape=[1, 3], dtype="torch.bfloat16", values=[0.0], empty=[0, 3])
    assert results[3]["recv"] == dict(shape=[2, 3], dtype="torch.bfloat16", values=[1.0], empty=[0, 3])
