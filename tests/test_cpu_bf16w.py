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
    """AMX where the CPU has AMX-BF16 (with AVX-512), else AVX512-BF16 where it has that, else AVX-512 where it
    has F/BW/VL, else AVX2; MOE_CPU_KERNEL_ISA asks for a lesser build anyway, and a value the machine cannot
    honour is a one-line reason (the torch references run)."""
    has_avx512 = cpu_build.cpu_has(*cpu_build.AVX512_CPU_FLAGS)
    has_bf16 = cpu_build.cpu_has(*cpu_build.AVX512BF16_CPU_FLAGS)
    has_amx = cpu_build.cpu_has(*cpu_build.AMX_CPU_FLAGS)
    best = "amx" if has_amx else "avx512bf16" if has_bf16 else "avx512" if has_avx512 else "avx2"
    try:
        for wanted, expect in [("", best), ("avx2", "avx2"), ("AVX2", "avx2")] + (
                [("avx512", "avx512")] if has_avx512 else []) + ([("avx512bf16", "avx512bf16")] if has_bf16 else []):
            monkeypatch.setenv("MOE_CPU_KERNEL_ISA", wanted)
            cpu_build.isa.cache_clear()
            assert cpu_build.isa() == expect
        monkeypatch.setenv("MOE_CPU_KERNEL_ISA", "sse4")
        cpu_build.isa.cache_clear()
        with pytest.raises(ValueError,
                           match="MOE_CPU_KERNEL_ISA must be one of avx2, avx512, avx512bf16, amx, got 'sse4'"):
            cpu_build.isa()
        for wanted, flag, has in [("avx512", "avx512f", has_avx512), ("avx512bf16", "avx512f", has_bf16),
                                  ("amx", "avx512f", has_amx)]:
            if not has:
                monkeypatch.setenv("MOE_CPU_KERNEL_ISA", wanted)
                cpu_build.isa.cache_clear()
                with pytest.raises(ValueError, match=f"this CPU lacks one of {flag}"):
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


needs_tiles = pytest.mark.skipif(not cpu_build.tile_rows(), reason="no bf16 products here (cpu_build.isa() is "
                                 "neither 'amx' nor 'avx512bf16')")


@needs_tiles
@pytest.mark.parametrize("rows", [16, 17, 20, 24, 31, 33, 56, 100, 513, 2048])
@pytest.mark.parametrize("K,O", [(64, 48), (512, 1024), (256, 80)])
def test_tiles_round_x_to_bf16_and_sum_in_float32(rows, K, O, float32_products):
    """On the AMX and AVX512-BF16 builds a product of 16+ rows by a bf16 weight (K a multiple of 32, O of 16)
    rounds x to bf16 and sums in float32: it equals F.linear on x rounded (to float32 summation order), and not
    the float32 product, which is what runs with the tiles off, below 16 rows and for other shapes."""
    torch.manual_seed(rows + K)
    x, w = torch.randn(rows, K), torch.randn(O, K).bfloat16()
    on_bf16_x = torch.nn.functional.linear(x.bfloat16().float(), w.float())
    exact = torch.nn.functional.linear(x, w.float())
    off = cpu_bf16w.linear(x, w)  # float32_products: the tiles are off
    torch.testing.assert_close(off, exact, rtol=1e-5, atol=1e-4)
    assert cpu_build.tile_rows(cpu_build.TILE_ROWS) == cpu_build.TILE_ROWS
    on = cpu_bf16w.linear(x, w)
    torch.testing.assert_close(on, on_bf16_x, rtol=1e-5, atol=1e-4)
    assert (on - exact).abs().max() > 1e-3  # really rounded: bf16 keeps 8 bits of x
    torch.testing.assert_close(on, cpu_bf16w.reference(x, w), rtol=1e-5, atol=1e-4)
    few, odd = x[:15], torch.randn(rows, K + 8)  # too few rows; K not a multiple of 32
    torch.testing.assert_close(cpu_bf16w.linear(few, w), exact[:15], rtol=1e-5, atol=1e-4)
    w_odd = torch.randn(O, K + 8).bfloat16()
    torch.testing.assert_close(cpu_bf16w.linear(odd, w_odd), torch.nn.functional.linear(odd, w_odd.float()),
                               rtol=1e-5, atol=1e-4)


