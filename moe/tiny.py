"""Tiny random DeepSeek-V2/V3 checkpoints in the real Hugging Face layout, for tests and benchmarks.

`make_checkpoint(out_dir, "v3")` writes config.json, sharded safetensors with
`model.safetensors.index.json`, generation_config.json and a small byte-level BPE tokenizer. Key names
are transformers' (= DeepSeek's): `model.layers.{i}.mlp.experts.{e}.gate_proj.weight`, ...
Options add DeepSeek-V3's block-wise FP8 weights (`fp8=True`) and an MTP layer stored as
`model.layers.{num_hidden_layers}.*` (`mtp=True`). `load_reference_model` loads any of them into the
transformers model, the reference for parity tests.

Weights are drawn so that greedy decisions are decisive (large top-1/top-2 logit gaps, router
logits spread over the sigmoid's steep range) and every sublayer moves the residual stream.
"""

from __future__ import annotations

import copy
import json
import logging
import math
import re
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig, PretrainedConfig, PreTrainedModel

from moe_serve.moe.fp8_block import dequantize_fp8_block, quantize_fp8_block
from moe_serve.moe.tiny_tokenizer import build_tokenizer

__all__ = [
    "PRESETS", "make_checkpoint", "ensure_checkpoint", "load_reference_model", "dequantize_fp8_block",
    "quantize_fp8_block",
]

log = logging.getLogger(__name__)

_YARN = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128, "beta_fast": 32,
         "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}
_V3_TINY = dict(
    model_type="deepseek_v3", torch_dtype="float32", hidden_size=64, num_hidden_layers=4,
    first_k_dense_replace=1, intermediate_size=128, moe_intermediate_size=32, n_routed_experts=12,
    n_group=4, topk_group=2, num_experts_per_tok=4, n_shared_experts=1, num_attention_heads=4,
    num_key_value_heads=4, q_lora_rank=48, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
    v_head_dim=16, topk_method="noaux_tc", scoring_func="sigmoid", norm_topk_prob=True,
    routed_scaling_factor=2.5, rope_scaling=_YARN, max_position_embeddings=512, rope_theta=10000.0,
    rope_interleave=True, tie_word_embeddings=False, rms_norm_eps=1e-6, hidden_act="silu",
)
_V2_TINY = dict(
    model_type="deepseek_v2", torch_dtype="float32", hidden_size=64, num_hidden_layers=3,
    first_k_dense_replace=1, intermediate_size=128, moe_intermediate_size=32, n_routed_experts=10,
    n_group=1, topk_group=1, num_experts_per_tok=3, n_shared_experts=2, num_attention_heads=4,
    num_key_value_heads=4, q_lora_rank=None, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
    v_head_dim=16, topk_method="greedy", scoring_func="softmax", norm_topk_prob=False,
    routed_scaling_factor=1.0, rope_scaling=None, max_position_embeddings=512, rope_theta=10000.0,
    tie_word_embeddings=False, rms_norm_eps=1e-6, hidden_act="silu",
)
PRESETS: dict[str, dict] = {
    "v3": _V3_TINY,
    "v2": _V2_TINY,
    "v2-group": {**_V2_TINY, "topk_method": "group_limited_greedy", "n_group": 4, "topk_group": 2,
                 "n_routed_experts": 16, "num_experts_per_tok": 4, "q_lora_rank": 48,
                 "routed_scaling_factor": 2.0},
    "bench": {**_V3_TINY, "torch_dtype": "bfloat16", "hidden_size": 512, "num_hidden_layers": 6,
              "intermediate_size": 1024, "moe_intermediate_size": 256, "n_routed_experts": 32,
              "num_experts_per_tok": 4, "n_group": 4, "topk_group": 2, "num_attention_heads": 8,
              "num_key_value_heads": 8, "q_lora_rank": 384, "kv_lora_rank": 512, "qk_nope_head_dim": 128,
              "qk_rope_head_dim": 64, "v_head_dim": 128, "max_position_embeddings": 8192,
              "rope_scaling": {**_YARN, "original_max_position_embeddings": 2048}},
}

