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


def split_micro_batches(items: list, token_counts: list[int], num_micro_batches: int) -> list[list]:
    """Contiguous parts of `items` with about equal token counts; always exactly `num_micro_batches`
    parts (some may be empty), so every rank issues the same collectives per step.

    split_micro_batches(["a", "b", "c"], [8, 1, 1], 2) -> [["a"], ["b", "c"]]
    """
    parts: list[list] = [[] for _ in range(num_micro_batches)]
    total, done, part = sum(token_counts), 0, 0
    for item, n in zip(items, token_counts):
        # move on once this part holds its share of the tokens (keeping later parts non-empty if possible)
        if parts[part] and part < num_micro_batches - 1 and done >= total * (part + 1) / num_micro_batches:
            part += 1
        parts[part].append(item)
        done += n
    return parts
