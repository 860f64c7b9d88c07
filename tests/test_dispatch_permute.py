"""The index maths of expert-parallel dispatch, on the worked example in experts/permute.py; no processes."""

from __future__ import annotations

import torch

from moe_serve.experts import permute
from moe_serve.experts.dispatch import DispatchStats, combine, dispatch
from moe_serve.kernels import fused_moe

# slots_per_rank = 2, W = 3: slots 0-1 on rank 0, 2-3 on rank 1, 4-5 on rank 2
IDS_TK = torch.tensor([[0, 1], [1, 4], [5, -1]])
SPR, W = 2, 3


def test_destination_mask():
    mask = permute.destination_mask(IDS_TK, SPR, W)
    assert mask.tolist() == [[True, False, False], [True, False, True], [False, False, True]]


def test_send_order():
    token_idx, rank, counts = permute.send_order(permute.destination_mask(IDS_TK, SPR, W))
    assert token_idx.tolist() == [0, 1, 1, 2]
    assert rank.tolist() == [0, 0, 2, 2]
    assert counts.tolist() == [2, 0, 2]


def test_local_slot_ids():
    rows = IDS_TK[[0, 1, 1, 2]]
    local = permute.local_slot_ids(rows, torch.tensor([0, 0, 2, 2]), SPR)
    assert local.dtype == torch.int32
    assert local.tolist() == [[0, 1], [1, -1], [-1, 0], [1, -1]]


def test_pack_unpack_routing_is_exact():
    ids = torch.tensor([[0, -1], [3, 2]], dtype=torch.int32)
    w = torch.tensor([[0.1, 1e-30], [-2.5, float("inf")]])
    got_ids, got_w = permute.unpack_routing(permute.pack_routing(ids, w), torch.float32)
    assert torch.equal(got_ids, ids) and torch.equal(got_w, w)
    bf = w.to(torch.bfloat16)
    assert torch.equal(permute.unpack_routing(permute.pack_routing(ids, bf), torch.bfloat16)[1], bf)


def test_sum_by_token():
    y = torch.tensor([[1.0], [2.0], [3.0], [4.0]], dtype=torch.bfloat16)
    out = permute.sum_by_token(y, torch.tensor([0, 1, 1, 2]), 4)
    assert out.dtype == torch.float32 and out.flatten().tolist() == [1.0, 5.0, 4.0, 0.0]


def test_expert_rows_per_rank_and_volume():
    assert permute.expert_rows_per_rank(IDS_TK, SPR, W).tolist() == [3, 0, 2]
    vol = permute.dispatch_volume(IDS_TK, torch.zeros(3, dtype=torch.long), SPR, W)
    assert vol == dict(dedup_remote_rows=2, dedup_local_rows=2, naive_remote_rows=2)
    # from rank 1, everything is remote: tokens 0, 1 (twice), 2 -> 4 rows; 5 (token, expert) pairs
    vol = permute.dispatch_volume(IDS_TK, torch.ones(3, dtype=torch.long), SPR, W)
    assert vol == dict(dedup_remote_rows=4, dedup_local_rows=0, naive_remote_rows=5)


def test_empty_batch():
    ids = torch.empty(0, 4, dtype=torch.long)
    mask = permute.destination_mask(ids, SPR, W)
    token_idx, rank, counts = permute.send_order(mask)
    assert mask.shape == (0, W) and token_idx.numel() == 0 and counts.tolist() == [0, 0, 0]
    assert permute.sum_by_token(torch.empty(0, 5), token_idx, 0).shape == (0, 5)


def test_local_path_same_interface():
    torch.manual_seed(0)
    T, H, I, E, K = 5, 8, 4, 4, 2
    x, w13, w2 = torch.randn(T, H), torch.randn(E, 2 * I, H), torch.randn(E, H, I)
    ids = torch.stack([torch.randperm(E)[:K] for _ in range(T)])
    weights = torch.rand(T, K)
    rx, rids, rw, handle = dispatch(x, ids, weights, E, None)
    assert handle.local and handle.stats == DispatchStats(tokens=T, rows_sent_local=T)
    out = combine(fused_moe(rx, w13, w2, rw, rids), handle, None)
    torch.testing.assert_close(out, fused_moe(x, w13, w2, weights, ids), rtol=0, atol=0)


def test_stats_add():
    a = DispatchStats(tokens=1, bytes_sent=10)
    assert (a + a).tokens == 2 and (a + a).bytes_sent == 20 and (a + DispatchStats()).naive_bytes_sent == 0


def test_remote_node_rows_counts_each_remote_node_once_per_token():
    # 4 ranks on 2 nodes (0, 0, 1, 1); rank 0 sends token 0 to ranks 1, 2 and 3, token 1 to rank 1, token 2 to 3.
    mask = torch.tensor([[True, True, True, True], [False, True, False, False], [False, False, False, True]])
    assert permute.remote_node_rows(mask, (0, 0, 1, 1), 0).item() == 2  # tokens 0 and 2 reach node 1
    assert permute.remote_node_rows(mask, (0, 0, 1, 1), 3).item() == 2  # tokens 0 and 1 reach node 0
    assert permute.remote_node_rows(mask, (), 0).item() == 0  # one node
