"""Expert load recorder: tokens routed to each (MoE layer, logical expert) and (MoE layer, physical slot).

Shape legend (as in balancer/placement.py): W = window steps, L = MoE layers, E = logical experts,
R = physical slots, G = expert-parallel ranks, K = experts per token, T = tokens in a step.

The MoE blocks call `record(layer, topk_ids_TK)` during the forward pass; the engine loop calls
`end_step()` after each engine step. Counting is one scatter-add per step for all MoE layers, when the step
closes, on the device that holds `topk_ids_TK` (a bincount that, unlike `torch.bincount` on CUDA, never reads
the maximum back to the host), so recording adds no host sync; counts come to the CPU only in `snapshot()`.

Three views of the same counts:
    window  the last W completed steps (a ring buffer of per-step count tensors)
    total   every step since the recorder was made (monotonic: feeds Prometheus counters)
    record  the steps between `start_record()` and `stop_record()` (SGLang's expert distribution record)

Physical slots: the placement `phy2log_LR` says which expert each slot holds (identity by default:
slot i holds expert i). When the caller passes the slot ids it actually used (`phy_ids_TK`), those are
counted; otherwise an expert's tokens are split evenly over its replicas, as balancer.placement models it.

Worked example (2 layers, 3 experts, window 2):
    rec.record(0, tensor([[0, 1], [0, 2]])); rec.record(1, tensor([[2, 2]])); rec.end_step()
    rec.snapshot().window_LE == [[2, 1, 1], [0, 0, 2]]
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moe_serve.balancer.locality import coactivation
from moe_serve.parallel import comm


@dataclass
class LoadSnapshot:
    """CPU copies of the counts; see the module docstring for the three views."""
    window_LE: torch.Tensor
    window_LR: torch.Tensor
    total_LE: torch.Tensor
    total_LR: torch.Tensor
    record_LE: torch.Tensor
    record_LR: torch.Tensor
    recording: bool
    window_steps: int  # steps the window holds when full
    steps_in_window: int
    steps_total: int
    steps_recorded: int


def balancedness_per_layer(slot_load_LR: torch.Tensor, ep_size: int) -> torch.Tensor:
    """Per layer mean rank load / max rank load, in (0, 1]; 1.0 for a layer with no load.

    Slots are split evenly over the ep_size ranks (slot p on rank p // (R // G)). With ep_size 1 every slot
    counts as its own unit, so the measure says how evenly the experts themselves are loaded.
    """
    load_LG = rank_loads(slot_load_LR.double(), ep_size if ep_size > 1 else slot_load_LR.shape[1])
    max_L = load_LG.max(1).values
    return torch.where(max_L > 0, load_LG.mean(1) / max_L.clamp(min=1e-300), torch.ones_like(max_L))


def rank_loads(slot_load_LR: torch.Tensor, ep_size: int) -> torch.Tensor:
    """load_LG: the sum of each rank's slots' loads."""
    num_layers, num_slots = slot_load_LR.shape
    if num_slots % ep_size:
        raise ValueError(f"{num_slots} slots do not divide evenly over {ep_size} expert-parallel ranks")
    return slot_load_LR.reshape(num_layers, ep_size, num_slots // ep_size).sum(2)


class ExpertLoadRecorder:
    def __init__(self, num_layers: int, num_experts: int, *, window_steps: int = 1000, ep_size: int = 1,
                 phy2log_LR: torch.Tensor | None = None, layer_ids: list[int] | None = None,
                 device: torch.device | str = "cpu"):
        if num_layers < 1 or num_experts < 1:
            raise ValueError(f"need at least one MoE layer and one expert, got {num_layers} layers, {num_experts} experts")
        if window_steps < 1:
            raise ValueError(f"window_steps must be at least 1, got {window_steps}")
        self.num_layers, self.num_experts, self.window_steps, self.ep_size = num_layers, num_experts, window_steps, ep_size
        self.layer_ids = list(layer_ids) if layer_ids is not None else list(range(num_layers))
        if len(self.layer_ids) != num_layers:
            raise ValueError(f"layer_ids has {len(self.layer_ids)} entries for {num_layers} MoE layers")
        self.device = torch.device(device)
        self.set_placement(phy2log_LR if phy2log_LR is not None
                           else torch.arange(num_experts).expand(num_layers, num_experts).clone())
        L, E = num_layers, num_experts
        self._step_LE = torch.zeros(L, E, dtype=torch.int64, device=self.device)
        self._ring_WLE = torch.zeros(window_steps, L, E, dtype=torch.int64, device=self.device)
        self._total_LE = torch.zeros(L, E, dtype=torch.int64, device=self.device)
        self._record_LE = torch.zeros(L, E, dtype=torch.int64, device=self.device)
        # measured slot counts (allocated here, outside any inference-mode forward pass)
        self._step_LR = self._ring_WLR = self._total_LR = self._record_LR = None
        self._alloc_slot_counts()
        self._measured_slots = False  # set once a caller passes the slot ids it used
        self._ones = torch.ones(256, dtype=torch.int64, device=self.device)
        self._offsets: dict[tuple, torch.Tensor] = {}  # _scatter's row offsets by pattern of (layer, ids)
        self._pending: list[tuple[int, torch.Tensor, torch.Tensor | None]] = []  # this step's record() calls
        self._coact_step_LEE = self._coact_total_LEE = None  # co-activation, once enable_coactivation() is called
        self._pos = 0  # ring row the next completed step goes to
        self.steps_total = 0
        self.steps_recorded = 0
        self.recording = False

    @property
    def num_slots(self) -> int:
        return self.phy2log_LR.shape[1]

    def set_placement(self, phy2log_LR: torch.Tensor) -> None:
        """Which expert each slot holds, per layer; only between steps."""
        phy2log_LR = phy2log_LR.long().cpu()
        if phy2log_LR.dim() != 2 or phy2log_LR.shape[0] != self.num_layers:
            raise ValueError(f"phy2log must be [{self.num_layers}, slots], got {tuple(phy2log_LR.shape)}")
        if phy2log_LR.shape[1] % self.ep_size:
            raise ValueError(f"{phy2log_LR.shape[1]} slots do not divide evenly over {self.ep_size} expert-parallel ranks")
        self.phy2log_LR = phy2log_LR

    def enable_coactivation(self) -> None:
        """Also count, per layer, the tokens that chose both of two experts (balancer.locality.coactivation): what
        a node-aware placement keeps together. Totals since start or the last reset; L x E x E counts."""
        if self._coact_total_LEE is None:
            shape = (self.num_layers, self.num_experts, self.num_experts)
            self._coact_step_LEE = torch.zeros(shape, dtype=torch.int64, device=self.device)
            self._coact_total_LEE = torch.zeros(shape, dtype=torch.int64, device=self.device)

    def coactivation(self) -> torch.Tensor | None:
        """CPU copy of the co-activation totals [L, E, E], or None when not counted."""
        return None if self._coact_total_LEE is None else self._coact_total_LEE.cpu().clone()

    # ---- hot path (inside the forward pass) --------------------------------------------------------
    def layer_sink(self, layer: int) -> "LayerLoadSink":
        """What MoE layer `layer` (0-based among the recorded layers) calls with its routing every forward."""
        return LayerLoadSink(self, layer)

    def record(self, layer: int, topk_ids_TK: torch.Tensor, phy_ids_TK: torch.Tensor | None = None) -> None:
        """Count layer `layer`'s routing of this step; the ids are read when the step closes (`end_step`), so the
        caller must not change them in place before then."""
        self._pending.append((layer, topk_ids_TK, phy_ids_TK))

    def _count_pending(self) -> None:
        """The step's routing, every layer at once: one scatter-add into the step's expert counts and one into
        its slot counts (a scatter-add per layer cost about 50 us of Python and dispatch on a CPU), or the expert
        counts again where every layer passed one tensor as both (end_step for 5 layers: 19 us against 40 with a
        second scatter-add and each layer's offsets added apart, on a Zen 5 VM)."""
        pending, self._pending = self._pending, []
        if not pending:
            return
        self._scatter(self._step_LE, [(layer, t) for layer, t, _ in pending], self.num_experts)
        if self._coact_step_LEE is not None:
            for layer, t, _ in pending:
                if t.dim() == 2:
                    coactivation(t, self.num_experts, out_EE=self._coact_step_LEE[layer])
        slots = [(layer, p) for layer, _, p in pending if p is not None]
        if slots:
            self._measured_slots = True
            if len(slots) == len(pending) and all(p is t for _, t, p in pending) and self.num_slots == self.num_experts:
                self._step_LR += self._step_LE  # a slot per expert, each holding its own (the layers passed one tensor)
            else:
                self._scatter(self._step_LR, slots, self.num_slots)

    def _scatter(self, counts_LW: torch.Tensor, ids: list[tuple[int, torch.Tensor]], width: int) -> None:
        """counts_LW[layer, id] += 1 for every (layer, ids) given, in one scatter-add. Each id's row offset (layer x
        width) comes from a tensor kept per pattern of (layer, number of ids): a step's pattern repeats as long as
        its batch does, so a decode step costs a concatenation, an add and the scatter-add."""
        key = (width, tuple((layer, t.numel()) for layer, t in ids))
        offsets = self._offsets.get(key)
        if offsets is None:
            offsets = torch.cat([torch.full((t.numel(),), layer * width, dtype=torch.int64, device=self.device)
                                 for layer, t in ids])
            if len(self._offsets) >= 64:  # batches of every size seen: start over rather than grow
                self._offsets.clear()
            self._offsets[key] = offsets
        flat = torch.cat([t.reshape(-1) for _, t in ids]).long() + offsets
        counts_LW.view(-1).index_add_(0, flat, self._ones_for(flat.numel()))

    def _ones_for(self, n: int) -> torch.Tensor:
        """n ones to scatter-add, from a buffer kept between steps."""
        if self._ones.numel() < n:
            self._ones = torch.ones(max(n, 2 * self._ones.numel()), dtype=torch.int64, device=self.device)
        return self._ones[:n]

    def _alloc_slot_counts(self) -> None:
        L, R, dev = self.num_layers, self.num_slots, self.device
        self._step_LR = torch.zeros(L, R, dtype=torch.int64, device=dev)
        self._ring_WLR = torch.zeros(self.window_steps, L, R, dtype=torch.int64, device=dev)
        self._total_LR = torch.zeros(L, R, dtype=torch.int64, device=dev)
        self._record_LR = torch.zeros(L, R, dtype=torch.int64, device=dev)

    # ---- between steps -------------------------------------------------------------------------------
    def end_step(self) -> None:
        """Close the step: move its counts into the ring (dropping the oldest step) and the totals."""
        self._count_pending()
        pairs = [(self._step_LE, self._ring_WLE, self._total_LE, self._record_LE)]
        if self._measured_slots:
            pairs.append((self._step_LR, self._ring_WLR, self._total_LR, self._record_LR))
        for step, ring, total, record in pairs:
            ring[self._pos].copy_(step)
            total += step
            if self.recording:
                record += step
            step.zero_()
        if self._coact_step_LEE is not None:
            self._coact_total_LEE += self._coact_step_LEE
            self._coact_step_LEE.zero_()
        self._pos = (self._pos + 1) % self.window_steps
        self.steps_total += 1
        self.steps_recorded += int(self.recording)

    def seed_window(self, logical_LE: torch.Tensor, physical_LR: torch.Tensor | None = None) -> None:
        """Between steps: count a load recorded elsewhere (the window a previous job exported) as the oldest
        step of the window, so it ages out after `window_steps` steps of this job. physical_LR: its counts per
        slot, for the current placement (not taken when the slot count differs)."""
        if tuple(logical_LE.shape) != (self.num_layers, self.num_experts):
            raise ValueError(f"load must be [{self.num_layers}, {self.num_experts}], got {tuple(logical_LE.shape)}")
        row = (self._pos - 1) % self.window_steps  # the row written last: overwritten after window_steps steps
        self._ring_WLE[row] += logical_LE.round().long().to(self.device)
        if physical_LR is not None and tuple(physical_LR.shape) == (self.num_layers, self.num_slots):
            self._ring_WLR[row] += physical_LR.round().long().to(self.device)

    def last_step(self) -> torch.Tensor:
        """CPU copy of the last completed step's tokens per (layer, expert)."""
        return self._ring_WLE[(self._pos - 1) % self.window_steps].cpu().clone()

    def discard_step(self) -> None:
        """Close a step that must not count (a dummy batch of a DP rank with no work): its counts are dropped and
        the window keeps its real steps."""
        self._pending = []
        self._step_LE.zero_()
        if self._measured_slots:
            self._step_LR.zero_()
        if self._coact_step_LEE is not None:
            self._coact_step_LEE.zero_()

    def reset(self) -> None:
        """Forget everything recorded so far (the server calls it after its warm-up generation)."""
        self._pending = []
        for t in (self._step_LE, self._ring_WLE, self._total_LE, self._record_LE, self._step_LR, self._ring_WLR,
                  self._total_LR, self._record_LR, self._coact_step_LEE, self._coact_total_LEE):
            if t is not None:
                t.zero_()
        self._pos = 0
        self.steps_total = self.steps_recorded = 0

    def start_record(self) -> None:
        """Start a fresh recording (earlier recorded counts are dropped)."""
        self._record_LE.zero_()
        if self._record_LR is not None:
            self._record_LR.zero_()
        self.steps_recorded = 0
        self.recording = True

    def stop_record(self) -> None:
        self.recording = False

    def _slots(self, counts_LE: torch.Tensor, measured_LR: torch.Tensor | None) -> torch.Tensor:
        if measured_LR is not None:
            return measured_LR.cpu()
        logcnt_LE = torch.zeros_like(counts_LE).scatter_add_(1, self.phy2log_LR, torch.ones_like(self.phy2log_LR))
        per_replica_LE = counts_LE.double() / logcnt_LE.clamp(min=1)
        slot_LR = per_replica_LE.gather(1, self.phy2log_LR)
        identity = bool((logcnt_LE == 1).all())
        return slot_LR.round().long() if identity else slot_LR

    def snapshot(self) -> LoadSnapshot:
        """CPU copies of the window, total and record counts (one host sync; call between steps)."""
        window_LE = self._ring_WLE.sum(0).cpu()
        total_LE, record_LE = self._total_LE.cpu().clone(), self._record_LE.cpu().clone()  # copies, even on CPU
        measured = self._measured_slots
        return LoadSnapshot(
            window_LE=window_LE, total_LE=total_LE, record_LE=record_LE,
            window_LR=self._slots(window_LE, self._ring_WLR.sum(0) if measured else None),
            total_LR=self._slots(total_LE, self._total_LR.clone() if measured else None),
            record_LR=self._slots(record_LE, self._record_LR.clone() if measured else None),
            recording=self.recording, window_steps=self.window_steps,
            steps_in_window=min(self.window_steps, self.steps_total), steps_total=self.steps_total,
            steps_recorded=self.steps_recorded)

    def to_json(self, view: str = "window", sum_over: comm.Group | None = None) -> dict:
        """The JSON body of GET /v1/expert_load (view "window") and of the record dump (view "record").

        sum_over: a group of ranks that routed different tokens through the same layers (the data-parallel
        ranks): their counts are summed, so the report covers the whole job's traffic. Every rank of the
        group must call this together."""
        snap = self.snapshot()
        counts_LE, slots_LR = {"window": (snap.window_LE, snap.window_LR), "total": (snap.total_LE, snap.total_LR),
                               "record": (snap.record_LE, snap.record_LR)}[view]
        if sum_over is not None and sum_over.size > 1:
            counts_LE = comm.all_reduce(counts_LE.to(self.device), sum_over).cpu()
            slots_LR = comm.all_reduce(slots_LR.double().to(self.device), sum_over).cpu()
        bal_L = balancedness_per_layer(slots_LR, self.ep_size)
        return {
            "view": view,
            "num_layers": self.num_layers, "layer_ids": self.layer_ids, "num_experts": self.num_experts,
            "num_slots": self.num_slots, "ep_size": self.ep_size,
            "window_steps": self.window_steps,
            "steps": {"window": snap.steps_in_window, "total": snap.steps_total, "record": snap.steps_recorded}[view],
            "recording": snap.recording,
            "logical_counts": counts_LE.tolist(),
            "physical_counts": slots_LR.tolist(),
            "placement": {"phy2log": self.phy2log_LR.tolist()},
            "rank_tokens": rank_loads(slots_LR, self.ep_size).tolist(),
            "balancedness": bal_L.tolist(),
            "balancedness_mean": float(bal_L.mean()),
            "balancedness_min": float(bal_L.min()),
        }


class LayerLoadSink:
    """One MoE layer's view of an ExpertLoadRecorder: `sink(topk_ids_TK, phy_ids_TK)` counts that layer's routing."""

    def __init__(self, recorder: ExpertLoadRecorder, layer: int):
        self.recorder, self.layer = recorder, layer

    def __call__(self, topk_ids_TK: torch.Tensor, phy_ids_TK: torch.Tensor | None = None) -> None:
        self.recorder.record(self.layer, topk_ids_TK, phy_ids_TK)
