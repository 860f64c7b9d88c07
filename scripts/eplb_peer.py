"""DeepSeek's EPLB as the balancer benchmarks' baseline, imported from where it is installed, never copied here.

Two sources, tried in this order:
- `--eplb PATH`: a checkout of github.com/deepseek-ai/EPLB (the folder holding its `eplb.py`);
- vLLM's package, which ships DeepSeek's policy as `vllm.distributed.eplb.policy.default.DefaultEplbPolicy`:
  from this interpreter when vLLM is installed in it, else from the site-packages of the vLLM CPU
  virtual environment that `scripts/bench_peer.py` builds (`--vllm-venv`, default .cache/vllm-venv). That
  module needs only torch and numpy, so its two files are loaded as a package of their own.

Both expose DeepSeek's entry point `rebalance_experts(weight, num_replicas, num_groups, num_nodes, num_gpus)`,
which runs the hierarchical policy when `num_groups % num_nodes == 0`; calling it with one group on one node
runs the global policy (DeepSeek's own fallback does exactly that).
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

REPO = Path(__file__).resolve().parents[1]
DEFAULT_VLLM_VENV = REPO / ".cache" / "vllm-venv"
_VLLM_POLICY = Path("vllm", "distributed", "eplb", "policy")


@dataclass(frozen=True)
class Eplb:
    source: str  # what was imported, from where (printed with every result)
    _entry: Callable  # (weight, num_replicas, num_groups, num_nodes, num_gpus) -> phy2log or a tuple starting with it

    def plan(self, weight_LE: torch.Tensor, num_replicas: int, num_groups: int, num_nodes: int, num_gpus: int,
             policy: str) -> torch.Tensor:
        """phy2log [L, R] of EPLB's `policy` ("hierarchical" or "global")."""
        if policy == "global":
            num_groups, num_nodes = 1, 1
        elif policy != "hierarchical":
            raise ValueError(f"policy {policy!r}: expected 'hierarchical' or 'global'")
        out = self._entry(weight_LE, num_replicas, num_groups, num_nodes, num_gpus)
        phy2log = out[0] if isinstance(out, tuple) else out
        return torch.as_tensor(phy2log, dtype=torch.int64)


def _from_checkout(path: Path) -> Eplb:
    file = path / "eplb.py" if path.is_dir() else path
    if not file.is_file():
        raise SystemExit(f"--eplb {path}: no eplb.py there (give the folder of a checkout of deepseek-ai/EPLB)")
    spec = importlib.util.spec_from_file_location("deepseek_eplb", file)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return Eplb(f"DeepSeek EPLB from {file}", module.rebalance_experts)


def _vllm_policy_dir(venv: Path) -> Path | None:
    for site in sorted(venv.glob("lib/python3*/site-packages")):
        if (site / _VLLM_POLICY / "default.py").is_file():
            return site / _VLLM_POLICY
    return None


def _from_vllm(venv: Path) -> Eplb | None:
    try:  # vLLM installed in this interpreter
        module = importlib.import_module("vllm.distributed.eplb.policy.default")
        version = importlib.import_module("vllm").__version__
        return Eplb(f"vLLM {version} (this interpreter): {module.__file__}", module.DefaultEplbPolicy.rebalance_experts)
    except ImportError:
        pass
    policy_dir = _vllm_policy_dir(venv)
    if policy_dir is None:
        return None
    # The policy module imports only torch, numpy and its sibling `abstract`: load both as a package of their own.
    name = "vllm_eplb_policy"
    package = types.ModuleType(name)
    package.__path__ = [str(policy_dir)]
    sys.modules[name] = package
    module = importlib.import_module(f"{name}.default")
    dist = sorted(policy_dir.parents[3].glob("vllm*.dist-info"))
    version = dist[0].name.removesuffix(".dist-info") if dist else "vllm (version unknown)"
    return Eplb(f"{version}: {policy_dir / 'default.py'}", module.DefaultEplbPolicy.rebalance_experts)


def load_eplb(path: str | None = None, vllm_venv: str | Path | None = None) -> Eplb:
    """EPLB from `path` (a checkout) if given, else from vLLM's package; exits with a one-line hint if neither."""
    if path:
        return _from_checkout(Path(path))
    venv = Path(vllm_venv) if vllm_venv else DEFAULT_VLLM_VENV
    found = _from_vllm(venv)
    if found is None:
        raise SystemExit(f"no EPLB to compare against: vLLM is not installed here nor in {venv}. Build that venv with "
                         "`.venv/bin/python scripts/bench_peer.py --engines vllm --num-prompts 1` (or pass "
                         "--vllm-venv), or pass --eplb PATH to a checkout of deepseek-ai/EPLB")
    return found
