"""Loads a Hugging Face DeepSeek checkpoint (sharded or single-file safetensors) into the model.

Handles the per-expert key layout (`...mlp.experts.{e}.{gate,up,down}_proj.weight` stacked into the
local slots that hold expert e), FP8 block-quantised weights (`float8_e4m3fn` with a
`weight_scale_inv` per block, dequantised on CPU), and skips MTP layers. A tensor the model needs
that is missing, or one whose shape differs, is an error naming the tensor and the file.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import torch
from safetensors import safe_open

from moe_serve.moe.config import ModelConfig
from moe_serve.moe.fp8_block import dequantize_fp8_block
from moe_serve.moe.parallel_linear import shard_for

log = logging.getLogger(__name__)

_EXPERT_KEY = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
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


def load_checkpoint(model: torch.nn.Module, model_dir: str | Path, cfg: ModelConfig,
                    weight_dtype: torch.dtype | None = None) -> None:
    """Copy every tensor this rank's part of `model` needs from the checkpoint; errors name the tensor and
    file. weight_dtype: round each weight to this dtype first (the model may hold it in a wider one)."""
    model_dir = Path(model_dir)
    weight_map = checkpoint_files(model_dir)
    reader = _ShardReader(model_dir, weight_map)
    params = dict(model.named_parameters(remove_duplicate=False))
    expected = {n for n in params if ".mlp.experts." not in n}
    if cfg.tie_word_embeddings and model.model.is_first:
        expected.discard("lm_head.weight")
    for i, layer in enumerate(model.model.layers):
        experts = getattr(getattr(layer, "mlp", None), "experts", None)
        if experts is not None:
            expected |= {f"model.layers.{i}.mlp.experts.{e}.{p}.weight" for e in set(experts.slot_to_expert)
                         for p in ("gate_proj", "up_proj", "down_proj")}
    loaded: set[str] = set()
    skipped_mtp = 0
    files = sorted(set(weight_map.values()))
    names_by_file: dict[str, list[str]] = {f: [] for f in files}
    for name, file in weight_map.items():
        names_by_file[file].append(name)
    for k, file in enumerate(files, 1):
        log.info("loading shard %d/%d (%s)", k, len(files), file)
        for name in sorted(names_by_file[file]):
            if name.endswith("_scale_inv"):
                continue
            m = _LAYER_KEY.match(name)
            if m and int(m.group(1)) >= cfg.num_hidden_layers:
                skipped_mtp += 1  # multi-token-prediction layers are not used for serving
                continue
            if _on_other_stage(model, name) or _on_other_ep_rank(name, expected):
                continue
            if name not in expected:
                if name.endswith("rotary_emb.inv_freq"):
                    continue
                log.warning("checkpoint tensor %s (%s) is not used by the model", name, file)
                continue
            tensor = reader.get(name)
            if tensor.dtype == torch.float8_e4m3fn:
                scale_name = name + "_scale_inv"
                if scale_name not in weight_map:
                    raise ValueError(f"FP8 tensor {name} in {file} has no {scale_name} in the checkpoint")
                tensor = dequantize_fp8_block(tensor, reader.get(scale_name), cfg.quant_block_shape or (128, 128))
            if weight_dtype is not None:
                tensor = tensor.to(weight_dtype)
            _copy_into(model, params, name, tensor, file)
            loaded.add(name)
    if skipped_mtp:
        log.info("skipped %d tensors of %d MTP layer(s) (num_nextn_predict_layers)", skipped_mtp, cfg.num_nextn_predict_layers)
    missing = sorted(expected - loaded)
    if missing:
        where = weight_map.get(missing[0], f"any file of {model_dir}")
        raise ValueError(f"checkpoint is missing tensor {missing[0]} (expected in {where}); {len(missing)} missing in all")
    model.after_loading()


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


def _on_other_ep_rank(name: str, expected: set[str]) -> bool:
    """True for routed-expert tensors of experts that another expert-parallel rank holds."""
    return _EXPERT_KEY.match(name) is not None and name not in expected


def _copy_into(model, params: dict, name: str, tensor: torch.Tensor, file: str) -> None:
    m = _EXPERT_KEY.match(name)
    if m:
        experts = model.model.layers[int(m.group(1))].mlp.experts
        for slot in experts.slots_of(int(m.group(2))):
            try:
                experts.load_projection(slot, m.group(3), tensor)
            except ValueError as exc:
                raise ValueError(f"tensor {name} in {file}: {exc}") from None
        return
    param = params[name]
    try:
        tensor = shard_for(param, tensor)
    except ValueError as exc:
        raise ValueError(f"tensor {name} in {file}: {exc}") from None
    if tuple(param.shape) != tuple(tensor.shape):
        raise ValueError(f"tensor {name} in {file} has shape {tuple(tensor.shape)}, the model expects {tuple(param.shape)}")
    with torch.no_grad():
        param.copy_(tensor)
