"""`kernels` and `moe` are also names of PyPI packages: make sure the imported ones are this repo's."""

from pathlib import Path

from moe_serve import experts
from moe_serve import kernels
from moe_serve import moe
from moe_serve import server

REPO = Path(__file__).resolve().parent.parent


def test_packages_come_from_this_repo():
    for pkg in (moe, kernels, experts, server):
        assert Path(pkg.__file__).resolve().is_relative_to(REPO), pkg.__file__
