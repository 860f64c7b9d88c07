"""`python -m moe_serve.server ...`: the `moe` command."""

import sys
from pathlib import Path


def _drop_checkout_from_path() -> None:
    """`python -m` puts the working directory first on sys.path. Run from a checkout of this repository, that
    makes its folders importable under bare names (`kernels`, `server`, ...), shadowing PyPI packages of those
    names (transformers imports Hugging Face's `kernels`). This project is imported as `moe_serve` only."""
    checkout = Path(__file__).resolve().parents[1]
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != checkout]


if __name__ == "__main__":  # guarded: the spawned engine process re-imports the main module
    _drop_checkout_from_path()
    from moe_serve.server.cli import main

    sys.exit(main())
