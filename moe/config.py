"""Model arguments of a DeepSeek-V2/V3-family checkpoint, read from its config.json.

One flat, frozen dataclass. Field names follow config.json, so a reader of the checkpoint recognises
them; defaults follow each model type's published config where config.json leaves a field out.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

SUPPORTED_MODEL_TYPES = ("deepseek_v2", "deepseek_v3")
TOPK_METHODS = ("greedy", "group_limited_greedy", "noaux_tc")
SCORING_FUNCS = ("softmax", "sigmoid")

# Per model type: the router defaults of the reference implementations when config.json omits them.
_TYPE_DEFAULTS = {
    "deepseek_v2": {"topk_method": "greedy", "scoring_func": "softmax", "norm_topk_prob": False},
    "deepseek_v3": {"topk_method": "noaux_tc", "scoring_func": "sigmoid", "norm_topk_prob": True},
}


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's attention-temperature correction for a context stretched `scale` times."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    q_lora_rank: int | None = None
    moe_intermediate_size: int = 0
    n_routed_experts: int | None = None
    n_shared_experts: int | None = None
    num_experts_per_tok: int | None = None
    first_k_dense_replace: int = 0
    moe_layer_freq: int = 1
    n_group: int | None = None
    topk_group: int | None = None
    topk_method: str = "greedy"
    scoring_func: str = "softmax"
    norm_topk_prob: bool = False
    routed_scaling_factor: float = 1.0
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    rope_interleave: bool = True
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    hidden_act: str = "silu"
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    num_nextn_predict_layers: int = 0
    torch_dtype: str | None = None
    quant_block_shape: tuple[int, int] | None = None  # FP8 block quantisation of the checkpoint

    def __post_init__(self) -> None:
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"model_type {self.model_type!r} is not supported; expected one of {SUPPORTED_MODEL_TYPES}")
        if self.attention_bias:
            raise ValueError("attention_bias true is not supported (DeepSeek-V2/V3 checkpoints have none)")
        if self.hidden_act != "silu":
            raise ValueError(f"hidden_act {self.hidden_act!r} is not supported; only 'silu'")
        if self.topk_method not in TOPK_METHODS:
            raise ValueError(f"topk_method {self.topk_method!r} is not supported; expected one of {TOPK_METHODS}")
        if self.scoring_func not in SCORING_FUNCS:
            raise ValueError(f"scoring_func {self.scoring_func!r} is not supported; expected one of {SCORING_FUNCS}")
        if self.n_routed_experts:
            if not self.num_experts_per_tok or self.num_experts_per_tok > self.n_routed_experts:
                raise ValueError(f"num_experts_per_tok {self.num_experts_per_tok} must be in [1, {self.n_routed_experts}]")
            if self.topk_method != "greedy":
                groups = self.n_group or 1
                if self.n_routed_experts % groups:
                    raise ValueError(f"n_group {groups} does not divide {self.n_routed_experts} experts")
                if not 1 <= (self.topk_group or 1) <= groups:
                    raise ValueError(f"topk_group {self.topk_group} must be in [1, n_group={groups}]")
        if self.rope_scaling is not None and self.rope_type not in ("default", "yarn"):
            raise ValueError(f"rope_scaling type {self.rope_type!r} is not supported; expected 'yarn'")

    # ---- derived quantities -------------------------------------------------------------------
    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def kv_cache_dim(self) -> int:
        """Values cached per token per layer: the compressed latent plus the shared rope key."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def rope_type(self) -> str:
        if not self.rope_scaling:
            return "default"
        return self.rope_scaling.get("rope_type", self.rope_scaling.get("type", "default"))

    @property
    def softmax_scale(self) -> float:
        scale = self.qk_head_dim**-0.5
        if self.rope_type == "yarn":
            mscale_all_dim = self.rope_scaling.get("mscale_all_dim", 0)
            if mscale_all_dim:
                m = yarn_mscale(self.rope_scaling["factor"], mscale_all_dim)
                scale = scale * m * m
        return scale

    @property
    def eos_token_ids(self) -> list[int]:
        if self.eos_token_id is None:
            return []
        return list(self.eos_token_id) if isinstance(self.eos_token_id, (list, tuple)) else [self.eos_token_id]

    def is_moe_layer(self, layer_idx: int) -> bool:
        return bool(self.n_routed_experts) and layer_idx >= self.first_k_dense_replace and layer_idx % self.moe_layer_freq == 0

    # ---- construction ---------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "ModelConfig":
        model_type = raw.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"model_type {model_type!r} is not supported; expected one of {SUPPORTED_MODEL_TYPES}")
        known = {f.name for f in fields(cls)}
        values = {**_TYPE_DEFAULTS[model_type], **{k: v for k, v in raw.items() if k in known}}
        for key in ("topk_method", "scoring_func"):
            if values.get(key) is None:
                values[key] = _TYPE_DEFAULTS[model_type][key]
        if model_type == "deepseek_v2":
            values["rope_interleave"] = True  # DeepSeek-V2 always rotates interleaved (complex) pairs
        rope = raw.get("rope_parameters")
        if rope and "rope_theta" not in raw:  # as transformers 5 saves it: theta and scaling in one dict
            values["rope_theta"] = rope.get("rope_theta", values.get("rope_theta", 10000.0))
            scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
            values["rope_scaling"] = None if scaling.get("rope_type", "default") == "default" else scaling
        if "torch_dtype" not in raw and "dtype" in raw:
            values["torch_dtype"] = raw["dtype"]
        quant = raw.get("quantization_config")
        if quant:
            if quant.get("quant_method") != "fp8":
                raise ValueError(f"quantization_config.quant_method {quant.get('quant_method')!r} is not supported; only 'fp8'")
            values["quant_block_shape"] = tuple(quant.get("weight_block_size") or (128, 128))
        values["num_nextn_predict_layers"] = raw.get("num_nextn_predict_layers") or 0
        return cls(**values)

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> "ModelConfig":
        path = Path(model_dir)
        config_file = path / "config.json"
        if not path.is_dir() or not config_file.is_file():
            raise ValueError(f"model {str(model_dir)!r} is not a checkpoint directory: no config.json in it")
        try:
            raw = json.loads(config_file.read_text())
        except json.JSONDecodeError as exc:
            raise ValueError(f"model {str(model_dir)!r}: config.json is not valid JSON ({exc})") from None
        return cls.from_dict(raw)
