"""Placement files and load dumps (JSON), and the what-if planner behind `moe plan`.

A placement file is what `GET /v1/expert_load` and `LLM.export_placement` write: `layer_ids`,
`num_experts`, `ep_size`, `logical_counts` [L][E] and `placement.phy2log` [L][R]. Starting from one
(`--expert-placement FILE`) uses its phy2log when its slot count matches the deployment, else plans
from its recorded load; a file covering more layers (every pipeline stage's) gives each stage its own rows.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from moe_serve.balancer.eplb import rebalance_experts
from moe_serve.balancer.locality import node_local_balancedness, remote_nodes_per_token, sample_routed_tokens
from moe_serve.balancer.placement import moved_slots
from moe_serve.balancer.placement_stages import layer_rows


def read_load_file(path: str | Path) -> dict:
    try:
        raw = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"expert placement file {str(path)!r} cannot be read as JSON: {exc}") from None
    if "logical_counts" not in raw and "phy2log" not in raw.get("placement", {}):
        raise ValueError(f"expert placement file {str(path)!r} has neither logical_counts nor placement.phy2log")
    out = {"layer_ids": raw.get("layer_ids"), "num_experts": raw.get("num_experts"), "load": None, "phy2log": None}
    if raw.get("logical_counts") is not None:
        out["load"] = torch.tensor(raw["logical_counts"], dtype=torch.float64)
    if raw.get("placement", {}).get("phy2log") is not None:
        out["phy2log"] = torch.tensor(raw["placement"]["phy2log"], dtype=torch.int64)
    return out


def initial_placement(moe_layers: list[int], num_experts: int, num_slots: int, ep_size: int, num_groups: int,
                      source: str | Path | None = None, num_nodes: int = 1, topk: int = 8,
                      topk_group: int | None = None) -> dict[int, list[int]] | None:
    """phy2log per MoE layer at start-up: from a placement file, planned from its load, or planned for
    uniform load when there are redundant slots. None = identity (slot i holds expert i)."""
    if source is None:
        if num_slots == num_experts:
            return None
        load_LE = torch.ones(len(moe_layers), num_experts, dtype=torch.float64)
    else:
        f = read_load_file(source)
        if f["num_experts"] not in (None, num_experts):
            raise ValueError(f"expert placement file is for {f['num_experts']} experts; the model has {num_experts}")
        if f["layer_ids"] is not None:  # a file covering more layers (every pipeline stage's): this stage's rows
            rows = layer_rows(list(f["layer_ids"]), list(moe_layers))
            if rows is None:
                raise ValueError(f"expert placement file covers layers {f['layer_ids']}; this stage has {moe_layers}")
            for key in ("load", "phy2log"):
                if f[key] is not None:
                    f[key] = f[key][rows]
        if f["phy2log"] is not None and f["phy2log"].shape == (len(moe_layers), num_slots):
            return {layer: f["phy2log"][j].tolist() for j, layer in enumerate(moe_layers)}
        if f["load"] is None:
            raise ValueError(f"expert placement file has {f['phy2log'].shape[1]} slots per layer, the deployment "
                             f"{num_slots}, and no load to plan from")
        load_LE = f["load"]
    phy2log_LR, _, _ = rebalance_experts(load_LE, num_slots, num_groups, num_nodes, ep_size, topk=topk,
                                         topk_group=topk_group)
    return {layer: phy2log_LR[j].tolist() for j, layer in enumerate(moe_layers)}


def what_if(load_LE: torch.Tensor, ep_size: int, num_redundant: int, num_nodes: int = 1, num_groups: int = 1,
            current_LR: torch.Tensor | None = None, expert_bytes: int | None = None,
            layer_ids: list[int] | None = None, topk: int = 8, topk_group: int = 1, token_bytes: int | None = None,
            sample_tokens: int = 4096) -> dict:
    """Predicted effect of replanning: balancedness per layer against the no-replication layout (slot i
    holds expert i), slots moved from the current placement, and the extra memory of redundant slots. On
    several nodes (balancedness under the node-local rule, balancer/locality.py), also the cross-node rows
    per token (distinct remote nodes), on tokens sampled from the load and routed as the model routes
    (topk of num_groups groups' best topk_group), and their bytes given token_bytes (hidden size x dtype)."""
    L, E = load_LE.shape
    R = E + num_redundant
    if E % ep_size or R % ep_size:
        raise ValueError(f"expert parallel size {ep_size} must divide {E} experts and {R} slots")
    baseline_LR = torch.arange(E).expand(L, E)
    if ep_size % num_nodes:
        raise ValueError(f"{num_nodes} nodes must divide the {ep_size} EP ranks")
    plan_LR, _, _ = rebalance_experts(load_LE.double(), R, num_groups, num_nodes, ep_size, topk=topk,
                                      topk_group=topk_group,
                                      previous=current_LR if current_LR is not None and current_LR.shape[1] == R else None)
    def balance(plan_LR):
        return node_local_balancedness(load_LE.double(), plan_LR, ep_size, num_nodes).tolist()

    report = {
        "num_layers": L, "num_experts": E, "num_slots": R, "ep_size": ep_size, "num_nodes": num_nodes,
        "layer_ids": list(layer_ids) if layer_ids is not None else list(range(L)),  # decoder-layer indices
        "balancedness_no_replication": balance(baseline_LR),
        "balancedness_planned": balance(plan_LR),
        "phy2log": plan_LR.tolist(),
    }
    if current_LR is not None:
        report["balancedness_current"] = balance(current_LR)
        if current_LR.shape == plan_LR.shape:
            report["slots_moved"] = moved_slots(current_LR, plan_LR)
    if expert_bytes is not None:
        report["extra_bytes_per_rank"] = num_redundant * L * expert_bytes // ep_size
    if num_nodes > 1:
        gen = torch.Generator().manual_seed(0)
        tokens = [sample_routed_tokens(w_E, sample_tokens, min(topk, E), num_groups, topk_group, gen) for w_E in load_LE]
        src_T = torch.arange(sample_tokens) % num_nodes

        def remote(plan_LR):  # cross-node rows per token, mean over layers
            return sum(remote_nodes_per_token(t, src_T, p, ep_size, num_nodes).double().mean().item()
                       for t, p in zip(tokens, plan_LR)) / L

        report["cross_node_rows_per_token"] = {"no_replication": remote(baseline_LR), "planned": remote(plan_LR)}
        if current_LR is not None:
            report["cross_node_rows_per_token"]["current"] = remote(current_LR)
        if token_bytes is not None:
            report["token_bytes"] = token_bytes
    return report


def format_what_if(report: dict) -> str:
    base, plan = report["balancedness_no_replication"], report["balancedness_planned"]
    lines = [f"{report['num_layers']} MoE layers, {report['num_experts']} experts -> {report['num_slots']} slots on "
             f"{report['ep_size']} EP ranks ({report['num_nodes']} node(s))",
             f"{'layer':>5} {'no replication':>15} {'planned':>8}" + (f" {'current':>8}" if "balancedness_current" in report else "")]
    for j, (layer, b, p) in enumerate(zip(report["layer_ids"], base, plan)):
        cur = f" {report['balancedness_current'][j]:>8.3f}" if "balancedness_current" in report else ""
        lines.append(f"{layer:>5} {b:>15.3f} {p:>8.3f}{cur}")
    lines.append(f" mean {sum(base) / len(base):>15.3f} {sum(plan) / len(plan):>8.3f}")
    if "slots_moved" in report:
        lines.append(f"slots that would load new weights: {report['slots_moved']} of "
                     f"{report['num_layers'] * report['num_slots']}")
    elif "balancedness_current" in report:
        lines.append("slots that would load new weights: all (the number of slots per layer changes)")
    if "cross_node_rows_per_token" in report:
        rows = report["cross_node_rows_per_token"]
        size = report.get("token_bytes")
        lines.append("cross-node rows per token (distinct remote nodes, tokens sampled from the load): "
                     + ", ".join(f"{k.replace('_', ' ')} {v:.3f}" + (f" ({v * size / 1024:.1f} KiB)" if size else "")
                                 for k, v in rows.items()))
    if "extra_bytes_per_rank" in report:
        lines.append(f"extra memory per EP rank for redundant slots: {report['extra_bytes_per_rank'] / 2**20:.3f} MiB")
    return "\n".join(lines)
