"""How the engine's ranks split the work: one flat dataclass, validated on construction and against a model.

world = pp x dp x tp ranks. Expert parallelism (when enabled) spans the dp x tp ranks of one pipeline stage,
so `ep_size = dp * tp`; without it every rank holds all experts of its layers (`ep_size = 1`).
"""

from __future__ import annotations

from dataclasses import dataclass, fields


@dataclass(frozen=True)
class ParallelConfig:
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    data_parallel_size: int = 1
    enable_expert_parallel: bool = False
    collective_timeout_s: float = 60.0  # a collective not done by then ends the job, naming the lost rank(s)
    ranks_per_node: int | None = None  # ranks on one machine (rank r on node r // this); None: torchrun's
    #                                    LOCAL_WORLD_SIZE (its --nproc-per-node)

    def __post_init__(self):
        for name in ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.ranks_per_node is not None and (isinstance(self.ranks_per_node, bool)
                                                or not isinstance(self.ranks_per_node, int) or self.ranks_per_node < 1):
            raise ValueError(f"ranks_per_node must be a positive integer or None, got {self.ranks_per_node!r}")
        if not self.collective_timeout_s > 0:
            raise ValueError(f"collective_timeout_s must be > 0 seconds, got {self.collective_timeout_s!r}")

    @classmethod
    def from_dict(cls, d: dict) -> "ParallelConfig":
        """Build from JSON / CLI flags by field name; unknown keys are an error that names them."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown parallel config field(s) {unknown}; known: {sorted(known)}")
        return cls(**d)

    @property
    def world_size(self) -> int:
        return self.pipeline_parallel_size * self.data_parallel_size * self.tensor_parallel_size

    @property
    def ep_size(self) -> int:
        return self.data_parallel_size * self.tensor_parallel_size if self.enable_expert_parallel else 1

    def validate_against(self, num_experts: int, num_heads: int, num_layers: int, vocab_size: int) -> None:
        """Raise ValueError if this layout cannot split a model of these dimensions evenly.

        num_experts: routed (physical) expert slots per MoE layer, split over the EP ranks.
        num_heads: attention heads, split over TP. num_layers: decoder layers, split over PP stages.
        vocab_size: rows of the embedding / lm head, split over TP.
        """
        tp, pp, ep = self.tensor_parallel_size, self.pipeline_parallel_size, self.ep_size
        if num_experts % ep:
            raise ValueError(
                f"expert parallel size {ep} does not divide {num_experts} experts; the EP size is "
                f"data_parallel_size x tensor_parallel_size: choose sizes whose product divides {num_experts}"
            )
        if num_heads % tp:
            raise ValueError(f"tensor parallel size {tp} does not divide {num_heads} heads; pick a divisor of {num_heads}")
        if vocab_size % tp:
            raise ValueError(
                f"tensor parallel size {tp} does not divide the vocabulary of {vocab_size} tokens "
                f"(the embedding and lm head are split by rows); pick a divisor of {vocab_size}"
            )
        if pp > num_layers:
            raise ValueError(f"pipeline parallel size {pp} exceeds {num_layers} layers; use at most {num_layers} stages")
