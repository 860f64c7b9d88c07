"""A placement file (balancer/placement_file.py) over pipeline stages: each stage holds its own MoE layers, so
each exports the rows of its layers; `merge_stages` joins them into one file covering every layer, and
`stage_rows` takes one stage's layers back out of a file that covers them (and possibly more).

Legend: L = MoE layers, E = logical experts, R = physical slots, G = expert-parallel ranks.

Worked example (stage 0 holds MoE layer 1, stage 1 layers 2 and 3):
    merge_stages([{"layer_ids": [1], "placement": {"phy2log": [[0, 1]]}, ...},
                  {"layer_ids": [2, 3], "placement": {"phy2log": [[1, 0], [0, 1]]}, ...}])
        -> {"layer_ids": [1, 2, 3], "num_layers": 3, "placement": {"phy2log": [[0, 1], [1, 0], [0, 1]]}, ...}
    stage_rows(merged, [2, 3]) -> {"layer_ids": [2, 3], "num_layers": 2, "placement": {"phy2log": [[1, 0], [0, 1]]}, ...}
"""

from __future__ import annotations

# the fields with one row per MoE layer, besides layer_ids [L] and placement.phy2log [L][R]
PER_LAYER = ("logical_counts",  # [L][E]
             "physical_counts",  # [L][R]
             "rank_tokens",  # [L][G]
             "balancedness")  # [L]
# fields every stage's part must agree on
SHARED = ("num_experts", "num_slots", "ep_size")


def layer_rows(have: list[int] | None, want: list[int]) -> list[int] | None:
    """Row of each layer of `want` in a file whose rows are the layers `have`; None if one is missing.

    layer_rows([1, 2, 3], [2, 3]) -> [1, 2]; layer_rows([1], [1, 2]) -> None
    """
    if have is None:
        return None
    index = {layer: j for j, layer in enumerate(have)}
    return [index[layer] for layer in want] if all(layer in index for layer in want) else None


def _rows_of(part: dict) -> dict[str, list]:
    """The per-layer fields a part has, phy2log among them."""
    rows = {key: part[key] for key in PER_LAYER if part.get(key) is not None}
    phy2log = part.get("placement", {}).get("phy2log")
    if phy2log is not None:
        rows["phy2log"] = phy2log
    return rows


def _with_rows(base: dict, rows: dict[str, list], layer_ids: list[int]) -> dict:
    """`base`'s other fields with these rows, for these layers (summary fields recomputed or dropped)."""
    out = {k: v for k, v in base.items()
           if k not in (*PER_LAYER, "placement", "balancedness_mean", "balancedness_min")}
    out.update({k: v for k, v in rows.items() if k != "phy2log"}, layer_ids=list(layer_ids), num_layers=len(layer_ids))
    if "phy2log" in rows:
        out["placement"] = {**base.get("placement", {}), "phy2log": rows["phy2log"]}
    if out.get("balancedness"):
        out["balancedness_mean"] = sum(out["balancedness"]) / len(out["balancedness"])
        out["balancedness_min"] = min(out["balancedness"])
    return out


def merge_stages(parts: list[dict]) -> dict:
    """One placement file covering every MoE layer, from each stage's (in any order). A per-layer field that
    some part lacks is left out; the other fields are the first stage's."""
    if not parts:
        raise ValueError("no stage exported a placement: nothing to merge")
    parts = sorted(parts, key=lambda p: p["layer_ids"][0])
    for key in SHARED:
        values = {p.get(key) for p in parts}
        if len(values) > 1:
            raise ValueError(f"the pipeline stages' placements disagree on {key}: {sorted(values, key=str)}")
    layer_ids = [layer for p in parts for layer in p["layer_ids"]]
    if len(set(layer_ids)) != len(layer_ids):
        raise ValueError(f"the pipeline stages' placements overlap: layers {layer_ids}")
    part_rows = [_rows_of(p) for p in parts]
    fields = set.intersection(*(set(r) for r in part_rows))
    rows = {key: [row for r in part_rows for row in r[key]] for key in sorted(fields)}
    return _with_rows(parts[0], rows, layer_ids)


def stage_rows(placement: dict, layer_ids: list[int]) -> dict | None:
    """The file's rows for `layer_ids` (one stage's MoE layers, in that order), or None when it lacks one."""
    rows = layer_rows(placement.get("layer_ids"), layer_ids)
    if rows is None:
        return None
    picked = {key: [rows_L[j] for j in rows] for key, rows_L in _rows_of(placement).items()}
    return _with_rows(placement, picked, layer_ids)
