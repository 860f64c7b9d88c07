"""Loads a Hugging Face DeepSeek checkpoint (sharded or single-file safetensors) into the model.

Handles the per-expert key layout (`...mlp.experts.{e}.{gate,up,down}_proj.weight` stacked into the
local slots that hold expert e; a MLP's gate_proj and up_proj into its merged gate_up_proj), FP8
block-quantised weights (`float8_e4m3fn` with a `weight_scale_inv` per block, kept as stored: the kernel
backend computes with them), and skips MTP layers. A tensor the model needs
that is missing, or one whose shape differs, is an error naming the tensor and the file.
"""

from __future__ import annotations

import functools
import json
import logging
import re
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import safe_open

from moe_serve.experts.weights import ExpertWeights
from moe_serve.kernels.reference import FP8_DTYPE
from moe_serve.moe.config import ModelConfig
from moe_serve.moe.parallel_linear import MergedColumnParallelLinear, shard_for

log = logging.getLogger(__name__)

_EXPERT_KEY = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight")
_LAYER_KEY = re.compile(r"model\.layers\.(\d+)\.")


def checkpoint_files(model_dir: Path) -> dict[str, str]:
    """Map of tensor name -> file name, from the index or the single `model.safetensors`."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        return dict(json.loads(index.read_text())["weight_map"])
    single = model_dir / "model.safetensors"
    if single.is_file():
        with safe_open(single, "pt") as f:
            return {name: single.name for name in f.keys()}
    raise ValueError(f"model {str(model_dir)!r} has no model.safetensors.index.json or model.safetensors")


class _ShardReader:
    """Opens each shard once, on demand, so a scale stored in another shard can be found."""

    def __init__(self, model_dir: Path, weight_map: dict[str, str]):
        self.model_dir, self.weight_map, self.handles = model_dir, weight_map, {}

    def get(self, name: str) -> torch.Tensor:
        file = self.weight_map[name]
        if file not in self.handles:
            self.handles[file] = safe_open(self.model_dir / file, "pt")
        return self.handles[file].get_tensor(name)


def load_checkpoint(model: torch.nn.Module, model_dir: str | Path, cfg: ModelConfig) -> None:
    """Copy every tensor this rank's part of `model` needs from the checkpoint, as stored (block-FP8 weights stay
    FP8, with their scales); errors name the tensor and file. Every needed tensor is looked up before any is
    read: a checkpoint that lacks one (an FP8 weight's `_scale_inv` included) fails at once."""
    model_dir = Path(model_dir)
    weight_map = checkpoint_files(model_dir)
    reader = _ShardReader(model_dir, weight_map)
    targets = _targets(model, cfg)
    missing = sorted(n for n in targets if n not in weight_map)
    if missing:
        raise ValueError(f"checkpoint {model_dir} is missing tensor {missing[0]}"
                         f"{_scale_hint(missing[0], weight_map)}; {len(missing)} missing in all")
    skipped_mtp = 0
    files = sorted(set(weight_map.values()))
    names_by_file: dict[str, list[str]] = {f: [] for f in files}
    for name, file in weight_map.items():
        names_by_file[file].append(name)
    for k, file in enumerate(files, 1):
        log.info("loading shard %d/%d (%s)", k, len(files), file)
        for name in sorted(names_by_file[file]):
            m = _LAYER_KEY.match(name)
            if m and int(m.group(1)) >= cfg.num_hidden_layers:
                skipped_mtp += 1  # multi-token-prediction layers are not used for serving
                continue
            if name not in targets:
                if not (_on_other_stage(model, name) or _EXPERT_KEY.match(name) or name.endswith("rotary_emb.inv_freq")):
                    log.warning("checkpoint tensor %s (%s) is not used by the model", name, file)
                continue
            tensor = reader.get(name)
            try:
                targets[name](tensor)
            except ValueError as exc:
                raise ValueError(f"tensor {name} in {file}: {exc}") from None
    if skipped_mtp:
        log.info("skipped %d tensors of %d MTP layer(s) (num_nextn_predict_layers)", skipped_mtp, cfg.num_nextn_predict_layers)
    model.after_loading()


def _scale_hint(name: str, weight_map: dict[str, str]) -> str:
    if name.endswith("_scale_inv") and name.removesuffix("_scale_inv") in weight_map:
        return (f" (the block scales of FP8 weight {name.removesuffix('_scale_inv')} in "
                f"{weight_map[name.removesuffix('_scale_inv')]})")
    return ""


def _targets(model: torch.nn.Module, cfg: ModelConfig) -> dict[str, Callable[[torch.Tensor], None]]:
    """Checkpoint tensor name -> what copies it into place, for every tensor this rank's part of the model
    holds: parameters by their own names, a merged gate/up projection by its parts' names, and routed
    experts by `...experts.{e}.{proj}.weight[_scale_inv]` for each expert this rank holds."""
    targets: dict[str, Callable[[torch.Tensor], None]] = {}
    for mod_name, module in model.named_modules():
        prefix, parent = (f"{mod_name}." if mod_name else ""), mod_name.rpartition(".")[0]
        if isinstance(module, ExpertWeights):
            suffixes = ("weight", "weight_scale_inv") if module.fp8_block else ("weight",)
            for e in sorted(set(module.slot_to_expert)):
                for proj in ("gate_proj", "up_proj", "down_proj"):
                    for suffix in suffixes:
                        targets[f"{mod_name}.{e}.{proj}.{suffix}"] = functools.partial(_load_expert, module, e, proj, suffix != "weight")
            continue
        for p_name, param in module.named_parameters(recurse=False):
            if isinstance(module, MergedColumnParallelLinear):
                for i, part in enumerate(module.part_names):
                    targets[f"{parent}.{part}.{p_name}"] = functools.partial(
                        _load_part, module, i, p_name == "weight_scale_inv")
            else:
                targets[prefix + p_name] = functools.partial(_copy_param, param)
    if cfg.tie_word_embeddings and model.model.is_first:
        targets.pop("lm_head.weight", None)  # the head is the embedding table
    return targets


def _load_part(merged: MergedColumnParallelLinear, part: int, scale: bool, tensor: torch.Tensor) -> None:
    if not scale:
        _check_fp8(merged.weight, tensor)
    merged.load_part(part, tensor, scale=scale)


def _load_expert(experts: ExpertWeights, expert: int, proj: str, scale: bool, tensor: torch.Tensor) -> None:
    if not scale:
        _check_fp8(experts.w2, tensor)
    for slot in experts.slots_of(expert):
        experts.load_projection(slot, proj, tensor, scale=scale)


def _check_fp8(param: torch.Tensor, tensor: torch.Tensor) -> None:
    """A block-FP8 model weight takes FP8 tensors only, and only it does: no silent (de)quantisation."""
    if (param.dtype == FP8_DTYPE) == (tensor.dtype == FP8_DTYPE):
        return
    if tensor.dtype == FP8_DTYPE:
        raise ValueError("is float8_e4m3fn but config.json has no quantization_config with a weight_block_size")
    raise ValueError(f"is {tensor.dtype}, but the model holds this weight in block FP8 (quantization_config)")


def _copy_param(param: torch.Tensor, tensor: torch.Tensor) -> None:
    _check_fp8(param, tensor)
    tensor = shard_for(param, tensor)
    if tuple(param.shape) != tuple(tensor.shape):
        raise ValueError(f"has shape {tuple(tensor.shape)}, the model expects {tuple(param.shape)}")
    with torch.no_grad():
        param.copy_(tensor)


def _on_other_stage(model, name: str) -> bool:
    """True for tensors that belong to layers (or embedding / head) of another pipeline stage."""
    m = _LAYER_KEY.match(name)
    if m:
        return not model.model.start <= int(m.group(1)) < model.model.end
    if name.startswith("model.embed_tokens."):
        return not model.model.is_first
    if name.startswith(("model.norm.", "lm_head.")):
        return not model.model.is_last
    return False
