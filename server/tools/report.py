"""`moe report`: expert-load heatmaps and a text summary, from a running server or a JSON dump.

Input: the JSON of GET /v1/expert_load (or /dump_expert_distribution_record): logical_counts [L, E],
placement.phy2log [L, R], layer_ids, ep_size. Output in --out:
    layer_expert.png   load of each (MoE layer, expert), relative to the layer's mean expert load
    layer_rank.png     load of each (MoE layer, EP rank) under the current placement, relative to the mean
    balancedness.png   per layer: now, with one extra replica for the hottest experts, and EPLB's plan
    summary.txt        balancedness per layer, hottest experts, and what replication would change

Balancedness is mean / max load over EP ranks (with EP size 1 each slot is its own unit), as in
balancer.stats. The replication simulation keeps the current placement and gives the K hottest experts of
every layer one extra replica (K = --extra-replicas: by default one per rank, so every rank gets one more
slot), hottest first, each on the rank (with a free slot, not holding the expert) that leaves the busiest
rank least loaded; a replicated expert's load splits evenly. The EPLB column re-plans all slots instead.
Legend: L = MoE layers, E = experts, R = slots, G = EP ranks (units), K = extra replicas.
"""

from __future__ import annotations

import argparse
import json
import urllib.request
from pathlib import Path

import torch

from moe_serve.balancer.placement import balancedness, gpu_loads


def load_dump(url: str | None = None, file: str | None = None, view: str = "window",
              api_key: str | None = None) -> dict:
    if file is not None:
        return json.loads(Path(file).read_text())
    req = urllib.request.Request(f"{url.rstrip('/')}/v1/expert_load?view={view}")
    if api_key:
        req.add_header("Authorization", f"Bearer {api_key}")
    with urllib.request.urlopen(req, timeout=30) as resp:
        return json.loads(resp.read())


def _units(num_slots: int, ep_size: int) -> int:
    return ep_size if ep_size > 1 else num_slots


