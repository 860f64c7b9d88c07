"""Resident weight bytes against checkpoint bytes: does the engine hold a checkpoint as stored? Not a test.

    .venv/bin/python scripts/weight_bytes.py .cache/bench-fp8   # moe make-checkpoint --preset bench --fp8 --out ...

Loads the checkpoint into the engine (`--dtype`, default bfloat16) and prints the sum of the model's
parameters against the sum of the checkpoint's tensors, and that ratio again with MLA's absorbed per-head W_UK
copies (the one weight the decode path holds twice). An FP8 checkpoint served as shipped is ~1.0; one
dequantised at load is ~2 (bf16) or ~4 (float32).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from safetensors import safe_open

from moe_serve.server import LLM


def checkpoint_bytes(ckpt: Path) -> int:
    total = 0
    for shard in sorted(ckpt.glob("*.safetensors")):
        with safe_open(shard, "pt") as f:
            total += sum(f.get_tensor(k).nbytes for k in f.keys())
    return total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--dtype", default="bfloat16")
    args = ap.parse_args()
    ckpt = Path(args.model)
    stored = checkpoint_bytes(ckpt)
    model = LLM(str(ckpt), dtype=args.dtype, kv_cache_tokens=1024).engine.runner.model
    held = sum(p.numel() * p.element_size() for p in model.parameters())
    absorbed = sum(t.numel() * t.element_size() for layer in model.model.layers
                   for t in (getattr(layer.self_attn, "w_uk_NCD", None), getattr(layer.self_attn, "w_uk_scale", None))
                   if t is not None)
    print(f"{ckpt}: checkpoint {stored / 2**20:.1f} MiB, resident parameters {held / 2**20:.1f} MiB "
          f"(ratio {held / stored:.3f}); with the absorbed W_UK copies {(held + absorbed) / 2**20:.1f} MiB "
          f"(ratio {(held + absorbed) / stored:.3f})")


if __name__ == "__main__":
    main()
