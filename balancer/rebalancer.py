"""When and how expert placements change while serving.

Every `interval` steps the rebalancer sums the recorded window of expert load over the EP group,
plans new placements with `rebalance_experts(..., previous=current)` (so most slots keep their
expert) in a background thread while `plan_steps` more steps run, and then, `layers_per_step` layers
after each following step, has each MoE block load its changed slots from the ranks holding those
experts and switch its maps. Placement only ever changes
between steps, never inside a forward pass. Every rank of an EP group calls `after_step` after the
same steps and computes the same plan from the same all-reduced load, so their moves match.
"""

from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from moe_serve.balancer.eplb import rebalance_experts
from moe_serve.balancer.locality import node_local_balancedness, planning_nodes
from moe_serve.balancer.placement_stages import stage_rows
from moe_serve.parallel import comm

log = logging.getLogger(__name__)


@dataclass
class EplbConfig:
    enable_eplb: bool = False
    window: int = 1000  # steps of recorded load the plan uses
    interval: int = 3000  # steps between plans
    num_redundant_experts: int = 0  # extra physical slots per MoE layer, over the whole EP group
    layers_per_step: int = 1  # layers whose weights move after one step
    min_gain: float = 0.01  # a periodic plan moves weights only if mean balancedness rises by at least this
    # A periodic plan is computed in a background thread while this many steps run, then taken (waiting for
    # it if it is late) at the same step on every rank; 0 = computed on the step path.
    plan_steps: int = 2

    def __post_init__(self) -> None:
        for name in ("window", "interval", "layers_per_step"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"eplb {name} must be a positive integer, got {getattr(self, name)!r}")
        if not isinstance(self.plan_steps, int) or self.plan_steps < 0:
            raise ValueError(f"eplb plan_steps must be an integer >= 0, got {self.plan_steps!r}")
        if not isinstance(self.num_redundant_experts, int) or self.num_redundant_experts < 0:
            raise ValueError(f"num_redundant_experts must be >= 0, got {self.num_redundant_experts!r}")
        if not isinstance(self.min_gain, (int, float)) or not 0 <= self.min_gain <= 1:
            raise ValueError(f"eplb min_gain must be in [0, 1], got {self.min_gain!r}")

    @classmethod
    def from_dict(cls, raw: dict) -> "EplbConfig":
        """From `--eplb-config '{"window": 500, ...}'`: unknown keys are an error naming them."""
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ValueError(f"unknown eplb config field(s) {unknown}; known: {sorted(known)}")
        return cls(**raw)


