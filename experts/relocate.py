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


def relocate(slot_tensors: list[torch.Tensor], old_phy2log_R: list[int], new_phy2log_R: list[int],
             group: Group | None) -> int:
    """Rewrite this rank's slots, in place, for the new placement: every tensor of `slot_tensors` holds one
    entry per local slot along dim 0 (w13 [S, 2I, H], w2 [S, H, I], and FP8 block scales with them; they
    travel together as bytes). Returns the number of slots (on all ranks) that loaded new weights."""
    S = slot_tensors[0].shape[0]
    W, me = (1, 0) if group is None else (group.size, group.index)
    moves = plan_moves(old_phy2log_R, new_phy2log_R)
    sizes = [t[0].numel() * t.element_size() for t in slot_tensors]

    def row(slot: int) -> torch.Tensor:  # one expert's tensors as a flat row of bytes
        return torch.cat([t[slot].reshape(-1).view(torch.uint8) for t in slot_tensors])

    sends = [[m for m in moves if m.src_slot // S == me and m.dst_slot // S == w] for w in range(W)]
    recvs = [[m for m in moves if m.dst_slot // S == me and m.src_slot // S == w] for w in range(W)]
    rows = [row(m.src_slot % S) for w in range(W) for m in sends[w]]
    send_NX = torch.stack(rows) if rows else slot_tensors[0].new_empty(0, sum(sizes), dtype=torch.uint8)
    if W > 1:
        recv_NX = all_to_all_uneven(send_NX, [len(x) for x in sends], [len(x) for x in recvs], group)
    else:
        recv_NX = send_NX
    for m, r in zip([m for w in range(W) for m in recvs[w]], recv_NX):  # written after every row was read
        for t, part in zip(slot_tensors, r.split(sizes)):
            t[m.dst_slot % S].view(-1).view(torch.uint8).copy_(part)
    return len(moves)
