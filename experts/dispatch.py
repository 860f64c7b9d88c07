"""Expert-parallel dispatch and combine: send each token once to every EP rank holding one of its experts.

Legend (shape suffixes): T tokens on this rank, K top-k, H hidden size, W ranks in the EP group,
S rows sent (one per (token, destination rank)), R rows received. See experts/permute.py for the maths.

One MoE layer on every rank of the EP group (all ranks call both, even with T = 0):
    recv_x_RH, recv_ids_RK, recv_w_RK, handle = dispatch(x_TH, topk_ids_TK, topk_weights_TK, slots_per_rank, ep)
    y_RH = kernels.fused_moe(recv_x_RH, w13_local, w2_local, recv_w_RK, recv_ids_RK)   # partial sums
    out_TH = combine(y_RH, handle, ep)
Stages:  local: destination mask, send order, remapped ids      (permute.py, no communication)
         comm:  counts all-to-all -> one host sync -> hidden states all-to-all -> ids+weights all-to-all
         local: the experts (the caller)
         comm:  partial outputs all-to-all back
         local: sum per original token in float32
Traffic accounting (DispatchStats): bytes count rows sent to OTHER ranks only; a token's copy to its
own rank is a local copy through the same all-to-all and is counted apart (rows_sent_local).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from moe_serve.experts import permute
from moe_serve.parallel.comm import Group, all_to_all_uneven


@dataclass(frozen=True)
class DispatchStats:
    """What one dispatch + combine moved, seen from this rank. Add them up across calls with `+`."""

    tokens: int = 0  # T on this rank
    rows_sent_remote: int = 0  # (token, other rank) pairs: each token once per distinct remote destination
    rows_sent_local: int = 0  # tokens with an expert on this rank (copied, not sent)
    bytes_sent: int = 0  # hidden states to other ranks: rows_sent_remote * H * element size
    meta_bytes_sent: int = 0  # ids + weights (K * 8 bytes a row) and the counts exchange, to other ranks
    naive_rows_sent: int = 0  # (token, remote expert) pairs: what one copy per expert would send
    naive_bytes_sent: int = 0  # naive_rows_sent * H * element size
    rows_recv_remote: int = 0  # rows received from other ranks
    combine_bytes_sent: int = 0  # partial outputs sent back to other ranks: rows_recv_remote * H * element size
    # EP ranks on several nodes (Group.nodes): what crossed between nodes
    rows_sent_cross_node: int = 0  # rows sent to ranks on other nodes
    bytes_sent_cross_node: int = 0  # rows_sent_cross_node * H * element size
    node_rows_sent_remote: int = 0  # (token, other node) pairs: one row per distinct remote node, what a
    #                                 transport forwarding inside each node would send (the planner's measure)

    def __add__(self, other: "DispatchStats") -> "DispatchStats":
        return DispatchStats(*(getattr(self, f.name) + getattr(other, f.name) for f in fields(self)))


@dataclass(frozen=True)
class DispatchHandle:
    """What combine needs to route partial outputs home. Produced by dispatch, consumed by combine."""

    token_idx_S: torch.Tensor  # original token of each sent row, rows grouped by destination rank
    send_splits: tuple[int, ...]  # rows sent to each rank
    recv_splits: tuple[int, ...]  # rows received from each rank
    num_tokens: int  # T
    out_dtype: torch.dtype  # x's dtype: combine returns it
    stats: DispatchStats
    local: bool = False  # EP size 1: nothing was sent


def dispatch(
    x_TH: torch.Tensor,
    topk_ids_TK: torch.Tensor,
    topk_weights_TK: torch.Tensor,
    slots_per_rank: int,
    group: Group | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, DispatchHandle]:
    """Send each token once to each EP rank that holds at least one of its experts.

    topk_ids_TK: physical slot ids in [0, W * slots_per_rank), or -1 for none. Returns
    (recv_x_RH, recv_topk_ids_RK as LOCAL slot ids with -1 where the slot lives elsewhere (int32),
     recv_topk_weights_RK in topk_weights' dtype, handle). group None or of one rank: no communication,
    the inputs come back as they are.
    """
    T, H = x_TH.shape
    K = topk_ids_TK.shape[1]
    if topk_ids_TK.shape[0] != T or topk_weights_TK.shape != topk_ids_TK.shape:
        raise ValueError(f"x {tuple(x_TH.shape)}, topk_ids {tuple(topk_ids_TK.shape)} and topk_weights "
                         f"{tuple(topk_weights_TK.shape)} must be [T, H], [T, K], [T, K]")
    if group is None or group.size == 1:
        handle = DispatchHandle(torch.arange(T, device=x_TH.device), (T,), (T,), T, x_TH.dtype,
                                DispatchStats(tokens=T, rows_sent_local=T), local=True)
        return x_TH, topk_ids_TK, topk_weights_TK, handle

    W, me, elem = group.size, group.index, x_TH.element_size()
    # local: who gets what
    mask_TW = permute.destination_mask(topk_ids_TK, slots_per_rank, W)
    token_idx_S, rank_S, send_counts_W = permute.send_order(mask_TW)
    naive_W = permute.expert_rows_per_rank(topk_ids_TK, slots_per_rank, W)
    max_id = topk_ids_TK.max().reshape(1).long() if T else torch.full((1,), -1, device=x_TH.device)

    # comm: counts, then the one host sync of the step
    ones = [1] * W
    recv_counts_W = all_to_all_uneven(send_counts_W, ones, ones, group)
    remote_nodes = permute.remote_node_rows(mask_TW, group.nodes, me).reshape(1).to(send_counts_W.dtype)
    host = torch.cat([send_counts_W, recv_counts_W, naive_W, remote_nodes, max_id.to(send_counts_W.dtype)]).tolist()
    send_splits, recv_splits, naive, node_rows, top = (host[:W], host[W : 2 * W], host[2 * W : 3 * W], host[-2],
                                                       host[-1])
    if top >= W * slots_per_rank:
        raise ValueError(f"topk id {top} is beyond {W} EP ranks x {slots_per_rank} slots per rank")

    # local: the rows to send, ids remapped to each destination's local slots
    send_x_SH = x_TH.index_select(0, token_idx_S)
    local_ids_SK = permute.local_slot_ids(topk_ids_TK.index_select(0, token_idx_S), rank_S, slots_per_rank)
    packed_S2K = permute.pack_routing(local_ids_SK, topk_weights_TK.index_select(0, token_idx_S))

    # comm: hidden states, then ids + weights
    recv_x_RH = all_to_all_uneven(send_x_SH, send_splits, recv_splits, group)
    recv_ids_RK, recv_w_RK = permute.unpack_routing(
        all_to_all_uneven(packed_S2K, send_splits, recv_splits, group), topk_weights_TK.dtype
    )

    rows_remote = sum(send_splits) - send_splits[me]
    recv_remote = sum(recv_splits) - recv_splits[me]
    naive_remote = sum(naive) - naive[me]
    nodes = group.nodes
    cross = sum(n for w, n in enumerate(send_splits) if nodes[w] != nodes[me]) if group.num_nodes > 1 else 0
    stats = DispatchStats(
        tokens=T,
        rows_sent_remote=rows_remote,
        rows_sent_local=send_splits[me],
        bytes_sent=rows_remote * H * elem,
        meta_bytes_sent=rows_remote * 2 * K * 4 + (W - 1) * send_counts_W.element_size(),
        naive_rows_sent=naive_remote,
        naive_bytes_sent=naive_remote * H * elem,
        rows_recv_remote=recv_remote,
        combine_bytes_sent=recv_remote * H * elem,
        rows_sent_cross_node=cross,
        bytes_sent_cross_node=cross * H * elem,
        node_rows_sent_remote=node_rows,
    )
    handle = DispatchHandle(token_idx_S, tuple(send_splits), tuple(recv_splits), T, x_TH.dtype, stats)
    return recv_x_RH, recv_ids_RK, recv_w_RK, handle


def combine(y_RH: torch.Tensor, handle: DispatchHandle, group: Group | None) -> torch.Tensor:
    """Send each received row's partial output home and sum them per original token (float32 sum).

    Returns out_TH in x's dtype (the dtype dispatch saw).
    """
    if handle.local:
        return y_RH.to(handle.out_dtype)
    back_SH = all_to_all_uneven(y_RH, list(handle.recv_splits), list(handle.send_splits), group)
    return permute.sum_by_token(back_SH, handle.token_idx_S, handle.num_tokens).to(handle.out_dtype)
