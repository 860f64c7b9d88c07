"""The oneDNN-packed bf16 linear (kernels/cpu_linear.py) equals its torch reference, F.linear, and the
model's layers use it only where it applies."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels import cpu_linear
from moe.parallel_linear import ColumnParallelLinear


@pytest.mark.parametrize("rows", [1, 3, 8, 64, 257])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_equals_reference(rows, bias):
    torch.manual_seed(rows)
    w = torch.randn(96, 80, dtype=torch.bfloat16)
    b = torch.randn(96, dtype=torch.bfloat16) if bias else None
    x = torch.randn(rows, 80, dtype=torch.bfloat16)
    packed = cpu_linear.pack(w)
    if packed is None:
        pytest.skip("oneDNN is not available in this torch build")
    torch.testing.assert_close(cpu_linear.linear(x, w, packed, b), F.linear(x, w, b), rtol=1.6e-2, atol=1e-2)
    x3 = x.view(1, rows, 80).transpose(0, 1)  # leading dims and a non-contiguous input
    torch.testing.assert_close(cpu_linear.linear(x3, w, packed, b), F.linear(x3, w, b), rtol=1.6e-2, atol=1e-2)


def test_only_bf16_cpu_weights_are_packed():
    assert cpu_linear.pack(torch.randn(8, 8)) is None  # float32 keeps F.linear (parity tests run there)
    layer = ColumnParallelLinear(16, 32)
    layer.weight.data = torch.randn(32, 16, dtype=torch.bfloat16)
    layer.pack_weight()
    x = torch.randn(5, 16, dtype=torch.bfloat16)
    assert (layer.packed is not None) == cpu_linear.can_pack(layer.weight)
    torch.testing.assert_close(layer(x), F.linear(x, layer.weight), rtol=1.6e-2, atol=1e-2)