class Rebalancer:
    def __init__(self, config: EplbConfig, blocks: dict, recorder, ep_group: comm.Group | None, num_groups: int,
                 topk: int = 8, topk_group: int | None = None):
        """blocks: layer index -> MoE block (with phy2log_R, relocate_experts); recorder: the engine's
        ExpertLoadRecorder, whose layer j is the j-th block in layer order; num_groups, topk, topk_group: how
        the model routes (expert groups, experts per token, groups a token may use)."""
        self.config, self.recorder, self.ep_group, self.num_groups = config, recorder, ep_group, num_groups
        self.routing = {"topk": topk, "topk_group": topk_group}
        # EP ranks on several nodes: plans keep co-routed experts on a node (balancer/node_placement.py)
        self.num_nodes = 1 if ep_group is None else planning_nodes(ep_group.nodes)
        if self.num_nodes > 1:
            recorder.enable_coactivation()
        self.layers = sorted(blocks)
        self.blocks = blocks
        self.pending: list[tuple[int, list[int]]] = []
        self._planner: ThreadPoolExecutor | None = None  # one thread, started with the first background plan
        self._planning: tuple[int, Future] | None = None  # (the step it is taken after, the plan's future)
        self.steps = 0
        self.num_rebalances = 0
        self.slots_moved = 0

    @property
    def ep_size(self) -> int:
        return 1 if self.ep_group is None else self.ep_group.size

    def current_placement(self) -> torch.Tensor:
        return torch.tensor([self.blocks[i].phy2log_R for i in self.layers])

    def window_load(self) -> torch.Tensor:
        """Tokens per (MoE layer, logical expert) over the window, summed over the EP group."""
        load_LE = self.recorder.snapshot().window_LE.double()
        if self.ep_group is not None and self.ep_group.size > 1:
            load_LE = comm.all_reduce(load_LE.to(self.ep_group.device), self.ep_group).cpu()
        return load_LE

    def after_step(self) -> None:
        self.steps += 1
        if self._planning is not None:
            if self.steps >= self._planning[0]:
                _, future = self._planning
                self._planning = None
                self._queue(*future.result(), self.config.min_gain)
        elif self.pending:
            self._apply(self.config.layers_per_step)
        elif self.config.enable_eplb and self.steps % self.config.interval == 0:
            if self.config.plan_steps == 0:
                self.plan()
            else:
                self._start_plan()

    def _start_plan(self) -> None:
        """The window's load summed over the EP group here, on the step path (a collective, in step order on
        every rank); the planner then runs in a background thread while the next `plan_steps` steps run."""
        load_LE, current_LR, coact_LEE = self.window_load(), self.current_placement(), self.coactivation()
        if self._planner is None:
            self._planner = ThreadPoolExecutor(1, thread_name_prefix="eplb-planner")
        future = self._planner.submit(self._compute_plan, load_LE, current_LR, coact_LEE)
        self._planning = (self.steps + self.config.plan_steps, future)

    def coactivation(self) -> torch.Tensor | None:
        """Co-activation counts summed over the EP group (a collective), or None on one node or before any."""
        coact_LEE = self.recorder.coactivation() if self.num_nodes > 1 else None
        if coact_LEE is None:
            return None
        coact_LEE = comm.all_reduce(coact_LEE.to(self.ep_group.device), self.ep_group).cpu()
        return coact_LEE.double() if coact_LEE.any() else None

    def _compute_plan(self, load_LE: torch.Tensor, current_LR: torch.Tensor, coact_LEE: torch.Tensor | None = None):
        """(current, planned placement, balancedness before, after): pure, the same on every rank."""
        phy2log_LR, _, _ = rebalance_experts(load_LE, current_LR.shape[1], self.num_groups, self.num_nodes,
                                             self.ep_size, previous=current_LR, coactivation=coact_LEE, **self.routing)
        return (current_LR, phy2log_LR, node_local_balancedness(load_LE, current_LR, self.ep_size, self.num_nodes),
                node_local_balancedness(load_LE, phy2log_LR, self.ep_size, self.num_nodes))

    def plan(self, min_gain: float | None = None) -> int:
        """Plan from the window's load now; queue the layers whose placement changes, unless the plan raises the
        mean balancedness by less than `min_gain` (default: the config's), so a balanced deployment moves
        nothing. Returns how many layers were queued."""
        self._planning = None  # a background plan still running is superseded (every rank calls this alike)
        min_gain = self.config.min_gain if min_gain is None else min_gain
        return self._queue(*self._compute_plan(self.window_load(), self.current_placement(), self.coactivation()),
                           min_gain)

    def _queue(self, current_LR, phy2log_LR, before, after, min_gain: float) -> int:
        gain = (after.mean() - before.mean()).item()
        if gain < min_gain:
            log.info("eplb: no move, balancedness %.3f -> %.3f gains %.4f < %.4f", before.mean().item(),
                     after.mean().item(), gain, min_gain)
            return 0
        self.pending = [(layer, phy2log_LR[j].tolist()) for j, layer in enumerate(self.layers)
                        if not torch.equal(phy2log_LR[j], current_LR[j])]
        self.num_rebalances += 1
        log.info("eplb plan %d: balancedness %.3f -> %.3f (mean over layers); %d layer(s) change",
                 self.num_rebalances, before.mean().item(), after.mean().item(), len(self.pending))
        return len(self.pending)

    def rebalance_now(self) -> int:
        """Plan and move every changed layer at once (between steps), whatever the gain. Returns slots that
        loaded weights."""
        moved_before = self.slots_moved
        self.plan(min_gain=float("-inf"))
        self._apply(len(self.pending))
        return self.slots_moved - moved_before

    def move_to(self, placement: dict, count_load: bool = False) -> int:
        """Between steps, on every rank alike: move to a placement another job exported (the placement
        file's JSON, balancer/placement_file.py), taking the rows of this stage's layers from one that covers
        more (every pipeline stage's): its phy2log when the slot count matches, else a plan from its recorded
        load. With `count_load` the exported load also enters this rank's window (the caller picks the ranks,
        so the job counts it once per data-parallel replica of the tokens). Returns how many slots loaded
        weights (0 when it does not fit)."""
        mine = stage_rows(placement, self.layers)
        if mine is None:
            log.warning("eplb: the exported placement covers layers %s, not all of this stage's %s; not restored",
                        placement.get("layer_ids"), self.layers)
            return 0
        placement = mine
        current_LR = self.current_placement()
        phy2log_LR = torch.tensor(placement["placement"]["phy2log"], dtype=torch.long)
        if phy2log_LR.shape != current_LR.shape:
            if placement.get("logical_counts") is None:
                return 0
            load_LE = torch.tensor(placement["logical_counts"], dtype=torch.float64)
            phy2log_LR, _, _ = rebalance_experts(load_LE, current_LR.shape[1], self.num_groups, self.num_nodes,
                                                 self.ep_size, **self.routing)
        self._planning = None
        self.pending = [(layer, phy2log_LR[j].tolist()) for j, layer in enumerate(self.layers)
                        if not torch.equal(phy2log_LR[j], current_LR[j])]
        moved_before = self.slots_moved
        self._apply(len(self.pending))
        if count_load and placement.get("logical_counts") is not None:
            physical = placement.get("physical_counts")
            self.recorder.seed_window(torch.tensor(placement["logical_counts"], dtype=torch.float64),
                                      None if physical is None else torch.tensor(physical, dtype=torch.float64))
        return self.slots_moved - moved_before

    def _apply(self, num_layers: int) -> None:
        for layer, phy2log_R in self.pending[:num_layers]:
            self.slots_moved += self.blocks[layer].relocate_experts(phy2log_R)
        self.pending = self.pending[num_layers:]
        self.recorder.set_placement(self.current_placement())
