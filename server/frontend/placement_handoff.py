"""The expert placement one engine job hands to the next (docs/reliability.md): exported to the front end after
each completed rebalance, restored by the next job that attaches.

Export: once the moves a rebalance planned are done, the leader sends the placement of every MoE layer with the
window's load (summed over the DP ranks) as a placement file (balancer/placement_file.py). Without pipeline
parallelism every rank of the job shares the rebalancer's state (one EP group), so each sees the moment alike.
Under pipeline parallelism each stage holds only its own layers and rebalances on its own load, so no rank knows
when another stage has moved: every EXPORT_CHECK_STEPS steps (counted alike on every rank, since all ranks step
together) one small all-reduce over the cpu group asks whether any stage finished a rebalance not yet exported;
if one did, every stage's part is gathered (msgpack over the cpu group) and merged into one file covering all
layers (balancer/placement_stages.py). A stage still moving exports what it holds now and is exported again
once it has finished.

Restore: the front end's welcome reaches the leader, which broadcasts it to every rank; each stage moves to the
rows of its own layers (Rebalancer.move_to).
"""

from __future__ import annotations

import logging

import torch

from moe_serve.balancer.placement_stages import merge_stages
from moe_serve.parallel import comm

EXPORT_CHECK_STEPS = 8  # under pipeline parallelism: steps between the stages' checks for a finished rebalance

log = logging.getLogger(__name__)


def start_from_placement(engine, placement: dict | None) -> None:
    """Every rank, after loading: move to the placement a previous job exported and count its load (the front
    end's welcome carries both to the leader, which broadcasts them; `placement` is ignored on other ranks), so
    a restarted job keeps what it learnt. Each pipeline stage takes its own layers' rows."""
    state = engine.parallel
    if state.cpu.size > 1:
        placement = comm.broadcast_object(placement, state.cpu, src=0)
    if placement is None or engine.rebalancer is None:
        return
    # the exported load was summed over the DP ranks: the ranks of DP group 0 count it, the others add nothing
    moved = engine.rebalancer.move_to(placement, count_load=state.dp.index == 0)
    if state.dp.index == 0 and state.tp.index == 0:
        log.info("started from the previous job's expert placement (%d slots loaded on stage %d) and load", moved,
                 state.coords.pp_rank)


class PlacementExport:
    """When a completed rebalance is to go to the front end, and its placement file (see the module docstring).
    Every rank calls `after_step` after every engine step."""

    def __init__(self, engine):
        state = engine.parallel
        self.rebalancer, self.recorder = engine.rebalancer, engine.expert_load_recorder
        self.cpu, self.dp = state.cpu, state.dp
        self.pipelined = state.config.pipeline_parallel_size > 1
        self.contributes = state.coords.dp_rank == 0 and state.coords.tp_rank == 0  # one part per stage
        if self.pipelined:  # every rank takes part, a stage without MoE layers too, while a balancer may move
            self.enabled = engine.config.enable_eplb and self.any_moe_layer(engine.model_config)
        else:
            self.enabled = self.rebalancer is not None
        self.exported = self.rebalances_done()  # the last count sent out
        self.steps = 0

    @staticmethod
    def any_moe_layer(model_config) -> bool:
        return any(model_config.is_moe_layer(i) for i in range(model_config.num_hidden_layers))

    def rebalances_done(self) -> int:
        """This stage's rebalances whose moves have all been made (0 on a stage without MoE layers)."""
        rb = self.rebalancer
        return 0 if rb is None else rb.num_rebalances - (1 if rb.pending else 0)

    def after_step(self) -> dict | None:
        """The placement file to send (on every rank; the leader sends it) when a rebalance has completed since
        the last one sent, else None."""
        if not self.enabled:
            return None
        new = self.rebalances_done() != self.exported
        if self.pipelined:
            self.steps += 1
            if self.steps % EXPORT_CHECK_STEPS:
                return None
            flag = comm.all_reduce(torch.tensor([int(new)]), self.cpu, op=torch.distributed.ReduceOp.MAX)
            new = bool(flag.item())
        if not new:
            return None
        self.exported = self.rebalances_done()
        return self.export()

    def export(self) -> dict | None:
        """Every rank together: the placement of every MoE layer and the window's load summed over the DP ranks
        (None when the model has none)."""
        part = None if self.recorder is None else self.recorder.to_json("window", sum_over=self.dp)
        if not self.pipelined:
            return part
        parts = comm.all_gather_object(part if self.contributes else None, self.cpu)
        parts = [p for p in parts if p is not None]
        return merge_stages(parts) if parts else None