@needs_tiles
def test_tiles_in_the_experts(float32_products):
    """The fused experts take the tiles per expert with expert_tile_rows+ rows (16; 8 in the AMX build): x
    rounded to bf16 for w13, the float32 SiLU product rounded for w2; an expert with fewer rows stays float32."""
    from moe_serve.kernels import cpu_moe

    torch.manual_seed(0)
    T, H, I = 40, 64, 32
    x = torch.randn(T, H)
    w13, w2 = (torch.randn(3, 2 * I, H) / 8).bfloat16(), (torch.randn(3, H, I) / 6).bfloat16()
    ids = torch.tensor([0] * 22 + [1] * 15 + [2] * 3).unsqueeze(1)  # 22 rows: tiles; 3: float32; 15: by build
    weights = torch.rand(T, 1)
    want = torch.empty(T, H)
    cpu_build.tile_rows(cpu_build.TILE_ROWS)
    least = cpu_build.expert_tile_rows()
    assert 0 < least <= cpu_build.TILE_ROWS
    for e in range(3):
        rows = (ids[:, 0] == e).nonzero().flatten()
        xe = x[rows].bfloat16().float() if len(rows) >= least else x[rows]
        g, u = torch.nn.functional.linear(xe, w13[e].float()).chunk(2, dim=-1)
        h = torch.nn.functional.silu(g) * u
        h = h.bfloat16().float() if len(rows) >= least else h
        want[rows] = torch.nn.functional.linear(h, w2[e].float()) * weights[rows]
    torch.testing.assert_close(cpu_moe.fused_moe_bf16w(x, w13, w2, weights, ids), want, rtol=1e-4, atol=1e-5)


@needs_tiles
def test_tiles_in_the_per_head_products(float32_products):
    """MLA's per-head products (W_UK / W_UV absorption) take the bf16 products like a linear: x rounded to
    bf16 with 16+ rows a head, float32 below that; x rows strided by heads as the model passes them."""
    torch.manual_seed(0)
    w = torch.randn(4, 64, 128).bfloat16()
    for rows in (15, 16, 40):
        x = torch.randn(rows, 4, 128).transpose(0, 1)
        exact = torch.bmm(x, w.float().transpose(1, 2))
        torch.testing.assert_close(cpu_bf16w.bmm(x, w), exact, rtol=1e-5, atol=1e-4)  # products off
        cpu_build.tile_rows(cpu_build.TILE_ROWS)
        want = torch.bmm(x.bfloat16().float(), w.float().transpose(1, 2)) if rows >= 16 else exact
        torch.testing.assert_close(cpu_bf16w.bmm(x, w), want, rtol=1e-5, atol=1e-4)
        cpu_build.tile_rows(0)


@needs_tiles
def test_prompt_attention_on_the_bf16_products(float32_products):
    """A prompt chunk of 64+ queries over a bf16 cache attends on the bf16 products (kernels/cpu_attention.py):
    it equals the reference with bf16 operands, not the float32 attention; fewer queries, or a float32 cache,
    attend in float32. The context (100 keys) is padded to 128 and the padding masked."""
    from moe_serve.kernels import cpu_attention
    from moe_serve.kernels.backend_cpu import CpuBackend
    from moe_serve.kernels.backend_torch import TorchBackend

    torch.manual_seed(0)
    backend, exact = CpuBackend(), TorchBackend()
    q = torch.randn(64, 4, 192).transpose(0, 1)  # [N, Q, K], rows strided by heads as the model passes it
    k, v = torch.randn(4, 100, 192), torch.randn(4, 100, 128)
    float32 = exact.prefill_attention(q, k, v, 0.1, torch.float32)
    torch.testing.assert_close(backend.prefill_attention(q, k, v, 0.1, torch.bfloat16), float32, rtol=1e-5, atol=1e-5)
    cpu_build.tile_rows(cpu_build.TILE_ROWS)
    out = backend.prefill_attention(q, k, v, 0.1, torch.bfloat16)
    torch.testing.assert_close(out, cpu_attention.reference(q, k, v, 0.1), rtol=1e-2, atol=2e-3)
    assert (out - float32).abs().max() > 1e-3  # really bf16 operands
    torch.testing.assert_close(backend.prefill_attention(q, k, v, 0.1, torch.float32), float32, rtol=1e-5, atol=1e-5)
    few = q[:, :cpu_attention.MIN_QUERIES - 1]
    torch.testing.assert_close(backend.prefill_attention(few, k, v, 0.1, torch.bfloat16),
                               exact.prefill_attention(few, k, v, 0.1, torch.float32), rtol=1e-5, atol=1e-5)
    q, k, v = q[..., :48], k[..., :48], v[..., :40]  # the demo model's 48 key dims; value dims padded too
    torch.testing.assert_close(backend.prefill_attention(q, k, v, 0.1, torch.bfloat16),
                               cpu_attention.reference(q, k, v, 0.1), rtol=1e-2, atol=2e-3)
    # a chunk longer than QUERY_BLOCK, after 40 cached tokens: blocks of queries, each over its visible keys
    q, k, v = torch.randn(4, 300, 192), torch.randn(4, 340, 192), torch.randn(4, 340, 128)
    torch.testing.assert_close(backend.prefill_attention(q, k, v, 0.1, torch.bfloat16),
                               cpu_attention.reference(q, k, v, 0.1), rtol=1e-2, atol=2e-3)


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
