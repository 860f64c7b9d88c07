"""Shared fixtures: small checkpoints in the real Hugging Face format, made once per test session."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    # Triton kernels run in Triton's CPU interpreter. This must precede the first import of triton
    # anywhere in the session (transformers and torch may import it), so it is set here, not per module.
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture
def one_thread():
    """The balancer runs many small ops; extra threads only slow them down on a busy CPU."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def float32_products():
    """Every product in float32 (the bf16 products of the AMX or AVX512-BF16 build off): for tests of the
    float32 kernels' sums and of greedy tokens on random weights, whose near-tied logits bf16 rounding reorders."""
    from moe_serve.kernels import cpu_build

    tiles = cpu_build.tile_rows()
    cpu_build.tile_rows(0)
    yield
    cpu_build.tile_rows(tiles)


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory):
    """checkpoint(preset, **kw) -> directory; each distinct request is built once per session."""
    from moe_serve.moe.tiny import make_checkpoint

    made: dict[tuple, str] = {}

    def get(preset: str = "v3", **kw) -> str:
        key = (preset, tuple(sorted(kw.items())))
        if key not in made:
            name = "-".join([preset] + [f"{k}{v}" for k, v in sorted(kw.items())])
            made[key] = str(make_checkpoint(tmp_path_factory.mktemp(name), preset, **kw))
        return made[key]

    return get


@pytest.fixture(scope="session")
def script():
    """script(name) -> the module scripts/<name>.py (benchmarks whose pure parts have tests), loaded once."""
    loaded: dict = {}

    def get(name: str):
        if name not in loaded:
            path = Path(__file__).resolve().parents[1] / "scripts" / f"{name}.py"
            if str(path.parent) not in sys.path:  # as when run: its siblings import by name
                sys.path.append(str(path.parent))
            spec = importlib.util.spec_from_file_location(f"scripts_{name}", path)  # (its dataclasses look it up)
            loaded[name] = sys.modules[f"scripts_{name}"] = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(loaded[name])
        return loaded[name]

    return get
