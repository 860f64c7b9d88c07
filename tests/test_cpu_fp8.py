"""The CPU kernels with block-FP8 weights (csrc/linear_fp8w.cpp through the torch ops of csrc/torch_ops.cpp)
equal their references on the dequantised weights (kernels.reference.dequant_fp8_block): the byte
conversion exactly, for every byte; the linears, per-head products, experts and a whole decode layer up to
the order of float32 sums. Small blocks ((8, 8), (16, 16), (8, 24)) and sizes that are not multiples of them
reach every partial block and vector tail.

Legend: M rows, K in features, O out features, B batch (heads), T tokens, H hidden, E experts, K top-k.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from moe_serve.kernels import cpu_bf16w, cpu_build, cpu_mla, cpu_moe, cpu_ops, dequant_fp8_block, fused_moe_reference
from moe_serve.kernels.cpu_decode_layer import DecodeLayerKernel, LayerWeights, Router
from moe_serve.kernels.routing import RouterConfig, route_reference

pytestmark = pytest.mark.skipif(not cpu_build.available(), reason=f"{cpu_build.unavailable_reason()}")
FP8 = torch.float8_e4m3fn


@pytest.fixture(autouse=True)
def served_in_float32():
    """Every test starts as for a model served in float32 (FP8 products in float32), whatever model an earlier test
    of the process loaded (the backend sets cpu_build.fp8_tiles per model); fp8_tiles_on turns them on."""
    before = cpu_build.fp8_tiles()
    cpu_build.fp8_tiles(False)
    yield
    cpu_build.fp8_tiles(before)


def _fp8(*shape, block, g, lead=()):
    """A random FP8 weight [*lead, *shape] and its block scales [*lead, ceil(O / bo), ceil(K / bk)]."""
    w = (torch.randn(*lead, *shape, generator=g) * 3).to(FP8)
    grid = [-(-n // b) for n, b in zip(shape, block)]
    return w, torch.rand(*lead, *grid, generator=g) * 0.02 + 0.005


def _dense(w, scale, block):
    return dequant_fp8_block(w, scale, block)


def test_every_fp8_byte_widens_exactly():
    """All 256 bytes (the NaN bytes 0x7f / 0xff aside, which checkpoints never hold: they give +-480 here)
    through the vector path (K = 8) and the scalar tail (K = 1), times a block scale: bit for bit
    w.float() * scale, as the reference dequantises."""
    bytes_ = torch.arange(256, dtype=torch.uint8)
    nan = (bytes_ & 0x7f) == 0x7f
    w_OK = bytes_.masked_fill(nan, 0).view(FP8).view(32, 8)
    scale = torch.tensor([[0.75], [2.0**-9], [3.1], [1.0]])  # one per block of 8 rows
    got = cpu_bf16w.linear(torch.eye(8), w_OK, scale_inv=scale, block=(8, 8))  # row m: weight column m
    assert torch.equal(got, (w_OK.float() * scale.repeat_interleave(8, 0)).t())
    col = bytes_.masked_fill(nan, 0).view(FP8).view(256, 1)
    got1 = cpu_bf16w.linear(torch.ones(1, 1), col, scale_inv=torch.ones(32, 1), block=(8, 8))
    assert torch.equal(got1[0], col.float()[:, 0])
    assert col.float().abs().max() == 448  # largest finite e4m3fn; subnormals (bytes 1-7) compared above
    nan_bytes = torch.tensor([0x7f, 0xff], dtype=torch.uint8).view(FP8).view(2, 1)
    got_nan = cpu_bf16w.linear(torch.ones(1, 1), nan_bytes, scale_inv=torch.ones(1, 1), block=(8, 8))
    assert got_nan.tolist() == [[480, -480]]


@pytest.mark.parametrize("M", [1, 3, 17])
@pytest.mark.parametrize("O,K,block", [(40, 64, (16, 16)), (33, 75, (8, 24)), (300, 200, (128, 128)), (8, 8, (8, 8))])
def test_fp8_linear_equals_reference(M, O, K, block):
    g = torch.Generator().manual_seed(M * 1000 + O + K)
    w, s = _fp8(O, K, block=block, g=g)
    x, b = torch.randn(M, K, generator=g), torch.randn(O, generator=g)
    want = F.linear(x, _dense(w, s, block), b)
    got = cpu_bf16w.linear(x, w, b, scale_inv=s, block=block)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(cpu_bf16w.reference(x, w, b, s, block), want)
    x3 = torch.randn(K, M, generator=g).t().unsqueeze(0)  # leading dims, strided rows
    torch.testing.assert_close(cpu_bf16w.linear(x3, w, scale_inv=s, block=block), F.linear(x3, _dense(w, s, block)),
                               rtol=1e-5, atol=1e-4)
    buf = torch.full((M, O + 9), 7.0)
    cpu_bf16w.mm_into(x, w, buf[:, 4:O + 4], scale_inv=s, block=block)
    torch.testing.assert_close(buf[:, 4:O + 4], want - b, rtol=1e-5, atol=1e-4)
    assert (buf[:, :4] == 7).all() and (buf[:, O + 4:] == 7).all()


def test_fp8_linear_over_two_threads_and_transposed_scales():
    """Two threads split the weight rows in runs of 8 (not of the block's 128 rows); a scale tensor read
    through its strides (a transposed view)."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        g = torch.Generator().manual_seed(5)
        w, s = _fp8(1000, 512, block=(128, 128), g=g)
        for M in (1, 5, 40):
            x = torch.randn(M, 512, generator=g)
            torch.testing.assert_close(cpu_bf16w.linear(x, w, scale_inv=s, block=(128, 128)),
                                       F.linear(x, _dense(w, s, (128, 128))), rtol=1e-5, atol=1e-4)
    finally:
        torch.set_num_threads(before)
    s_t = s.t().contiguous().t()  # same values, column-major
    x = torch.randn(3, 512, generator=g)
    torch.testing.assert_close(cpu_bf16w.linear(x, w, scale_inv=s_t, block=(128, 128)),
                               F.linear(x, _dense(w, s, (128, 128))), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("M", [1, 3, 17])
def test_fp8_per_head_products_on_views_of_kv_b(M):
    """MLA's absorbed W_UK (a transposed copy, with transposed scales) and W_UV (a view of kv_b_proj's
    weight and of its scales) as moe/attention.py absorb_weights makes them."""
    g = torch.Generator().manual_seed(M)
    N, Dn, Dv, C, b = 3, 16, 32, 40, 8
    kv_b, kv_b_s = _fp8(N * (Dn + Dv), C, block=(b, b), g=g)
    w_NXC, s_NXc = kv_b.view(N, Dn + Dv, C), kv_b_s.view(N, (Dn + Dv) // b, -1)
    w_uk, s_uk = w_NXC[:, :Dn].transpose(1, 2).contiguous(), s_NXc[:, :Dn // b].transpose(1, 2).contiguous()
    w_uv, s_uv = w_NXC[:, Dn:], s_NXc[:, Dn // b:]
    assert not w_uv.is_contiguous() and not s_uv.is_contiguous()
    q = torch.randn(M, N, Dn, generator=g).transpose(0, 1)  # [N, M, Dn], rows strided by heads
    torch.testing.assert_close(cpu_bf16w.bmm(q, w_uk, s_uk, (b, b)), torch.bmm(q, _dense(w_uk, s_uk, (b, b)).mT),
                               rtol=1e-5, atol=1e-4)
    lat = torch.randn(N, M, C, generator=g)
    out = torch.full((N, M, Dv + 5), 7.0)
    cpu_bf16w.bmm_into(lat, w_uv, out[:, :, 5:], s_uv, (b, b))
    torch.testing.assert_close(out[:, :, 5:], torch.bmm(lat, _dense(w_uv, s_uv, (b, b)).mT), rtol=1e-5, atol=1e-4)
    assert (out[:, :, :5] == 7).all()


def _shared(x, w13, s13, w2, s2, block):
    gate, up = F.linear(x, _dense(w13, s13, block)).chunk(2, dim=-1)
    return F.linear(F.silu(gate) * up, _dense(w2, s2, block))


@pytest.mark.parametrize("T,E,K,shared", [(1, 8, 2, False), (3, 5, 2, True), (17, 6, 3, True), (300, 4, 2, True)])
@pytest.mark.parametrize("threads", [1, 2])
def test_fp8_experts_equal_reference(T, E, K, shared, threads):
    g = torch.Generator().manual_seed(T * 10 + E)
    H, I, S, block = 40, 24, 20, (16, 16)  # H, I, S: partial blocks
    x = torch.randn(T, H, generator=g)
    w13, s13 = _fp8(2 * I, H, block=block, g=g, lead=(E,))
    w2, s2 = _fp8(H, I, block=block, g=g, lead=(E,))
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    ids[::3, 0] = -1  # slots on another rank
    weights = torch.rand(T, K, generator=g)
    want = fused_moe_reference(x, w13, w2, weights, ids, w13_scale=s13, w2_scale=s2, block_shape=block)
    kw = dict(w13_scale=s13, w2_scale=s2, block=block)
    args = ()
    if shared:
        sw13, ss13 = _fp8(2 * S, H, block=block, g=g)
        sw2, ss2 = _fp8(H, S, block=block, g=g)
        want = want + _shared(x, sw13, ss13, sw2, ss2, block)
        args, kw = (sw13, sw2), {**kw, "shared_w13_scale": ss13, "shared_w2_scale": ss2}
    assert cpu_moe.fits(x, w13, w2, s13, s2) and not cpu_moe.fits(x, w13, w2)  # FP8 only with its scales
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = cpu_moe.fused_moe_bf16w(x, w13, w2, weights, ids, *args, **kw)
    finally:
        torch.set_num_threads(before)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_fp8_weights_are_checked():
    g = torch.Generator().manual_seed(0)
    w, s = _fp8(40, 64, block=(16, 16), g=g)
    x = torch.randn(2, 64)
    with pytest.raises(ValueError, match=r"block shape must be two positive multiples of 8, got \[12, 16\]"):
        cpu_bf16w.linear(x, w, scale_inv=torch.ones(4, 4), block=(12, 16))
    with pytest.raises(ValueError, match=r"w scale must be \[3, 4\] for a weight \[40, 64\] in blocks \[16, 16\]"):
        cpu_bf16w.linear(x, w, scale_inv=s[:2], block=(16, 16))
    with pytest.raises(ValueError, match="needs its block shape"):
        cpu_bf16w.linear(x, w, scale_inv=s)
    E, H, I = 2, 32, 16
    w13, s13 = _fp8(2 * I, H, block=(16, 16), g=g, lead=(E,))
    w2, s2 = _fp8(H, I, block=(16, 16), g=g, lead=(E,))
    ids, wts = torch.zeros(1, 1, dtype=torch.long), torch.ones(1, 1)
    with pytest.raises(ValueError, match="w2 is Float8_e4m3fn: pass its block scales"):
        cpu_moe.fused_moe_bf16w(torch.randn(1, H), w13, w2, wts, ids, w13_scale=s13, block=(16, 16))


# ---- a whole decode layer -------------------------------------------------------------------------------

def _layer(g, fp8: bool, block=(16, 16)):
    """A random decoder layer (q compression, routed + shared experts) and the float32 weights it means."""
    H, Qr, N, Dn, R, Dv, C, E, Ie, Is = 40, 24, 2, 16, 8, 16, 32, 4, 24, 16
    dense, scales = {}, {}

    def lin(name, *shape, lead=()):
        if fp8:
            w, s = _fp8(*shape, block=block, g=g, lead=lead)
            dense[name], scales[name + "_scale"] = _dense(w, s, block), s
        else:
            w = (torch.randn(*lead, *shape, generator=g) / shape[-1] ** 0.5).bfloat16()
            dense[name] = w.float()
        return w

    norm = lambda n: (torch.rand(n, generator=g) + 0.5, 1e-6)  # noqa: E731
    kv_b = lin("kv_b", N * (Dn + Dv), C)
    w_NXC = kv_b.view(N, Dn + Dv, C)
    if fp8:
        s_NXc = scales.pop("kv_b_scale").view(N, (Dn + Dv) // block[0], -1)
        scales["w_uk_scale"] = s_NXc[:, :Dn // block[0]].transpose(1, 2).contiguous()
        scales["w_uv_scale"] = s_NXc[:, Dn // block[0]:]
    w = LayerWeights(
        in_norm=norm(H), q_a=lin("q_a", Qr, H), q_a_norm=norm(Qr), q_b=lin("q_b", N * (Dn + R), Qr),
        kv_a=lin("kv_a", C + R, H), kv_a_norm=norm(C), w_uk_NCD=w_NXC[:, :Dn].transpose(1, 2).contiguous(),
        w_uv_NVC=w_NXC[:, Dn:], o=lin("o", H, N * Dv), softmax_scale=(Dn + R) ** -0.5, rope_interleaved=True,
        post_norm=norm(H), router=Router(torch.randn(E, H, generator=g) / 4, torch.randn(E, generator=g) * 0.1,
                                         2, 1, 2, True, 2.5),
        w13=lin("w13", 2 * Ie, H, lead=(E,)), w2=lin("w2", H, Ie, lead=(E,)), mlp_w13=lin("mlp_w13", 2 * Is, H),
        mlp_w2=lin("mlp_w2", H, Is), fp8_block=block if fp8 else None, **scales)
    kv_b32 = dense.pop("kv_b").view(N, Dn + Dv, C)
    dense["w_uk"], dense["w_uv"] = kv_b32[:, :Dn].transpose(1, 2), kv_b32[:, Dn:]
    return w, dense


def _layer_reference(w: LayerWeights, d: dict, x, cos, sin, cache, slots, rows, tables, lens):
    """The layer in torch from the kernels' references (what csrc/decode_layer.cpp computes), on float32
    weights d; x and cache are updated."""
    T, (N, C, Dn), Dv = x.shape[0], w.w_uk_NCD.shape, w.w_uv_NVC.shape[1]
    h = cpu_ops.rms_norm_reference(x, *w.in_norm)
    q = F.linear(cpu_ops.rms_norm_reference(F.linear(h, d["q_a"]), *w.q_a_norm), d["q_b"]).view(T, N, -1)
    cpu_ops.mla_cache_write_reference(F.linear(h, d["kv_a"]), *w.kv_a_norm, cos, sin, w.rope_interleaved, cache, slots)
    q_lat = torch.cat((torch.bmm(q[..., :Dn].transpose(0, 1), d["w_uk"].mT).transpose(0, 1),
                       cpu_ops.rope_reference(q[..., Dn:], cos, sin, w.rope_interleaved)), dim=-1)
    o_lat = torch.zeros(T, N, C)
    o_lat[rows] = cpu_mla.reference(q_lat[rows], cache, tables, lens, C, w.softmax_scale)
    x += F.linear(torch.bmm(o_lat.transpose(0, 1), d["w_uv"].mT).transpose(0, 1).reshape(T, N * Dv), d["o"])
    h = cpu_ops.rms_norm_reference(x, *w.post_norm)
    r = w.router
    rc = RouterConfig(r.gate_EH.shape[0], r.top_k, "noaux_tc", "sigmoid", r.num_groups, r.topk_group,
                      r.norm_topk_prob, r.scale)
    weights, ids = route_reference(h, r.gate_EH, r.bias_E, rc)
    gate, up = F.linear(h, d["mlp_w13"]).chunk(2, dim=-1)
    x += fused_moe_reference(h, d["w13"], d["w2"], weights, ids) + F.linear(F.silu(gate) * up, d["mlp_w2"])
    return ids


@pytest.mark.parametrize("fp8", [False, True])
def test_decode_layer_equals_its_torch_reference(fp8):
    """The fused decode layer, bf16 or FP8 weights (W_UV a view of kv_b, as the model holds it), against the
    layer composed of the kernels' torch references; sequences sit in shuffled token rows."""
    g = torch.Generator().manual_seed(int(fp8))
    w, d = _layer(g, fp8)
    kernel = DecodeLayerKernel(w)
    T, bs, D, R = 3, 4, 40, 8
    lens = torch.tensor([5, 1, 9])
    tables = torch.tensor([[3, 0, 0], [5, 0, 0], [1, 4, 2]])
    rows = torch.tensor([2, 0, 1])  # sequence b is token row rows[b]
    slots = torch.empty(T, dtype=torch.long)
    slots[rows] = torch.stack([tables[b, (lens[b] - 1) // bs] * bs + (lens[b] - 1) % bs for b in range(T)])
    x = torch.randn(T, 40, generator=g)
    cos, sin = torch.randn(T, R // 2, generator=g), torch.randn(T, R // 2, generator=g)
    cache = torch.randn(6, bs, D, generator=g).bfloat16()
    x_want, cache_want = x.clone(), cache.clone()
    ids_want = _layer_reference(w, d, x_want, cos, sin, cache_want, slots, rows, tables, lens)
    ids = torch.empty(T, 2, dtype=torch.long)
    kernel.forward(x, cos, sin, cache, slots, rows, tables, lens, int(lens.max()), ids)
    assert torch.equal(ids.sort(dim=1).values, ids_want.sort(dim=1).values)
    diff = (cache.float() - cache_want.float()).abs()
    assert (diff <= cache_want.float().abs() * 2**-8).all()  # one bf16 ulp at most (rounding of close sums)
    torch.testing.assert_close(x, x_want, rtol=1e-3, atol=1e-3)


def test_decode_layer_checks_fp8_weights_and_steps():
    g = torch.Generator().manual_seed(3)
    w, _ = _layer(g, fp8=True)
    with pytest.raises(ValueError, match="o is Float8_e4m3fn: pass its block scales"):
        DecodeLayerKernel(LayerWeights(**{**w.__dict__, "o_scale": None}))
    with pytest.raises(ValueError, match="block shape must be two positive multiples of 8"):
        DecodeLayerKernel(LayerWeights(**{**w.__dict__, "fp8_block": None}))
    kernel = DecodeLayerKernel(w)
    x, cs = torch.randn(1, 40), torch.randn(1, 4)
    cache, one = torch.zeros(2, 4, 40).bfloat16(), torch.zeros(1, dtype=torch.long)
    with pytest.raises(ValueError, match="block 7 of sequence 0 is not in the cache of 2 blocks"):
        kernel.forward(x, cs, cs, cache, one, one, torch.tensor([[7]]), torch.tensor([1]), 1)
    with pytest.raises(ValueError, match="slot 8 is not in the cache of 8 rows"):
        kernel.forward(x, cs, cs, cache, torch.tensor([8]), one, torch.tensor([[0]]), torch.tensor([1]), 1)
    with pytest.raises(ValueError, match="a context of 5 tokens does not fit 1 blocks of 4"):
        kernel.forward(x, cs, cs, cache, one, one, torch.tensor([[0]]), torch.tensor([5]), 5)


fp8_dot_products = pytest.mark.skipif(cpu_build.isa() != "avx512bf16" or not cpu_build.tile_rows(),
                                      reason="FP8 weights take bf16 dot products only in the AVX512-BF16 build")


@pytest.fixture
def fp8_tiles_on():
    """FP8 products of many rows on the bf16 dot products, as for a model served in bf16 (the backend's setting)."""
    before = cpu_build.fp8_tiles()
    assert cpu_build.fp8_tiles(True)
    yield
    cpu_build.fp8_tiles(before)


@fp8_dot_products
@pytest.mark.parametrize("M", [16, 17, 20, 48, 100, 513])
@pytest.mark.parametrize("O,K,block", [(1024, 512, (128, 128)), (64, 96, (16, 16)), (96, 512, (32, 64)),
                                       (48, 64, (16, 24))])
def test_fp8_products_of_many_rows_on_bf16_dot_products(M, O, K, block, float32_products, fp8_tiles_on):
    """On the AVX512-BF16 build, for a model served in bf16, a product of 16+ rows by an FP8 weight in blocks of a
    multiple of 16 rows (K a multiple of 32, O of 16) widens the weight to bf16 exactly and rounds x to bf16: it
    equals F.linear on x rounded and the dequantised weight, to the order of float32 sums, and not the float32
    product, which runs with the products off, for a model served in float32, and for blocks of 8 rows and 8
    columns. Below 16 rows x is rounded where the blocks' columns are a multiple of 32 (test_fp8_decode_rows_*)."""
    g = torch.Generator().manual_seed(M + O + K)
    w, s = _fp8(O, K, block=block, g=g)
    x = torch.randn(M, K, generator=g)
    dense = _dense(w, s, block)
    exact, rounded = F.linear(x, dense), F.linear(x.bfloat16().float(), dense)
    torch.testing.assert_close(cpu_bf16w.linear(x, w, scale_inv=s, block=block), exact, rtol=1e-5, atol=1e-4)  # off
    assert cpu_build.tile_rows(cpu_build.TILE_ROWS) == cpu_build.TILE_ROWS
    assert cpu_bf16w.tiles_take(M, K, O, s, block)
    on = cpu_bf16w.linear(x, w, scale_inv=s, block=block)
    torch.testing.assert_close(on, rounded, rtol=1e-5, atol=1e-4)
    assert (on - exact).abs().max() > 1e-3  # x really rounded
    torch.testing.assert_close(cpu_bf16w.reference(x, w, scale_inv=s, block=block), rounded)
    along_k = block[1] % 32 == 0
    assert cpu_bf16w.tiles_take(15, K, O, s, block) == along_k
    torch.testing.assert_close(cpu_bf16w.linear(x[:15], w, scale_inv=s, block=block),
                               (rounded if along_k else exact)[:15], rtol=1e-5, atol=1e-4)
    cpu_build.fp8_tiles(False)  # a model served in float32: FP8 products stay float32
    assert not cpu_bf16w.tiles_take(M, K, O, s, block)
    torch.testing.assert_close(cpu_bf16w.linear(x, w, scale_inv=s, block=block), exact, rtol=1e-5, atol=1e-4)
    cpu_build.fp8_tiles(True)
    w8, s8 = _fp8(O, K, block=(8, 8), g=g)  # blocks of 8 rows: the float32 kernel
    assert not cpu_bf16w.tiles_take(M, K, O, s8, (8, 8))
    torch.testing.assert_close(cpu_bf16w.linear(x, w8, scale_inv=s8, block=(8, 8)), F.linear(x, _dense(w8, s8, (8, 8))),
                               rtol=1e-5, atol=1e-4)


@pytest.fixture
def two_threads_tiles():
    """Two threads, the bf16 products from their usual rows (after float32_products turned them off)."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    cpu_build.tile_rows(cpu_build.TILE_ROWS)
    yield
    torch.set_num_threads(before)


def _check_linear_and_heads(rows: int, head_rows: int, g: torch.Generator) -> None:
    """A 2048 x 512 FP8 product of `rows` rows, and 4 per-head products of `head_rows` rows each (strided by heads,
    as the model passes them), against F.linear / torch.bmm on x rounded to bf16."""
    w, s = _fp8(2048, 512, block=(128, 128), g=g)
    x = torch.randn(rows, 512, generator=g)
    torch.testing.assert_close(cpu_bf16w.linear(x, w, scale_inv=s, block=(128, 128)),
                               F.linear(x.bfloat16().float(), _dense(w, s, (128, 128))), rtol=1e-5, atol=1e-4)
    wh, sh = _fp8(64, 128, block=(32, 32), g=g, lead=(4,))
    xh = torch.randn(head_rows, 4, 128, generator=g).transpose(0, 1)
    dense_h = torch.stack([_dense(wh[b], sh[b], (32, 32)) for b in range(4)])
    torch.testing.assert_close(cpu_bf16w.bmm(xh, wh, sh, (32, 32)),
                               torch.bmm(xh.bfloat16().float(), dense_h.transpose(1, 2)), rtol=1e-5, atol=1e-4)


def _check_experts(ids_TK: torch.Tensor, H: int, I: int, block: tuple[int, int], g: torch.Generator) -> None:
    """Routed FP8 experts (ids_TK of max + 1 experts, random weights) against the reference of a model served in bf16:
    x rounded to bf16 for w13, the SiLU product for w2."""
    T, K = ids_TK.shape
    E = int(ids_TK.max()) + 1
    w13, s13 = _fp8(2 * I, H, block=block, g=g, lead=(E,))
    w2, s2 = _fp8(H, I, block=block, g=g, lead=(E,))
    x = torch.randn(T, H, generator=g)
    weights = torch.rand(T, K, generator=g)
    want = torch.zeros(T, H)
    for t in range(T):
        for k in range(K):
            e = int(ids_TK[t, k])
            gate, up = F.linear(x[t:t + 1].bfloat16().float(), _dense(w13[e], s13[e], block)).chunk(2, dim=-1)
            h = (F.silu(gate) * up).bfloat16().float()
            want[t] += (F.linear(h, _dense(w2[e], s2[e], block)) * weights[t, k])[0]
    got = cpu_moe.fused_moe_bf16w(x, w13, w2, weights, ids_TK, w13_scale=s13, w2_scale=s2, block=block)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@fp8_dot_products
def test_fp8_dot_products_over_two_threads_in_heads_and_experts(float32_products, fp8_tiles_on, two_threads_tiles):
    """The FP8 dot products split over two threads (each widening its own blocks of weight rows), in per-head
    products (16+ rows a head) and in experts of 16+ rows (x rounded for w13, the SiLU product for w2)."""
    g = torch.Generator().manual_seed(3)
    _check_linear_and_heads(64, 20, g)
    _check_experts(torch.tensor([0] * 24 + [1] * 16).unsqueeze(1), 64, 32, (16, 16), g)


@fp8_dot_products
@pytest.mark.parametrize("M", [1, 2, 3, 4, 5, 7, 8, 9, 15])
@pytest.mark.parametrize("O,K,block", [(1536, 512, (128, 128)), (40, 96, (8, 32)), (17, 128, (16, 64)),
                                       (48, 160, (16, 64)), (64, 64, (16, 16))])
def test_fp8_decode_rows_on_bf16_dot_products(M, O, K, block, float32_products, fp8_tiles_on):
    """Below 16 rows (decode), for a model served in bf16, an FP8 product whose K and blocks' columns are multiples
    of 32 takes the dot products along K (fp8_decode_dp: 32 weights widened to bf16 in registers, exactly): it equals
    F.linear on x rounded to bf16 and the dequantised weight, for any O (16 outputs at a time and the rest), block
    rows, and a last block of columns cut short by K (160 = 64 + 64 + 32); blocks of 16 columns stay float32, and so
    does everything with the products off or served in float32."""
    g = torch.Generator().manual_seed(M * 7 + O + K)
    w, s = _fp8(O, K, block=block, g=g)
    x = torch.randn(M, K, generator=g) * 4
    dense = _dense(w, s, block)
    exact, rounded = F.linear(x, dense), F.linear(x.bfloat16().float(), dense)
    torch.testing.assert_close(cpu_bf16w.linear(x, w, scale_inv=s, block=block), exact, rtol=1e-5, atol=1e-4)  # off
    assert cpu_build.tile_rows(cpu_build.TILE_ROWS) == cpu_build.TILE_ROWS
    along_k = block[1] % 32 == 0
    assert cpu_bf16w.tiles_take(M, K, O, s, block) == along_k
    got = cpu_bf16w.linear(x, w, scale_inv=s, block=block)
    torch.testing.assert_close(got, rounded if along_k else exact, rtol=1e-5, atol=1e-4)
    if along_k:
        assert (got - exact).abs().max() > 1e-3  # x really rounded
    torch.testing.assert_close(cpu_bf16w.reference(x, w, scale_inv=s, block=block), rounded if along_k else exact)
    cpu_build.fp8_tiles(False)
    torch.testing.assert_close(cpu_bf16w.linear(x, w, scale_inv=s, block=block), exact, rtol=1e-5, atol=1e-4)
    cpu_build.fp8_tiles(True)


@fp8_dot_products
def test_every_fp8_byte_widens_exactly_on_the_dot_products(float32_products, fp8_tiles_on):
    """All 256 bytes through fp8_x32_to_bf16 (normal values by moving bits, subnormals from a table, zeros of both
    signs), one per weight row, against a one-hot x: bit for bit w.float() * scale; the NaN bytes give +-480."""
    cpu_build.tile_rows(cpu_build.TILE_ROWS)
    bytes_ = torch.arange(256, dtype=torch.uint8)
    w = torch.zeros(256, 64, dtype=torch.uint8)
    w[:, 37] = bytes_  # the second vector of 32, lane 5
    scale = torch.tensor([[0.75, 1.0]]).repeat(256 // 128, 1)
    scale[1, 0] = 2.0**-9
    x = torch.zeros(1, 64)
    x[0, 37] = 1.0
    got = cpu_bf16w.linear(x, w.view(FP8), scale_inv=scale, block=(128, 32))
    assert cpu_bf16w.tiles_take(1, 64, 256, scale, (128, 32))
    nan = (bytes_ & 0x7f) == 0x7f
    want = bytes_.masked_fill(nan, 0).view(FP8).float() * scale[:, 1].repeat_interleave(128)
    want[nan] = torch.tensor([480.0, -480.0]) * scale[:, 1].repeat_interleave(128)[nan]
    assert torch.equal(got[0], want)


@fp8_dot_products
def test_fp8_decode_rows_over_two_threads_in_heads_and_experts(float32_products, fp8_tiles_on, two_threads_tiles):
    """Decode-sized FP8 products on the dot products along K split over two threads, in per-head products (a few
    rows a head, strided) and in experts of a few rows each (x rounded for w13, the SiLU product for w2)."""
    g = torch.Generator().manual_seed(5)
    _check_linear_and_heads(4, 3, g)
    _check_experts(torch.tensor([[0, 2], [1, 2], [0, 1], [2, 0], [1, 0], [2, 1]]), 64, 64, (32, 32), g)
