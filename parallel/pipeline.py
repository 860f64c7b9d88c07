"""Pipeline stages: which contiguous layers each stage holds."""

from __future__ import annotations


def stage_layer_range(num_layers: int, pp_size: int, pp_rank: int) -> tuple[int, int]:
    """Layers [start, end) of stage `pp_rank`; earlier stages take the remainder, one layer each.

    stage_layer_range(7, 3, r) -> (0, 3), (3, 5), (5, 7) for r = 0, 1, 2.
    """
    if pp_size > num_layers:
        raise ValueError(f"pipeline parallel size {pp_size} exceeds {num_layers} layers")
    base, extra = divmod(num_layers, pp_size)
    start = pp_rank * base + min(pp_rank, extra)
    return start, start + base + (1 if pp_rank < extra else 0)