# Init scales (see the module docstring). Inputs to every linear are RMS-normalised or O(1).
EMBED_STD = 1.0
LOGIT_STD = 8.0  # std of lm_head logits for a unit-RMS final hidden state
ROUTER_LOGIT_STD = 2.0  # std of router logits; sigmoid/softmax stay out of saturation
SCORE_BIAS_RANGE = 0.15  # e_score_correction_bias ~ U(-r, r): flips some top-k choices, not most
NORM_WEIGHT_RANGE = (0.8, 1.2)
FP8_BLOCK = (128, 128)  # DeepSeek-V3's; smaller models get the largest square block that fits (fp8_block_for)
_FP8_KEY = re.compile(r"model\.layers\.\d+\.(self_attn|mlp)\..*\.weight$")
_ROUTER_KEY = re.compile(r"\.mlp\.gate\.weight$")


def _init_tensors_(sd: dict[str, torch.Tensor], hidden: int, seed: int) -> None:
    """Fill every float tensor of a state dict in place, in key order, from one seeded generator."""
    gen = torch.Generator().manual_seed(seed)
    for name, t in sd.items():
        if name.endswith("e_score_correction_bias"):
            t.copy_((torch.rand(t.shape, generator=gen) * 2 - 1) * SCORE_BIAS_RANGE)
        elif t.dim() == 1:  # RMSNorm weights
            lo, hi = NORM_WEIGHT_RANGE
            t.copy_(lo + (hi - lo) * torch.rand(t.shape, generator=gen))
        elif name.endswith("embed_tokens.weight"):
            t.copy_(torch.randn(t.shape, generator=gen) * EMBED_STD)
        elif name.endswith(("lm_head.weight", "shared_head.head.weight")):
            t.copy_(torch.randn(t.shape, generator=gen) * (LOGIT_STD / math.sqrt(hidden)))
        elif _ROUTER_KEY.search(name):
            t.copy_(torch.randn(t.shape, generator=gen) * (ROUTER_LOGIT_STD / math.sqrt(hidden)))
        else:  # projections: unit gain over fan-in
            t.copy_(torch.randn(t.shape, generator=gen) / math.sqrt(t.shape[1]))


def _build_config(preset: str, dtype: str, mtp: bool, overrides: dict | None, tok):
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of {sorted(PRESETS)}")
    d = copy.deepcopy(PRESETS[preset])
    d.update(copy.deepcopy(overrides or {}))
    d.update(vocab_size=len(tok), bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
             pad_token_id=tok.pad_token_id, num_nextn_predict_layers=1 if mtp else 0)
    d.pop("torch_dtype")
    model_type = d.pop("model_type")
    arch = {"deepseek_v3": "DeepseekV3ForCausalLM", "deepseek_v2": "DeepseekV2ForCausalLM"}[model_type]
    return AutoConfig.for_model(model_type, architectures=[arch], dtype=dtype, **d)


_FUSED_EXPERTS = re.compile(r"((?:.*\.)?mlp\.experts)\.(gate_up_proj|down_proj)$")


