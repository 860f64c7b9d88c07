"""The bf16-weight CPU linear (kernels/cpu_bf16w.py, csrc/linear_bf16w.c) equals its reference,
F.linear on the widened weight, and fused_moe accepts bf16 experts with float32 activations."""

from __future__ import annotations

import platform
import shutil

import pytest
import torch

from moe_serve.kernels import cpu_bf16w, cpu_build, fused_moe, fused_moe_reference

CAN_BUILD = (platform.machine() == "x86_64" and cpu_build.cpu_has(*cpu_build.CPU_FLAGS)
             and shutil.which("c++") is not None)


def test_kernel_is_built_where_it_can_be():
    # where a compiler and AVX2 + FMA exist the kernel must really run, not fall back unnoticed
    assert cpu_bf16w.available() == CAN_BUILD


def test_kernel_instruction_set_is_chosen_once_from_the_cpu(monkeypatch):
    """AVX-512 where the CPU has F/BW/VL, else AVX2; MOE_CPU_KERNEL_ISA=avx2 asks for the AVX2 build anyway,
    and a value the machine cannot honour is a one-line reason (the torch references run)."""
    has_avx512 = cpu_build.cpu_has(*cpu_build.AVX512_CPU_FLAGS)
    try:
        for wanted, expect in [("", "avx512" if has_avx512 else "avx2"), ("avx2", "avx2"), ("AVX2", "avx2")]:
            monkeypatch.setenv("MOE_CPU_KERNEL_ISA", wanted)
            cpu_build.isa.cache_clear()
            assert cpu_build.isa() == expect
        monkeypatch.setenv("MOE_CPU_KERNEL_ISA", "sse4")
        cpu_build.isa.cache_clear()
        with pytest.raises(ValueError, match="MOE_CPU_KERNEL_ISA must be avx2 or avx512, got 'sse4'"):
            cpu_build.isa()
        if not has_avx512:
            monkeypatch.setenv("MOE_CPU_KERNEL_ISA", "avx512")
            cpu_build.isa.cache_clear()
            with pytest.raises(ValueError, match="this CPU lacks one of avx512f"):
                cpu_build.isa()
    finally:
        monkeypatch.undo()
        cpu_build.isa.cache_clear()


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 8, 9, 12, 16, 17, 41, 300, 513])  # 513: past MAX_ROWS
@pytest.mark.parametrize("K,O", [(8, 3), (13, 5), (40, 7), (259, 33), (512, 64)])  # 16-lane blocks, 8 and 3 left
def test_linear_equals_reference(rows, K, O):
    torch.manual_seed(rows * 1000 + K)
    x = torch.randn(rows, K)
    w = torch.randn(O, K).bfloat16()
    torch.testing.assert_close(cpu_bf16w.linear(x, w), cpu_bf16w.reference(x, w), rtol=1e-5, atol=1e-4)
    b = torch.randn(O)
    torch.testing.assert_close(cpu_bf16w.linear(x, w, b), cpu_bf16w.reference(x, w, b), rtol=1e-5, atol=1e-4)
    x3 = torch.randn(K, rows).t().unsqueeze(0)  # leading dims and a non-contiguous input
    torch.testing.assert_close(cpu_bf16w.linear(x3, w), cpu_bf16w.reference(x3, w), rtol=1e-5, atol=1e-4)


def test_mm_into_a_strided_output():
    torch.manual_seed(0)
    x, w = torch.randn(6, 40), torch.randn(24, 40).bfloat16()
    buf = torch.full((6, 50), 7.0)
    cpu_bf16w.mm_into(x, w, buf[:, 10:34])  # rows of stride 50, not 24
    torch.testing.assert_close(buf[:, 10:34], cpu_bf16w.reference(x, w), rtol=1e-5, atol=1e-4)
    assert (buf[:, :10] == 7).all() and (buf[:, 34:] == 7).all()  # nothing written outside the slice


def test_without_the_kernel_results_are_the_same(monkeypatch):
    x, w = torch.randn(3, 37), torch.randn(11, 37).bfloat16()
    with_kernel = cpu_bf16w.linear(x, w)
    monkeypatch.setattr(cpu_bf16w, "available", lambda: False)
    torch.testing.assert_close(cpu_bf16w.linear(x, w), with_kernel, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("T", [1, 5, 64])
def test_fused_moe_with_bf16_experts_and_float32_x(T):
    torch.manual_seed(T)
    E, H, I, K = 6, 48, 24, 2
    x = torch.randn(T, H)
    w13, w2 = (torch.randn(E, 2 * I, H) / 7).bfloat16(), (torch.randn(E, H, I) / 5).bfloat16()
    ids = torch.randint(-1, E, (T, K))
    weights = torch.rand(T, K)
    out = fused_moe(x, w13, w2, weights, ids)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, fused_moe_reference(x, w13.float(), w2.float(), weights, ids), rtol=1e-4, atol=1e-4)
    with pytest.raises(TypeError, match="Triton path needs weights in x's dtype"):
        fused_moe(x, w13, w2, weights, ids, backend="triton")
    with pytest.raises(TypeError, match="must have x's dtype"):
        fused_moe(x.half(), w13, w2, weights, ids)  # bf16 weights widen only to float32
