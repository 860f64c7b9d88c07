"""Write a tiny random DeepSeek-V2/V3 checkpoint in Hugging Face format.

    python scripts/make_checkpoint.py --out /tmp/tiny-v3 --preset v3
    python scripts/make_checkpoint.py --out /tmp/bench --preset bench --fp8 --mtp --shards 4
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from moe_serve.moe.tiny import PRESETS, make_checkpoint


def main(argv: list[str] | None = None) -> Path:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, type=Path, help="output directory")
    p.add_argument("--preset", default="v3", choices=sorted(PRESETS))
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16"],
                   help="dtype of non-FP8 tensors (default: the preset's; bfloat16 for bench)")
    p.add_argument("--fp8", action="store_true", help="block-wise FP8 (e4m3, 128x128) decoder weights")
    p.add_argument("--mtp", action="store_true", help="add an MTP layer as model.layers.{num_hidden_layers}")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--shards", type=int, default=2, help="number of safetensors shards")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    out = make_checkpoint(args.out, args.preset, dtype=args.dtype, seed=args.seed, fp8=args.fp8,
                          mtp=args.mtp, num_shards=args.shards)
    print(out)
    return out


if __name__ == "__main__":
    main()
