"""The CPU kernels behind bf16 on a CPU without bf16 arithmetic equal their torch references: MLA decode
attention over the paged bf16 cache (kernels/cpu_mla.py), the one-call routed experts (kernels/cpu_moe.py)
the per-head absorption products (kernels/cpu_bf16w.bmm), and RMSNorm, rope and the router
(kernels/cpu_ops.py)."""

from __future__ import annotations

import threading

import pytest
import torch
import torch.nn.functional as F

from moe_serve.kernels import cpu_bf16w, cpu_build, cpu_mla, cpu_moe, cpu_ops, fused_moe, fused_moe_reference
from moe_serve.kernels.routing import RouterConfig, route_reference

needs_kernels = pytest.mark.skipif(not cpu_build.available(), reason=f"{cpu_build.unavailable_reason()}")


def _paged_cache(lens, bs, D, seed):
    """A bf16 cache whose blocks are handed out in a shuffled order, and the block table of each sequence."""
    g = torch.Generator().manual_seed(seed)
    per_seq = [(L + bs - 1) // bs for L in lens]
    num_blocks = sum(per_seq) + 3
    cache = torch.randn(num_blocks, bs, D, generator=g).bfloat16()
    perm = torch.randperm(num_blocks, generator=g).tolist()
    M = max(per_seq + [1])
    tables = torch.zeros(len(lens), M, dtype=torch.long)
    for b, n in enumerate(per_seq):
        tables[b, :n] = torch.tensor(perm[:n])
        perm = perm[n:]
    return cache, tables, torch.tensor(lens)


@needs_kernels
@pytest.mark.parametrize("lens,bs,N,C,R", [
    ([1], 16, 8, 512, 64),          # one token of context
    ([7, 16, 17, 200], 16, 8, 512, 64),  # partial, exact and multi-block contexts
    ([33, 5], 4, 3, 20, 6),          # odd head count, C not a multiple of 8 (vector tails)
    ([130], 128, 16, 64, 16),        # 16 heads: two row blocks of the score product
    ([9, 40], 16, 6, 56, 8),         # 6 heads: a full and a partial group of heads in the weighted sum
])
def test_mla_decode_equals_reference(lens, bs, N, C, R, float32_products):
    cache, tables, lens_B = _paged_cache(lens, bs, C + R, seed=len(lens) * 7 + N)
    q = torch.randn(len(lens), N, C + R) * 0.3
    scale = (C + R) ** -0.5
    out = cpu_mla.mla_decode(q, cache, tables, lens_B, C, scale)
    torch.testing.assert_close(out, cpu_mla.reference(q, cache, tables, lens_B, C, scale), rtol=1e-4, atol=1e-5)


@pytest.mark.skipif(not cpu_build.tile_rows(), reason="no bf16 products here (the AVX512-BF16 or AMX build)")
@pytest.mark.parametrize("lens,bs,N,C,R", [
    ([1], 16, 8, 512, 64),               # one token of context: a row pair with one row
    ([7, 16, 17, 200], 16, 8, 512, 64),  # odd, exact and multi-block contexts
    ([33, 5], 4, 3, 64, 32),             # 3 heads: one partial group of 8
    ([31, 2, 64], 16, 12, 32, 32),       # 12 heads: a full group and a partial one
    ([45, 96, 3], 32, 20, 64, 32),       # AMX: two passes of heads (16 + 4), rows in 16s inside blocks of 32
])
def test_mla_decode_on_the_bf16_products(lens, bs, N, C, R, float32_products):
    """With the bf16 products on, decode attention equals the reference with bf16 operands (q for the scores,
    the probabilities for the values): far closer to it than to the float32 attention. Rows scattered in a
    step's token array are read and written in place."""
    cache, tables, lens_B = _paged_cache(lens, bs, C + R, seed=len(lens) * 5 + N)
    q = torch.randn(len(lens), N, C + R) * 0.3
    scale = (C + R) ** -0.5
    exact = cpu_mla.reference(q, cache, tables, lens_B, C, scale)
    torch.testing.assert_close(cpu_mla.mla_decode(q, cache, tables, lens_B, C, scale), exact, rtol=1e-4, atol=1e-5)
    cpu_build.tile_rows(cpu_build.TILE_ROWS)
    assert cpu_mla.bf16_products(cache, C)
    out = cpu_mla.mla_decode(q, cache, tables, lens_B, C, scale)
    want = cpu_mla.reference(q, cache, tables, lens_B, C, scale, bf16_products=True)
    torch.testing.assert_close(out, want, rtol=1e-3, atol=1e-3)
    assert (out - want).abs().mean() <= 0.2 * (out - exact).abs().mean()  # equal with one cached row
    rows_B = torch.arange(len(lens)).flip(0) * 2  # sequence b in token row 2 (B - 1 - b)
    q_TND = torch.full((2 * len(lens), N, C + R), 5.0)
    q_TND[rows_B] = q
    out_TNC = torch.full((2 * len(lens), N, C), 7.0)
    cpu_mla.mla_decode_into(q_TND, cache, tables, lens_B, C, scale, rows_B, max(lens), out_TNC)
    torch.testing.assert_close(out_TNC[rows_B], out, rtol=0, atol=0)
    assert (out_TNC[1::2] == 7).all()


@pytest.mark.skipif(not cpu_build.tile_rows(), reason="no bf16 products here (the AVX512-BF16 or AMX build)")
@pytest.mark.parametrize("N,bs", [(8, 16), (3, 32), (8, 4)])
def test_mla_decode_rows_of_one_prompt_equal_each_row_alone(N, bs, float32_products):
    """The query rows of one prompt chunk (one block table, contexts 1 apart) give what each row gives alone:
    the AMX build takes two such rows a pass where there are at most 8 heads (blocks of 16 rows or more),
    which must change no product. A second sequence, a row with no context and one that ends a block sit
    among them."""
    C, R = 64, 32
    cache, tables1, _ = _paged_cache([70, 40], bs, C + R, seed=N + bs)
    lens = [60, 61, 62, 63, 64, 65, 0, 40, 66, 67, 68]
    seq = [0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0]
    tables = tables1[torch.tensor(seq)]
    lens_B = torch.tensor(lens)
    q = torch.randn(len(lens), N, C + R, generator=torch.Generator().manual_seed(5)) * 0.3
    scale = (C + R) ** -0.5
    cpu_build.tile_rows(cpu_build.TILE_ROWS)
    out = cpu_mla.mla_decode(q, cache, tables, lens_B, C, scale)
    for b in range(len(lens)):
        alone = cpu_mla.mla_decode(q[b:b + 1], cache, tables[b:b + 1], lens_B[b:b + 1], C, scale)
        assert torch.equal(out[b], alone[0]), b
    want = cpu_mla.reference(q, cache, tables, lens_B, C, scale, bf16_products=True)
    torch.testing.assert_close(out, want, rtol=1e-3, atol=1e-3)


@needs_kernels
def test_mla_decode_strided_queries_and_peaked_softmax():
    cache, tables, lens_B = _paged_cache([40, 3], 8, 72, seed=3)
    q_full = torch.randn(2, 4, 100, generator=torch.Generator().manual_seed(4)) * 30
    q = q_full[:, :, 10:82]  # head stride 100, not 72
    # scores up to ~100: probabilities near one-hot, exp underflows to 0; the scores' float32 rounding
    # (~1e-5 relative, summation order) moves the outputs (~3) by up to ~3e-5
    out = cpu_mla.mla_decode(q, cache, tables, lens_B, 64, 0.2)
    torch.testing.assert_close(out, cpu_mla.reference(q, cache, tables, lens_B, 64, 0.2), rtol=1e-4, atol=1e-4)


def test_mla_decode_refuses_a_context_longer_than_its_table():
    if not cpu_build.available():
        pytest.skip(cpu_build.unavailable_reason())
    cache, tables, _ = _paged_cache([10], 4, 16, seed=1)
    with pytest.raises(ValueError, match="does not fit"):
        cpu_mla.mla_decode(torch.randn(1, 2, 16), cache, tables, torch.tensor([13]), 8, 1.0)


@needs_kernels
@pytest.mark.parametrize("T,E,K", [(1, 8, 1), (1, 6, 4), (3, 5, 2), (40, 32, 4), (300, 7, 3)])
def test_one_call_experts_equal_reference(T, E, K):
    torch.manual_seed(T * 10 + E)
    H, I = 40, 24
    x = torch.randn(T, H)
    w13, w2 = (torch.randn(E, 2 * I, H) / 6).bfloat16(), (torch.randn(E, H, I) / 5).bfloat16()
    ids = torch.stack([torch.randperm(E)[:K] for _ in range(T)])
    ids[::3, 0] = -1  # slots on another rank
    weights = torch.rand(T, K)
    assert cpu_moe.fits(x, w13, w2)
    out = fused_moe(x, w13, w2, weights, ids)
    torch.testing.assert_close(out, fused_moe_reference(x, w13.float(), w2.float(), weights, ids),
                               rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(cpu_moe.fused_moe_bf16w(x, w13, w2, weights, ids.int()), out)  # int32 ids


@needs_kernels
@pytest.mark.parametrize("T,K,S", [(1, 2, 24), (7, 1, 40), (300, 2, 16)])
def test_one_call_experts_add_the_shared_expert(T, K, S):
    torch.manual_seed(T + S)
    E, H, I = 5, 40, 24
    x = torch.randn(T, H)
    w13, w2 = (torch.randn(E, 2 * I, H) / 6).bfloat16(), (torch.randn(E, H, I) / 5).bfloat16()
    sw13, sw2 = (torch.randn(2 * S, H) / 6).bfloat16(), (torch.randn(H, S) / 5).bfloat16()
    ids, weights = torch.stack([torch.randperm(E)[:K] for _ in range(T)]), torch.rand(T, K)
    ids[0, 0] = -1
    gate, up = F.linear(x, sw13[:S].float()), F.linear(x, sw13[S:].float())
    shared = F.linear(F.silu(gate) * up, sw2.float())
    want = fused_moe_reference(x, w13.float(), w2.float(), weights, ids) + shared
    got = cpu_moe.fused_moe_bf16w(x, w13, w2, weights, ids, sw13, sw2)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match="shared_w2 must have unit stride"):
        cpu_moe.fused_moe_bf16w(x, w13, w2, weights, ids, sw13, sw2.t())


@needs_kernels
def test_one_call_experts_reject_bad_ids_and_skip_all_minus_one():
    x, w13, w2 = torch.randn(2, 16), torch.randn(3, 16, 16).bfloat16(), torch.randn(3, 16, 8).bfloat16()
    with pytest.raises(ValueError, match=r"must lie in \[-1, 3\)"):
        fused_moe(x, w13, w2, torch.rand(2, 2), torch.tensor([[0, 1], [3, 0]]))
    out = fused_moe(x, w13, w2, torch.rand(2, 2), torch.full((2, 2), -1))
    assert out.shape == (2, 16) and (out == 0).all()


@pytest.mark.parametrize("M", [1, 5, 9])
def test_per_head_products_equal_bmm(M):
    torch.manual_seed(M)
    x = torch.randn(M, 4, 24).transpose(0, 1)  # [heads, rows, K], rows strided by heads
    w = torch.randn(4, 40, 24).bfloat16()
    torch.testing.assert_close(cpu_bf16w.bmm(x, w), torch.bmm(x, w.float().transpose(1, 2)), rtol=1e-5, atol=1e-4)


@needs_kernels
def test_kernel_threads_keep_the_cores_for_a_step_and_give_them_back():
    """Inside kernel_threads (an engine step) torch's ops run on one thread and the kernels on torch's former
    count; after it, torch has its threads back. Two Python threads calling kernels at once (the second runs its
    loops on its own thread) both get the right products."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        torch.manual_seed(1)
        x, w = torch.randn(48, 512), torch.randn(1000, 512).bfloat16()
        want = cpu_bf16w.reference(x, w)
        with cpu_build.kernel_threads():
            assert torch.get_num_threads() == 1
            assert torch.ops.moe_serve.set_kernel_threads(-1) == 2
            with cpu_build.kernel_threads():  # nested: changes nothing
                assert torch.get_num_threads() == 1
            got, errors = [], []

            def run():
                try:
                    for _ in range(30):
                        got.append(cpu_bf16w.linear(x, w))
                except Exception as err:  # noqa: BLE001 - reported below
                    errors.append(err)

            threads = [threading.Thread(target=run) for _ in range(2)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            assert not errors and len(got) == 60
            for y in got:
                torch.testing.assert_close(y, want, rtol=1e-4, atol=1e-3)
                assert torch.equal(y, got[0])
        assert torch.get_num_threads() == 2 and torch.ops.moe_serve.set_kernel_threads(-1) == 0
    finally:
        torch.set_num_threads(before)


@needs_kernels
def test_kernels_split_over_two_threads_equal_references(float32_products):
    """With two threads the large linears split their weight rows, decode attention its sequences and the
    per-head products their heads; the results must not change."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        torch.manual_seed(0)
        x, w = torch.randn(5, 512), torch.randn(1000, 512).bfloat16()  # 1000 rows: not a multiple of 8 per thread
        torch.testing.assert_close(cpu_bf16w.linear(x, w), cpu_bf16w.reference(x, w), rtol=1e-5, atol=1e-4)
        xh, wh = torch.randn(3, 8, 64).transpose(0, 1), torch.randn(8, 96, 64).bfloat16()
        torch.testing.assert_close(cpu_bf16w.bmm(xh, wh), torch.bmm(xh, wh.float().transpose(1, 2)),
                                   rtol=1e-5, atol=1e-4)
        cache, tables, lens_B = _paged_cache([5, 40, 17, 1, 90], 16, 72, seed=5)
        q = torch.randn(5, 4, 72)
        torch.testing.assert_close(cpu_mla.mla_decode(q, cache, tables, lens_B, 64, 0.1),
                                   cpu_mla.reference(q, cache, tables, lens_B, 64, 0.1), rtol=1e-4, atol=1e-5)
        E, H, I = 4, 256, 256  # w13 [512, 256] and w2 [256, 256]: large enough to split
        xm = torch.randn(9, H)
        w13, w2 = (torch.randn(E, 2 * I, H) / 16).bfloat16(), (torch.randn(E, H, I) / 16).bfloat16()
        ids, weights = torch.randint(0, E, (9, 1)), torch.rand(9, 1)
        torch.testing.assert_close(cpu_moe.fused_moe_bf16w(xm, w13, w2, weights, ids),
                                   fused_moe_reference(xm, w13.float(), w2.float(), weights, ids), rtol=1e-4, atol=1e-5)
        # many experts' chunks and the shared expert's: threads take whole chunks, a token's sum in a fixed order
        T, K, S = 300, 3, 40
        xm, ids = torch.randn(T, H), torch.stack([torch.randperm(E)[:K] for _ in range(T)])
        ids[::5, 1] = -1
        weights = torch.rand(T, K)
        sw13, sw2 = (torch.randn(2 * S, H) / 16).bfloat16(), (torch.randn(H, S) / 16).bfloat16()
        shared = F.linear(F.silu(F.linear(xm, sw13[:S].float())) * F.linear(xm, sw13[S:].float()), sw2.float())
        got = cpu_moe.fused_moe_bf16w(xm, w13, w2, weights, ids, sw13, sw2)
        torch.testing.assert_close(got, fused_moe_reference(xm, w13.float(), w2.float(), weights, ids) + shared,
                                   rtol=1e-4, atol=1e-5)
        assert torch.equal(got, cpu_moe.fused_moe_bf16w(xm, w13, w2, weights, ids, sw13, sw2))  # deterministic
    finally:
        torch.set_num_threads(before)


@needs_kernels
@pytest.mark.parametrize("T,D", [(1, 512), (5, 37), (3, 8)])
def test_rms_norm_equals_reference(T, D):
    torch.manual_seed(D)
    x, w = torch.randn(T, D) * 3, torch.randn(D)
    torch.testing.assert_close(cpu_ops.rms_norm(x, w, 1e-6), cpu_ops.rms_norm_reference(x, w, 1e-6))
    x3 = torch.randn(2, T, D + 4)[..., :D]  # leading dims, rows strided
    torch.testing.assert_close(cpu_ops.rms_norm(x3, w, 1e-5), cpu_ops.rms_norm_reference(x3, w, 1e-5))


@needs_kernels
@pytest.mark.parametrize("interleaved", [True, False])
def test_rope_equals_reference(interleaved):
    torch.manual_seed(1)
    T, N, R = 4, 3, 16
    x = torch.randn(T, N, 24 + R)[..., 24:]  # the rope tail of each head, as MLA splits it
    cos, sin = torch.randn(T, R // 2), torch.randn(T, R // 2)
    torch.testing.assert_close(cpu_ops.rope(x, cos, sin, interleaved), cpu_ops.rope_reference(x, cos, sin, interleaved))


@needs_kernels
@pytest.mark.parametrize("E,G,topk_group,K,bias,T,H", [
    (32, 4, 2, 4, True, 20, 24), (16, 1, 1, 3, False, 20, 24), (12, 6, 3, 1, True, 20, 24),  # H 24: vector loop + tail
    (64, 8, 4, 8, True, 20, 24),
    (14, 7, 3, 2, True, 301, 200),  # partial blocks of tokens and experts; enough work for two threads
])
def test_router_equals_reference(E, G, topk_group, K, bias, T, H):
    torch.manual_seed(E + K)
    rc = RouterConfig(num_experts=E, top_k=K, topk_method="noaux_tc", scoring_func="sigmoid", num_groups=G,
                      topk_group=topk_group, norm_topk_prob=True, routed_scaling_factor=2.5)
    x, gate = torch.randn(T, H), torch.randn(E, H) / 4
    bias_E = torch.randn(E) * 0.1 if bias else None
    want_w, want_ids = route_reference(x, gate, bias_E, rc)
    assert cpu_ops.route_fits(x, gate, bias_E, G, topk_group, K)
    got_w, got_ids = cpu_ops.route_noaux_tc(x, gate, bias_E, G, topk_group, K, True, 2.5)
    assert got_ids.dtype == torch.int64 and got_w.dtype == torch.float32
    # same experts per token (the kernel lists them best first; torch's order is unspecified), same weights
    want_order, got_order = want_ids.argsort(dim=1), got_ids.argsort(dim=1)
    assert torch.equal(want_ids.gather(1, want_order), got_ids.gather(1, got_order))
    torch.testing.assert_close(got_w.gather(1, got_order), want_w.gather(1, want_order))


@needs_kernels
def test_mla_decode_into_token_rows():
    """Decode rows scattered in a step's token array are read and written in place; other rows untouched."""
    cache, tables, lens_B = _paged_cache([9, 30, 2], 8, 40, seed=11)
    q_TND = torch.randn(5, 2, 40)
    rows_B = torch.tensor([3, 0, 4])
    out_TNC = torch.full((5, 2, 32), 7.0)
    cpu_mla.mla_decode_into(q_TND, cache, tables, lens_B, 32, 0.3, rows_B, 30, out_TNC)
    want = cpu_mla.reference(q_TND[rows_B], cache, tables, lens_B, 32, 0.3)
    torch.testing.assert_close(out_TNC[rows_B], want, rtol=1e-4, atol=1e-5)
    assert (out_TNC[[1, 2]] == 7).all()


@needs_kernels
@pytest.mark.parametrize("interleaved", [True, False])
def test_mla_cache_write_equals_reference(interleaved):
    torch.manual_seed(2)
    T, C, R = 3, 40, 8
    kv = torch.randn(T, C + R + 5)[:, : C + R]  # rows strided, as a slice would be
    w, cos, sin = torch.randn(C), torch.randn(T, R // 2), torch.randn(T, R // 2)
    slots = torch.tensor([5, 0, 9])
    got, want = torch.zeros(3, 4, C + R).bfloat16(), torch.zeros(3, 4, C + R).bfloat16()
    cpu_ops.mla_cache_write(kv, w, 1e-6, cos, sin, interleaved, got, slots)
    cpu_ops.mla_cache_write_reference(kv, w, 1e-6, cos, sin, interleaved, want, slots)
    assert (got.float() - want.float()).abs().max() <= want.float().abs().max() * 2**-8  # one bf16 ulp at most
    assert got.view(-1, C + R)[[1, 2, 3, 4, 6, 7, 8, 10, 11]].eq(0).all()  # other slots untouched


@needs_kernels
@pytest.mark.parametrize("preset,overrides,fused_layers", [
    ("v3", None, [0, 1, 2, 3]),                       # dense first layer, then routed + shared experts
    ("v3", {"n_shared_experts": 0}, [0, 1, 2, 3]),    # routed experts alone
    ("v2", None, [0]),                                # q without compression; softmax routing stays layer by layer
])
def test_decode_layer_kernel_equals_the_layer_by_layer_path(tmp_path, monkeypatch, preset, overrides, fused_layers,
                                                            float32_products):
    """All-decode steps run each layer in one C call (kernels/cpu_decode_layer.py) where it can: the same
    greedy tokens, logprobs and recorded expert load as the model's layer-by-layer kernel calls. Products in
    float32: with bf16 ones a last-bit difference (the C SiLU's exp against torch's) can move a bf16 rounding."""
    from moe_serve.kernels.cpu_decode_layer import DecodeLayerKernel
    from moe_serve.moe.tiny import make_checkpoint
    from moe_serve.server import LLM, SamplingParams

    ckpt = make_checkpoint(tmp_path / preset, preset, dtype="bfloat16", overrides=overrides)
    fused, plain = (LLM(ckpt, dtype="bfloat16", kernel_backend="cpu", max_num_batched_tokens=16) for _ in range(2))
    layers = fused.engine.runner.model.model.layers
    assert [i for i, layer in enumerate(layers) if layer.fast_decode is not None] == fused_layers
    for layer in plain.engine.runner.model.model.layers:
        layer.fast_decode = None
    calls = []
    monkeypatch.setattr(DecodeLayerKernel, "forward",
                        lambda self, x, *a, _f=DecodeLayerKernel.forward: calls.append(x.shape[0]) or _f(self, x, *a))
    for llm in (fused, plain):
        llm.engine.enable_expert_load_recording(1000)
    prompts = ["Hello", "The quick brown fox jumps over the lazy dog.", "1 2 3 4 5"]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=1)
    got, want = fused.generate(prompts, params), plain.generate(prompts, params)
    # decode steps of all three sequences went through it, and where every layer has the path, the prompt
    # chunks (16 tokens) as decode rows (FusedDecodeLayer.chunk_rows; the plain model keeps the runner's limit,
    # so both run the same forms)
    assert len(prompts) in calls and (16 in calls) == (len(fused_layers) == len(layers))
    for a, b in zip(got, want):
        a, b = a.outputs[0], b.outputs[0]
        assert a.token_ids == b.token_ids
        for t, step_a, step_b in zip(a.token_ids, a.logprobs, b.logprobs):
            assert abs(step_a[t] - step_b[t]) < 1e-4
    if preset == "v3":
        assert fused.expert_load("total") == plain.expert_load("total")


@needs_kernels
def test_decode_layer_kernel_takes_a_long_step_in_blocks_of_rows(tmp_path, monkeypatch, float32_products):
    """A step of more rows than the C layer's attention takes at once (ATTENTION_ROWS, 256, in
    csrc/decode_layer.cpp) goes through it in blocks, one prompt's rows split between two of them: the same
    greedy tokens and logprobs as the layer-by-layer path, which takes every row at once."""
    from moe_serve.kernels.cpu_decode_layer import DecodeLayerKernel
    from moe_serve.moe.tiny import make_checkpoint
    from moe_serve.server import LLM, SamplingParams

    ckpt = make_checkpoint(tmp_path / "v3", "v3", dtype="bfloat16")
    fused, plain = (LLM(ckpt, dtype="bfloat16", kernel_backend="cpu", max_num_batched_tokens=1024) for _ in range(2))
    for layer in plain.engine.runner.model.model.layers:
        layer.fast_decode = None
    calls = []
    monkeypatch.setattr(DecodeLayerKernel, "forward",
                        lambda self, x, *a, _f=DecodeLayerKernel.forward: calls.append(x.shape[0]) or _f(self, x, *a))
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 200, (n,), generator=g).tolist() for n in (200, 180, 150)]  # rows 200-379 straddle 256
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, logprobs=1)
    got, want = fused.generate(prompts, params), plain.generate(prompts, params)
    assert 530 in calls  # the three prompts in one step, through the C layer
    for a, b in zip(got, want):
        a, b = a.outputs[0], b.outputs[0]
        assert a.token_ids == b.token_ids
        for t, step_a, step_b in zip(a.token_ids, a.logprobs, b.logprobs):
            # float32 sums in another order (the AVX2 build's products split rows by their count): up to 1.5e-4
            # measured; a query reading a wrong context moves them by far more
            assert abs(step_a[t] - step_b[t]) < 1e-3