def replicate_hottest(weight_E: torch.Tensor, phy2log_R: torch.Tensor, ep_size: int, extra: int) -> torch.Tensor:
    """phy2log of R + extra slots: the `extra` hottest experts get one more replica each, placed greedily."""
    hottest = weight_E.argsort(descending=True, stable=True)[:extra].tolist()
    if ep_size <= 1:  # each slot its own unit: placement does not matter
        return torch.cat([phy2log_R, torch.tensor(hottest, dtype=phy2log_R.dtype)])
    if extra % ep_size:
        raise ValueError(f"--extra-replicas {extra} must be a multiple of the EP size {ep_size} (equal slots per rank)")
    per_rank = phy2log_R.shape[0] // ep_size
    ranks = [phy2log_R[g * per_rank:(g + 1) * per_rank].tolist() for g in range(ep_size)]
    count = torch.bincount(phy2log_R, minlength=weight_E.shape[0]).double()
    weight_E = weight_E.double()

    def max_load_with(g: int, e: int) -> float:  # the busiest rank's load if rank g takes a replica of e
        cnt = count.clone()
        cnt[e] += 1
        trial = [r + [e] if i == g else r for i, r in enumerate(ranks)]
        return max(float((weight_E[r] / cnt[r]).sum()) for r in trial)

    for e in hottest:
        free = [g for g in range(ep_size) if len(ranks[g]) < per_rank + extra // ep_size and e not in ranks[g]]
        free = free or [g for g in range(ep_size) if len(ranks[g]) < per_rank + extra // ep_size]
        ranks[min(free, key=lambda g: max_load_with(g, e))].append(e)
        count[e] += 1
    return torch.tensor([e for r in ranks for e in r], dtype=phy2log_R.dtype)


def default_ranks(num_slots: int, ep_size: int) -> int:
    """EP ranks to simulate: the dump's when it has several, else the most (<= 8) that divide the slots."""
    if ep_size > 1:
        return ep_size
    return max((g for g in range(2, 9) if num_slots % g == 0), default=1)


def analyse(dump: dict, ep_size: int | None = None, extra: int | None = None) -> dict:
    weight_LE = torch.tensor(dump["logical_counts"], dtype=torch.float64)
    phy2log_LR = torch.tensor(dump["placement"]["phy2log"], dtype=torch.int64)
    L, E = weight_LE.shape
    R = phy2log_LR.shape[1]
    G = ep_size or default_ranks(R, dump.get("ep_size", 1))
    if R % G:
        raise ValueError(f"--ep-size {G} does not divide {R} slots")
    K = extra if extra is not None else (G if G > 1 else max(1, E // 8))
    experts_L = balancedness(weight_LE, phy2log_LR, R)  # the server's metric with EP size 1: slots as units
    now_L = balancedness(weight_LE, phy2log_LR, _units(R, G))
    rep_LR = torch.stack([replicate_hottest(weight_LE[i], phy2log_LR[i], G, K) for i in range(L)])
    rep_L = balancedness(weight_LE, rep_LR, _units(R + K, G))
    try:
        from moe_serve.balancer.eplb import rebalance_experts

        eplb_LR = rebalance_experts(weight_LE, R + K, 1, 1, _units(R + K, G))[0]
        eplb_L = balancedness(weight_LE, eplb_LR, _units(R + K, G))
    except (ImportError, ValueError):
        eplb_L = None
    return {"weight_LE": weight_LE, "phy2log_LR": phy2log_LR, "rank_LG": gpu_loads(weight_LE, phy2log_LR, G),
            "ep_size": G, "simulated": G != dump.get("ep_size", 1), "extra": K, "experts_L": experts_L,
            "now_L": now_L, "replicated_L": rep_L, "eplb_L": eplb_L,
            "layer_ids": dump.get("layer_ids", list(range(L)))}


def summary_text(dump: dict, a: dict) -> str:
    w, ids, G, K = a["weight_LE"], a["layer_ids"], a["ep_size"], a["extra"]
    L, E = w.shape
    R = a["phy2log_LR"].shape[1]
    ranks = f"{G} EP ranks{' (simulated)' if a['simulated'] else ''}" if G > 1 else "slots (EP size 1)"
    lines = [f"expert load ({dump.get('view', 'window')}, {dump.get('steps', '?')} steps): {L} MoE layers x {E} experts "
             f"in {R} slots, {w.sum():.0f} token-expert assignments",
             f"balancedness = mean / max load: 'experts' over the slots (the server's metric with EP size 1), "
             f"'ranks' over {ranks}; '+{K} repl.' and 'EPLB' over the same ranks with {R + K} slots", ""]
    lines.append(f"{'layer':>5} {'tokens':>9} {'experts':>8} {'ranks':>7} {f'+{K} repl.':>10} {'EPLB':>7}  "
                 "hottest experts (share of layer)")
    for i in range(L):
        total = float(w[i].sum())
        top = w[i].argsort(descending=True)[:3].tolist()
        hot = ", ".join(f"{e} ({w[i, e] / total:.0%})" if total else f"{e}" for e in top)
        eplb = f"{float(a['eplb_L'][i]):7.3f}" if a["eplb_L"] is not None else f"{'-':>7}"
        lines.append(f"{ids[i]:>5} {total:>9.0f} {float(a['experts_L'][i]):>8.3f} {float(a['now_L'][i]):>7.3f} "
                     f"{float(a['replicated_L'][i]):>10.3f} {eplb}  {hot}")
    lines.append("")
    now, rep = a["now_L"], a["replicated_L"]
    lines.append(f"balancedness over {ranks} now: mean {now.mean():.3f}, min {now.min():.3f} "
                 f"(layer {ids[int(now.argmin())]}); over experts: mean {a['experts_L'].mean():.3f}")
    overall = w.sum(0)
    top = overall.argsort(descending=True)[:5].tolist()
    lines.append("hottest experts over all layers: " + ", ".join(
        f"{e} ({overall[e] / max(float(overall.sum()), 1):.1%})" for e in top))
    lines.append(f"replication: one extra replica for the {K} hottest experts of each layer, current placement kept "
                 f"({R} -> {R + K} slots), would make mean balancedness {now.mean():.3f} -> {rep.mean():.3f} and min "
                 f"{now.min():.3f} -> {rep.min():.3f}")
    if a["eplb_L"] is not None:
        lines.append(f"EPLB (balancer.eplb.rebalance_experts) re-planning all {R + K} slots: mean "
                     f"{a['eplb_L'].mean():.3f}, min {a['eplb_L'].min():.3f}")
    return "\n".join(lines) + "\n"


def _heatmap(path: Path, data, row_labels, xlabel: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows, cols = data.shape
    fig, ax = plt.subplots(figsize=(max(5.0, 0.45 * cols + 2.5), max(2.5, 0.45 * rows + 1.5)))
    im = ax.imshow(data, aspect="auto", cmap="viridis", vmin=0)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("MoE layer")
    ax.set_yticks(range(rows), [str(r) for r in row_labels])
    step = max(1, cols // 32)
    ax.set_xticks(range(0, cols, step))
    if rows * cols <= 400:
        for i in range(rows):
            for j in range(cols):
                ax.text(j, i, f"{data[i, j]:.1f}", ha="center", va="center", fontsize=7,
                        color="white" if data[i, j] < 0.6 * data.max() else "black")
    fig.colorbar(im, ax=ax, label="load / layer mean")
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _balancedness_plot(path: Path, a: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    L = len(a["layer_ids"])
    x = torch.arange(L).double()
    series = [("now", a["now_L"]), (f"+{a['extra']} replicas of the hottest", a["replicated_L"])]
    if a["eplb_L"] is not None:
        series.append(("EPLB, same slots", a["eplb_L"]))
    width = 0.8 / len(series)
    fig, ax = plt.subplots(figsize=(max(5.0, 0.8 * L + 2), 3.5))
    for k, (label, values) in enumerate(series):
        ax.bar((x + (k - (len(series) - 1) / 2) * width).tolist(), values.tolist(), width, label=label)
    ax.set_xticks(range(L), [str(i) for i in a["layer_ids"]])
    ax.set_xlabel("MoE layer")
    ax.set_ylabel("balancedness (mean / max)")
    ax.set_ylim(0, 1.3)
    ax.set_yticks([0, 0.2, 0.4, 0.6, 0.8, 1.0])
    ax.legend(fontsize=8, loc="upper center", ncol=len(series), frameon=False)
    ax.set_title("expert balancedness per layer")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_report(dump: dict, out: str | Path, ep_size: int | None = None, extra: int | None = None) -> dict:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    a = analyse(dump, ep_size, extra)
    w, rank = a["weight_LE"], a["rank_LG"]
    rel_expert = w / w.mean(1, keepdim=True).clamp(min=1e-12)
    rel_rank = rank / rank.mean(1, keepdim=True).clamp(min=1e-12)
    steps = f"{dump.get('view', 'window')}, {dump.get('steps', '?')} steps"
    _heatmap(out / "layer_expert.png", rel_expert.numpy(), a["layer_ids"], "expert", f"expert load ({steps})")
    G = a["ep_size"]
    _heatmap(out / "layer_rank.png", rel_rank.numpy(), a["layer_ids"], "EP rank",
             f"load per EP rank, {G} rank{'s' if G > 1 else ''}{' (simulated)' if a['simulated'] else ''} ({steps})")
    _balancedness_plot(out / "balancedness.png", a)
    text = summary_text(dump, a)
    (out / "summary.txt").write_text(text)
    (out / "expert_load.json").write_text(json.dumps(dump))
    return {"summary": text, "files": sorted(p.name for p in out.iterdir())}


def main(args: argparse.Namespace) -> int:
    try:
        dump = load_dump(args.url, args.file, args.view, args.api_key)
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"could not read the expert load from {args.url or args.file}: {exc}") from None
    result = write_report(dump, args.out, args.ep_size, args.extra_replicas)
    print(result["summary"], end="")
    print(f"wrote {', '.join(result['files'])} to {args.out}")
    return 0
