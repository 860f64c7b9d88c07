"""Expert-parallel dispatch -> fused_moe -> combine on gloo equals fused_moe over all experts in one process.

One world per size (2 and 4 ranks) runs every case below in turn, as an engine would run layers; each rank
writes what it saw to a JSON file, and the tests read them. Traffic: `bytes_sent` must equal the
deduplicated minimum, sum over this rank's tokens of its distinct REMOTE destination ranks x H x 4 bytes
(a token's copy to its own rank is local and not counted; it shows up as rows_sent_local).
"""

from __future__ import annotations

import json
import os

import pytest
import torch

H, I = 16, 8
# name: (tokens per rank, K, how ids are chosen); slots_per_rank = experts // world
CASES = {
    4: {
        "random": ([5, 0, 7, 3], 4, "random"),  # rank 1 has no tokens but takes part
        "one_rank": ([3, 4, 0, 2], 2, "rank2"),  # every token's experts live on rank 2
        "k1": ([4, 4, 4, 4], 1, "random"),
        "k_gt_spr": ([6, 1, 2, 0], 6, "random"),  # K = 6 > 2 slots per rank: every token to >= 3 ranks
        "all_empty": ([0, 0, 0, 0], 4, "random"),
        "with_minus1": ([4, 3, 2, 5], 3, "holes"),  # some top-k ids are -1 (no expert)
    },
    2: {
        "random": ([6, 0], 3, "random"),
        "one_rank": ([3, 5], 2, "rank1"),
        "k1": ([5, 2], 1, "random"),
        "k_gt_spr": ([4, 4], 6, "random"),  # 4 slots per rank
    },
}
NUM_EXPERTS = 8


def _make_case(seed: int, tokens: list[int], K: int, how: str, world: int):
    g = torch.Generator().manual_seed(seed)
    T = sum(tokens)
    spr = NUM_EXPERTS // world
    x = torch.randn(T, H, generator=g)
    w13 = torch.randn(NUM_EXPERTS, 2 * I, H, generator=g) / H**0.5
    w2 = torch.randn(NUM_EXPERTS, H, I, generator=g) / I**0.5
    if how.startswith("rank"):
        lo = int(how[4:]) * spr
        ids = torch.stack([lo + torch.randperm(spr, generator=g)[:K] for _ in range(T)]) if T else torch.empty(0, K)
    else:
        ids = torch.stack([torch.randperm(NUM_EXPERTS, generator=g)[:K] for _ in range(T)]) if T else torch.empty(0, K)
    ids = ids.long()
    if how == "holes" and T:
        ids[torch.rand(T, K, generator=g) < 0.3] = -1
    weights = torch.rand(T, K, generator=g)
    src = torch.repeat_interleave(torch.arange(world), torch.tensor(tokens))
    return x, w13, w2, ids, weights, src, spr


def _ep_worker(out_dir: str, world: int) -> None:
    from moe_serve.experts.dispatch import combine, dispatch
    from moe_serve.experts.permute import dispatch_volume
    from moe_serve.kernels import fused_moe
    from moe_serve.parallel.config import ParallelConfig
    from moe_serve.parallel.state import init_parallel, shutdown

    state = init_parallel(ParallelConfig(data_parallel_size=world, enable_expert_parallel=True, collective_timeout_s=30))
    me, results = state.ep.index, {}
    for seed, (name, (tokens, K, how)) in enumerate(CASES[world].items()):
        x, w13, w2, ids, weights, src, spr = _make_case(seed, tokens, K, how, world)
        mine = src == me
        x_TH, ids_TK, w_TK = x[mine], ids[mine], weights[mine]
        recv_x, recv_ids, recv_w, handle = dispatch(x_TH, ids_TK, w_TK, spr, state.ep)
        lo = me * spr
        y = fused_moe(recv_x, w13[lo : lo + spr], w2[lo : lo + spr], recv_w, recv_ids)
        out = combine(y, handle, state.ep)
        want = fused_moe(x_TH, w13, w2, w_TK, ids_TK)
        vol = dispatch_volume(ids_TK, torch.full((len(ids_TK),), me), spr, world)
        results[name] = dict(
            T=len(x_TH), shape=list(out.shape), max_err=float((out - want).abs().max()) if len(x_TH) else 0.0,
            recv_ids_ok=bool(((recv_ids >= -1) & (recv_ids < spr)).all()) and recv_ids.shape[1] == K,
            every_row_has_local=bool((recv_ids >= 0).any(dim=1).all()),
            stats=vars(handle.stats), want_bytes=vol["dedup_remote_rows"] * H * 4,
            want_naive_bytes=vol["naive_remote_rows"] * H * 4, want_local_rows=vol["dedup_local_rows"],
        )
    with open(os.path.join(out_dir, f"rank{state.rank}.json"), "w") as f:
        json.dump(results, f)
    shutdown(state)