@needs_kernels
def test_decode_layer_kernel_refuses_weights_it_cannot_take():
    from moe_serve.kernels.cpu_decode_layer import DecodeLayerKernel, LayerWeights, Router

    H, Qr, N, Dn, R, Dv, C, E, I = 16, 12, 2, 8, 4, 8, 16, 4, 8
    bf = lambda *shape: torch.randn(*shape).bfloat16()  # noqa: E731
    ones = lambda n: (torch.ones(n), 1e-6)  # noqa: E731

    def weights(**change):
        fields = dict(in_norm=ones(H), q_a=bf(Qr, H), q_a_norm=ones(Qr), q_b=bf(N * (Dn + R), Qr), kv_a=bf(C + R, H),
                      kv_a_norm=ones(C), w_uk_NCD=bf(N, C, Dn), w_uv_NVC=bf(N, Dv, C), o=bf(H, N * Dv),
                      softmax_scale=0.2, rope_interleaved=True, post_norm=ones(H),
                      router=Router(torch.randn(E, H), None, 2, 1, 2, True, 1.0), w13=bf(E, 2 * I, H),
                      w2=bf(E, H, I), mlp_w13=bf(2 * I, H), mlp_w2=bf(H, I))
        return LayerWeights(**{**fields, **change})

    assert DecodeLayerKernel(weights()).top_k == 2
    for change, match in [({"o": bf(H, N * Dv + 1)}, r"o must be \[16, 16\], got \[16, 17\]"),
                          ({"w2": bf(E, I, H).transpose(1, 2)}, "w2 must have unit stride in its last dim"),
                          ({"q_b": torch.randn(N * (Dn + R), Qr)}, "q_b must be BFloat16 or Float8_e4m3fn, got Float"),
                          ({"o_scale": torch.ones(2, 2)}, "o is bfloat16: it takes no scale"),
                          ({"router": Router(torch.randn(E, H), None, 3, 1, 2, True, 1.0)}, "routing 2 of 4 experts"),
                          ({"router": Router(torch.randn(E, H), None, 2, 1, 3, True, 1.0)}, "routing 3 of 4 experts"),
                          ({"router": None, "mlp_w13": None, "mlp_w2": None}, "needs routed experts or a dense MLP")]:
        with pytest.raises(ValueError, match=match):
            DecodeLayerKernel(weights(**change))