def shipped_layout(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """State dict keys as DeepSeek's checkpoints name them: one gate/up/down weight per routed expert.

    transformers 5 holds a layer's routed experts as two stacked tensors, `experts.gate_up_proj` [E, 2I, H] (gate
    rows first) and `experts.down_proj` [E, H, I]; 4.x already uses the per-expert names. Order is kept: each
    layer's experts appear where its stacked tensors were, expert by expert (gate, up, down)."""
    out: dict[str, torch.Tensor] = {}
    for name, t in sd.items():
        m = _FUSED_EXPERTS.match(name)
        if not m:
            out[name] = t
        elif m.group(2) == "gate_up_proj":
            prefix, inter = m.group(1), t.shape[1] // 2
            down = sd[f"{prefix}.down_proj"]
            for e in range(t.shape[0]):
                out[f"{prefix}.{e}.gate_proj.weight"] = t[e, :inter]
                out[f"{prefix}.{e}.up_proj.weight"] = t[e, inter:]
                out[f"{prefix}.{e}.down_proj.weight"] = down[e]
    return out


def _model_layout(stored: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The inverse of `shipped_layout` for the keys a transformers model wants (stacks per-expert weights)."""
    out = dict(stored)
    for name in want:
        m = _FUSED_EXPERTS.match(name)
        if not m or name in stored:
            continue
        prefix, which, num_experts = m.group(1), m.group(2), want[name].shape[0]
        parts = ("gate_proj", "up_proj") if which == "gate_up_proj" else ("down_proj",)
        keys = [[f"{prefix}.{e}.{part}.weight" for part in parts] for e in range(num_experts)]
        if all(k in stored for row in keys for k in row):
            out[name] = torch.stack([torch.cat([stored[k] for k in row]) for row in keys])
            for row in keys:
                for k in row:
                    out.pop(k)
    return out


def _mtp_tensors(model: PreTrainedModel, sd: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    """DeepSeek-V3's next-token-prediction layer, stored as layer `num_hidden_layers`."""
    cfg = model.config
    n, hidden = cfg.num_hidden_layers, cfg.hidden_size
    layer = type(model.model.layers[-1])(cfg, layer_idx=n)
    extra = {
        "embed_tokens.weight": torch.empty(cfg.vocab_size, hidden),
        "enorm.weight": torch.empty(hidden),
        "hnorm.weight": torch.empty(hidden),
        "eh_proj.weight": torch.empty(hidden, 2 * hidden),
        **{k: v.detach().clone().float() for k, v in shipped_layout(layer.state_dict()).items()},
        "shared_head.norm.weight": torch.empty(hidden),
        "shared_head.head.weight": torch.empty(cfg.vocab_size, hidden),
    }
    _init_tensors_(extra, hidden, seed + 1)
    extra["embed_tokens.weight"] = sd["model.embed_tokens.weight"].clone()  # shared with the main model
    extra["shared_head.head.weight"] = sd["lm_head.weight"].clone()
    return {f"model.layers.{n}.{k}": v for k, v in extra.items()}


def fp8_block_for(config: PretrainedConfig) -> tuple[int, int]:
    """DeepSeek-V3's 128 x 128 blocks, or for a model too small for them the largest square block of 64, 32 or
    16 that splits every head (qk_nope / v dims) and every expert's and MLP's intermediate size into whole
    blocks, also over two tensor-parallel ranks (the serving side needs whole blocks there)."""
    dims = [config.qk_nope_head_dim, config.v_head_dim, config.moe_intermediate_size // 2, config.intermediate_size // 2]
    for b in (128, 64, 32, 16):
        if all(d % b == 0 for d in dims):
            return (b, b)
    raise ValueError(f"no FP8 block of 16 or more divides {dims} (qk_nope, v, half of the intermediate sizes)")


def _to_storage(sd: dict[str, torch.Tensor], dtype: torch.dtype, fp8: tuple[int, int] | None) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for name, t in sd.items():
        if name.endswith("e_score_correction_bias"):
            out[name] = t.float().contiguous()  # float32 in the real V3 checkpoint too
        elif fp8 and t.dim() == 2 and _FP8_KEY.match(name) and not _ROUTER_KEY.search(name):
            out[name], out[name + "_scale_inv"] = quantize_fp8_block(t, fp8)
        else:
            out[name] = t.to(dtype).contiguous()
    return out


def _write_shards(tensors: dict[str, torch.Tensor], out: Path, num_shards: int) -> list[str]:
    if num_shards < 1 or num_shards > len(tensors):
        raise ValueError(f"num_shards {num_shards} must be in [1, {len(tensors)}] (the tensor count)")
    if num_shards == 1:
        save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
        return ["model.safetensors"]
    names = list(tensors)
    nbytes = [tensors[k].numel() * tensors[k].element_size() for k in names]
    total, start, shard_of = sum(nbytes), 0, []
    for b in nbytes:  # cut by byte offset, so shards hold contiguous runs of layers
        shard_of.append(min(num_shards - 1, start * num_shards // total))
        start += b
    if len(set(shard_of)) < num_shards:  # a huge tensor swallowed a shard: cut by count instead
        shard_of = [i * num_shards // len(names) for i in range(len(names))]
    files = [f"model-{i + 1:05d}-of-{num_shards:05d}.safetensors" for i in range(num_shards)]
    weight_map = {k: files[s] for k, s in zip(names, shard_of)}
    for i, fname in enumerate(files):
        save_file({k: tensors[k] for k, s in zip(names, shard_of) if s == i}, out / fname, metadata={"format": "pt"})
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return files


ROPE_KEYS = ("rope_theta", "rope_scaling", "rope_parameters")


def _shipped_rope(config: PretrainedConfig, explicit: dict) -> dict:
    """The rotary settings as DeepSeek's config.json files carry them (`rope_theta`, `rope_scaling`), whichever
    layout this transformers keeps in memory (5.x folds both into `rope_parameters`)."""
    params = getattr(config, "rope_parameters", None)
    if params is None:  # transformers 4.x
        return {"rope_theta": config.rope_theta, "rope_scaling": config.rope_scaling}
    scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    if scaling.get("rope_type", "default") == "default":
        scaling = None
    elif "type" in (explicit.get("rope_scaling") or {}) and "rope_type" in scaling and "type" in scaling:
        scaling.pop("rope_type")  # keep the key the preset wrote
    return {"rope_theta": params.get("rope_theta", explicit.get("rope_theta", 10000.0)), "rope_scaling": scaling}


def make_checkpoint(out_dir, preset: str = "v3", *, dtype: str | None = None, seed: int = 0,
                    fp8: bool = False, mtp: bool = False, num_shards: int = 2,
                    overrides: dict | None = None) -> Path:
    """Write a random checkpoint of `preset` to `out_dir`; returns the directory.

    dtype: "float32" | "bfloat16" for non-FP8 tensors (None: the preset's, float32 except "bench").
    The same (preset, seed, overrides) gives the same main weights whatever fp8/mtp/num_shards are.
    """
    out = Path(out_dir)
    dtype = dtype or PRESETS.get(preset, {}).get("torch_dtype", "float32")
    if dtype not in ("float32", "bfloat16"):
        raise ValueError(f"dtype {dtype!r} not supported; use 'float32' or 'bfloat16'")
    tok = build_tokenizer()
    config = _build_config(preset, dtype, mtp, overrides, tok)
    log.info("building %s preset=%s fp8=%s mtp=%s dtype=%s in %s", config.model_type, preset, fp8, mtp, dtype, out)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    sd = {k: v.detach().clone().float() for k, v in shipped_layout(model.state_dict()).items()}
    _init_tensors_(sd, config.hidden_size, seed)
    lm_head = sd["lm_head.weight"]
    for tid in tok.all_special_ids:  # never generate bos/pad/role tokens; eos stays reachable
        if tid != tok.eos_token_id:
            lm_head[tid] *= 0.01
    if mtp:
        sd.update(_mtp_tensors(model, sd, seed))
    return write_checkpoint(out, config, sd, tok, dtype, fp8=fp8, num_shards=num_shards,
                            explicit={**PRESETS[preset], **(overrides or {})})


def write_checkpoint(out_dir, config: PretrainedConfig, sd: dict[str, torch.Tensor], tok, dtype: str, *,
                     fp8: bool = False, num_shards: int = 1, explicit: dict | None = None) -> Path:
    """Write `sd` (DeepSeek's key layout, see `shipped_layout`) as a Hugging Face checkpoint in DeepSeek's own
    format: safetensors shards with an index, config.json as DeepSeek ships it (every key in `explicit`
    written even where it equals the default), generation_config.json and the tokenizer files."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    block = fp8_block_for(config) if fp8 else None
    tensors = _to_storage(sd, getattr(torch, dtype), block)
    for stale in out.glob("model*.safetensors*"):  # shards of an earlier call would confuse loaders
        stale.unlink()
    files = _write_shards(tensors, out, num_shards)

    cfg = config.to_diff_dict()
    explicit = explicit or {}
    cfg.update({k: getattr(config, k) for k in explicit if k not in ROPE_KEYS + ("torch_dtype",)})  # even default
    cfg.update(_shipped_rope(config, explicit))
    for derived in ("head_dim", "qk_head_dim", "rope_parameters"):  # transformers adds these; DeepSeek's configs don't have them
        cfg.pop(derived, None)
    cfg.pop("dtype", None)  # transformers 5 writes `dtype`; DeepSeek's files say `torch_dtype`
    cfg["torch_dtype"] = dtype
    if fp8:
        cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                      "weight_block_size": list(block)}
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    GenerationConfig(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                     pad_token_id=tok.pad_token_id, do_sample=False).save_pretrained(out)
    tok.save_pretrained(out, save_jinja_files=False)
    log.info("wrote %d tensors in %d shard(s) to %s", len(tensors), len(files), out)
    return out


def ensure_checkpoint(out_dir, preset: str = "v3", **kw) -> Path:
    """make_checkpoint unless `out_dir/config.json` already exists."""
    out = Path(out_dir)
    if (out / "config.json").exists():
        return out
    return make_checkpoint(out, preset, **kw)


def _read_checkpoint(ckpt: Path) -> dict[str, torch.Tensor]:
    index = ckpt / "model.safetensors.index.json"
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists() else [
        "model.safetensors"]
    tensors: dict[str, torch.Tensor] = {}
    for fname in files:
        with safe_open(str(ckpt / fname), framework="pt") as f:
            tensors.update({k: f.get_tensor(k) for k in f.keys()})
    return tensors


def load_reference_model(ckpt_dir, dtype: torch.dtype = torch.float32,
                         attn_implementation: str = "eager") -> PreTrainedModel:
    """The transformers model with the checkpoint's weights (FP8 ones dequantized), in eval mode.

    quantization_config is dropped so transformers does not apply its own FP8 path; MTP layers
    (`model.layers.{n >= num_hidden_layers}`) are skipped; every model tensor must be present.
    """
    ckpt = Path(ckpt_dir)
    cfg = json.loads((ckpt / "config.json").read_text())
    quant = cfg.pop("quantization_config", None)
    block = tuple(quant["weight_block_size"]) if quant else FP8_BLOCK
    cfg.pop("torch_dtype", None)
    cfg["dtype"] = str(dtype).removeprefix("torch.")
    config = AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attn_implementation)
    want = model.state_dict()
    stored = _read_checkpoint(ckpt)
    plain = {name: dequantize_fp8_block(t, stored[name + "_scale_inv"], block) if t.dtype == torch.float8_e4m3fn
             else t for name, t in stored.items() if not name.endswith("_scale_inv")}
    mtp_key = re.compile(r"model\.layers\.(\d+)\.")
    sd, unknown = {}, []
    for name, t in _model_layout(plain, want).items():
        if name in want:
            if t.shape != want[name].shape:
                raise ValueError(f"{name}: checkpoint shape {tuple(t.shape)} != model {tuple(want[name].shape)}")
            sd[name] = t.to(want[name].dtype)
        else:
            m = mtp_key.match(name)
            if not (m and int(m.group(1)) >= config.num_hidden_layers):
                unknown.append(name)
    missing = sorted(set(want) - set(sd))
    if missing or unknown:
        raise ValueError(f"checkpoint {ckpt} does not match the {config.model_type} model: "
                         f"missing {missing[:8]} ({len(missing)}), unexpected {unknown[:8]} ({len(unknown)})")
    model.load_state_dict(sd, strict=True)
    if (ckpt / "generation_config.json").exists():
        model.generation_config = GenerationConfig.from_pretrained(ckpt)
    return model.eval()