@pytest.fixture(scope="module")
def ep_results(tmp_path_factory):
    from moe_serve.parallel.launch import spawn_ranks

    made = {}

    def get(world: int) -> list[dict]:
        if world not in made:
            d = tmp_path_factory.mktemp(f"ep{world}")
            codes = spawn_ranks(_ep_worker, world, args=(str(d), world), timeout_s=120, log_dir=d)
            logs = "\n".join((d / f"rank{r}.log").read_text()[-2000:] for r in range(world))
            assert codes == [0] * world, f"exit codes {codes}\n{logs}"
            made[world] = [json.loads((d / f"rank{r}.json").read_text()) for r in range(world)]
        return made[world]

    return get


PARAMS = [(w, name) for w in (4, 2) for name in CASES[w]]


@pytest.mark.slow
@pytest.mark.parametrize("world, case", PARAMS, ids=[f"w{w}-{n}" for w, n in PARAMS])
def test_dispatch_combine_matches_single_process(ep_results, world, case):
    per_rank = [r[case] for r in ep_results(world)]
    tokens = CASES[world][case][0]
    for rank, r in enumerate(per_rank):
        assert r["T"] == tokens[rank] and r["shape"] == [tokens[rank], H]
        assert r["max_err"] <= 1e-5, f"rank {rank}: max error {r['max_err']}"
        assert r["recv_ids_ok"] and r["every_row_has_local"], f"rank {rank}: received ids not local"


@pytest.mark.slow
@pytest.mark.parametrize("world, case", PARAMS, ids=[f"w{w}-{n}" for w, n in PARAMS])
def test_dispatch_bytes_are_the_deduplicated_minimum(ep_results, world, case):
    per_rank = [r[case] for r in ep_results(world)]
    for rank, r in enumerate(per_rank):
        s = r["stats"]
        assert s["bytes_sent"] == r["want_bytes"], f"rank {rank}"
        assert s["rows_sent_local"] == r["want_local_rows"]
        assert s["naive_bytes_sent"] == r["want_naive_bytes"] >= s["bytes_sent"]
        assert s["meta_bytes_sent"] == s["rows_sent_remote"] * CASES[world][case][1] * 8 + (world - 1) * 8
    # what leaves one rank arrives at the others; combine sends back exactly what came in
    assert sum(r["stats"]["rows_sent_remote"] for r in per_rank) == sum(r["stats"]["rows_recv_remote"] for r in per_rank)
    assert sum(r["stats"]["combine_bytes_sent"] for r in per_rank) == sum(r["stats"]["bytes_sent"] for r in per_rank)


@pytest.mark.slow
def test_dedup_saves_bytes_when_experts_share_a_rank(ep_results):
    # K = 6 on 4 ranks of 2 slots: per-expert dispatch would send each token up to 6 times, dedup at most 3
    s = [r["k_gt_spr"]["stats"] for r in ep_results(4)]
    assert sum(x["bytes_sent"] for x in s) < sum(x["naive_bytes_sent"] for x in s)
