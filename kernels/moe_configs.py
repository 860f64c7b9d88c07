"""Block sizes for the Triton MoE GEMMs: tuned JSON tables under kernels/configs/, else a default.

A table is one file per (E, N, K, device, dtype[, block shape]), named like vLLM's but with the hidden size:
  E=256,N=2048,K=7168,device_name=NVIDIA_H200,dtype=fp8_w8a8,block_shape=[128,128].json
with E experts, N the expert intermediate size I, K the hidden size H. It maps a token count M (as a
string) to {"BLOCK_SIZE_M", "BLOCK_SIZE_N", "BLOCK_SIZE_K", "GROUP_SIZE_M", "num_warps", "num_stages"};
the entry whose M is nearest the call's token count wins. scripts/tune_moe.py writes these files.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import torch

CONFIG_DIR = Path(__file__).parent / "configs"
CONFIG_KEYS = ("BLOCK_SIZE_M", "BLOCK_SIZE_N", "BLOCK_SIZE_K", "GROUP_SIZE_M", "num_warps", "num_stages")
DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def dtype_name(act_dtype: torch.dtype, fp8: bool) -> str:
    return "fp8_w8a8" if fp8 else DTYPE_NAMES[act_dtype]


def device_name(device: torch.device | None = None) -> str:
    if torch.cuda.is_available() and (device is None or device.type == "cuda"):
        return torch.cuda.get_device_name(device).replace(" ", "_")
    return "cpu"


def config_file_name(E: int, N: int, K: int, device: str, dtype: str, block_shape=None) -> str:
    block = f",block_shape=[{block_shape[0]},{block_shape[1]}]" if block_shape else ""
    return f"E={E},N={N},K={K},device_name={device},dtype={dtype}{block}.json"


def check_config(config: dict, fp8_block_k: int | None = None) -> dict:
    missing = [k for k in CONFIG_KEYS if k not in config]
    if missing:
        raise ValueError(f"MoE kernel config {config} lacks {missing}")
    if fp8_block_k is not None and fp8_block_k % config["BLOCK_SIZE_K"]:
        raise ValueError(
            f"BLOCK_SIZE_K {config['BLOCK_SIZE_K']} must divide the fp8 scale block {fp8_block_k} "
            "so each K step sees one activation and one weight scale"
        )
    return config


@functools.cache
def load_table(path: Path) -> dict[int, dict] | None:
    if not path.is_file():
        return None
    with open(path) as f:
        raw = json.load(f)
    return {int(m): check_config(cfg) for m, cfg in raw.items()}


def default_config(M: int, E: int, fp8_block_shape=None) -> dict:
    """vLLM's untuned defaults: small blocks while tokens are few per expert, larger ones after."""
    if fp8_block_shape is not None:
        bn, bk = fp8_block_shape
        return dict(BLOCK_SIZE_M=16 if M <= E else 64, BLOCK_SIZE_N=min(bn, 128), BLOCK_SIZE_K=min(bk, 128),
                    GROUP_SIZE_M=1 if M <= E else 32, num_warps=4, num_stages=3)
    if M <= E:
        return dict(BLOCK_SIZE_M=16, BLOCK_SIZE_N=32, BLOCK_SIZE_K=64, GROUP_SIZE_M=1, num_warps=4, num_stages=3)
    return dict(BLOCK_SIZE_M=64, BLOCK_SIZE_N=64, BLOCK_SIZE_K=32, GROUP_SIZE_M=8, num_warps=4, num_stages=3)


def get_config(M: int, E: int, N: int, K: int, dtype: str, block_shape=None, device: str | None = None,
               config_dir: Path = CONFIG_DIR) -> dict:
    """The tuned config for M tokens from the matching table, else default_config."""
    name = config_file_name(E, N, K, device or device_name(), dtype, block_shape)
    table = load_table(Path(config_dir) / name)
    if not table:
        return default_config(M, E, block_shape)
    return table[min(table, key=lambda m: abs(m - M))]
