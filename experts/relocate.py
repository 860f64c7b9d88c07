"""Moves routed-expert weights between expert-parallel ranks when the placement changes.

Only slots whose expert changes load anything, and they load it from a rank that already holds that
expert (never from disk). One layer at a time, between engine steps; every rank of the EP group
computes the same move list from the old and new placements, then one uneven all-to-all carries the
weights. Legend: R = physical slots of the layer (all EP ranks), S = this rank's slots, W = EP ranks.

Worked example, R = 4 slots on W = 2 ranks (S = 2), old [0, 1 | 2, 3] -> new [0, 2 | 2, 1]:
    slot 1 needs expert 2: held in old slot 2 on rank 1 -> rank 1 sends it to rank 0
    slot 3 needs expert 1: held in old slot 1 on rank 0 -> rank 0 sends it to rank 1
    slots 0 and 2 keep their experts: nothing moves for them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moe_serve.parallel.comm import Group, all_to_all_uneven


@dataclass(frozen=True)
class Move:
    dst_slot: int
    expert: int
    src_slot: int  # the lowest old slot holding the expert


def plan_moves(old_phy2log_R: list[int], new_phy2log_R: list[int]) -> list[Move]:
    """Slots whose expert changes, each with the old slot it copies from (pure, deterministic)."""
    first_slot = {}
    for slot, expert in enumerate(old_phy2log_R):
        first_slot.setdefault(expert, slot)
    missing = sorted(set(new_phy2log_R) - set(first_slot))
    if missing:
        raise ValueError(f"experts {missing[:8]} are in the new placement but in no slot of the old one")
    return [Move(s, e, first_slot[e]) for s, (o, e) in enumerate(zip(old_phy2log_R, new_phy2log_R)) if o != e]


def relocate(w13_S: torch.Tensor, w2_S: torch.Tensor, old_phy2log_R: list[int], new_phy2log_R: list[int],
             group: Group | None) -> int:
    """Rewrite this rank's slots (w13_S [S, 2I, H], w2_S [S, H, I], in place) for the new placement.
    Returns the number of slots (on all ranks) that loaded new weights."""
    S = w13_S.shape[0]
    W, me = (1, 0) if group is None else (group.size, group.index)
    moves = plan_moves(old_phy2log_R, new_phy2log_R)
    n13 = w13_S[0].numel()

    def row(slot: int) -> torch.Tensor:  # one expert's weights as a flat row
        return torch.cat((w13_S[slot].reshape(-1), w2_S[slot].reshape(-1)))

    sends = [[m for m in moves if m.src_slot // S == me and m.dst_slot // S == w] for w in range(W)]
    recvs = [[m for m in moves if m.dst_slot // S == me and m.src_slot // S == w] for w in range(W)]
    rows = [row(m.src_slot % S) for w in range(W) for m in sends[w]]
    send_NX = torch.stack(rows) if rows else w13_S.new_empty(0, n13 + w2_S[0].numel())
    if W > 1:
        recv_NX = all_to_all_uneven(send_NX, [len(x) for x in sends], [len(x) for x in recvs], group)
    else:
        recv_NX = send_NX
    for m, r in zip([m for w in range(W) for m in recvs[w]], recv_NX):  # written after every row was read
        w13_S[m.dst_slot % S].copy_(r[:n13].view_as(w13_S[0]))
        w2_S[m.dst_slot % S].copy_(r[n13:].view_as(w2_S[0]))
    return len(moves)
