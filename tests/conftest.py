"""Shared fixtures: small checkpoints in the real Hugging Face format, made once per test session."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory):
    """checkpoint(preset, **kw) -> directory; each distinct request is built once per session."""
    from moe.tiny import make_checkpoint

    made: dict[tuple, str] = {}

    def get(preset: str = "v3", **kw) -> str:
        key = (preset, tuple(sorted(kw.items())))
        if key not in made:
            name = "-".join([preset] + [f"{k}{v}" for k, v in sorted(kw.items())])
            made[key] = str(make_checkpoint(tmp_path_factory.mktemp(name), preset, **kw))
        return made[key]

    return get
