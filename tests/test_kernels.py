"""Fused MoE kernels against the plain per-expert loop in kernels/reference.py.

Without a GPU the Triton kernels run in Triton's CPU interpreter: TRITON_INTERPRET=1 is set here, before
anything imports triton (the @triton.jit decorator reads it). The interpreter has known numeric gaps,
so the stated tolerances are looser than a GPU needs:
  * its tl.dot multiplies bf16 bit patterns (triton-lang/triton#11584): the kernel widens bf16 operands to
    float32 there (UPCAST_DOT), so the bf16 cases test everything but the bf16 MMA itself;
  * float32 -> bf16 casts truncate instead of rounding to nearest even (one bf16 ulp, 2^-8, per store);
  * float32 -> fp8 casts round wrongly (triton-lang/triton#8322): the quant kernel rounds onto the e4m3
    grid in float32 first there (ROUND_ON_GRID). fp8 tl.dot itself works (operands go through float16).
Tolerances, as max |out - ref| / max |ref|: float32 1e-4; bf16 2e-2; fp8 w8a8 4e-2 against the reference
with the same per-token-group activation quant (quant_act=True) and 1e-1 against the unquantized one.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # must precede the first triton import

from moe_serve import kernels  # noqa: E402
from moe_serve.kernels import dequant_fp8_block, fused_moe, fused_moe_reference, moe_align_block_size  # noqa: E402
from moe_serve.kernels.fused_moe_torch import fused_moe_torch  # noqa: E402
from moe_serve.kernels.moe_configs import config_file_name, default_config, get_config  # noqa: E402
from moe_serve.kernels.reference import FP8_DTYPE, FP8_MAX, quant_fp8_per_token_group_reference  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
try:
    import triton  # noqa: F401
except Exception as e:  # triton missing or broken: the torch path is still tested
    triton_path, TRITON_SKIP = None, f"triton does not import: {e!r}"
else:
    from moe_serve.kernels import fused_moe_triton as triton_path

    runs_here = DEVICE == "cuda" or triton_path._INTERPRETED
    TRITON_SKIP = None if runs_here else "kernels.fused_moe_triton was imported before TRITON_INTERPRET=1"
needs_triton = pytest.mark.skipif(TRITON_SKIP is not None, reason=str(TRITON_SKIP))

# name: (T tokens, H hidden, I intermediate, E experts, K top-k, share of -1 ids, expert left empty)
CASES = {
    "one_token_K1": (1, 64, 32, 4, 1, 0.0, None),
    "K8_E12_minus1": (10, 64, 32, 12, 8, 0.3, 5),
    "ragged_T13_E6": (13, 64, 32, 6, 2, 0.0, 3),
    "several_blocks_per_expert": (37, 64, 32, 6, 4, 0.1, 0),
    "odd_H72_I20": (9, 72, 20, 6, 3, 0.2, 1),  # masked N and K; bf16 rows of 40 bytes miss _grouped_mm
    "all_minus1": (5, 64, 32, 4, 2, 1.0, None),
}
TOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2}


def make_inputs(T, H, I, E, K, minus1, empty, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    x_TH = torch.randn(T, H, generator=g)
    w13_E2IH = torch.randn(E, 2 * I, H, generator=g) / math.sqrt(H)
    w2_EHI = torch.randn(E, H, I, generator=g) / math.sqrt(I)
    experts = torch.tensor([e for e in range(E) if e != empty])
    ids_TK = torch.stack([experts[torch.randperm(len(experts), generator=g)[:K]] for _ in range(T)])
    ids_TK[torch.rand(T, K, generator=g) < minus1] = -1
    weights_TK = torch.rand(T, K, generator=g)
    cast = lambda t: t.to(dtype).to(DEVICE)  # noqa: E731
    return cast(x_TH), cast(w13_E2IH), cast(w2_EHI), weights_TK.to(DEVICE), ids_TK.to(DEVICE)


def rel_err(out, ref) -> float:
    return ((out.float() - ref.float()).abs().max() / ref.float().abs().max().clamp(min=1e-6)).item()


def quant_weight_fp8(w_EOD, block=(128, 128)):
    """Block-quantize float weights the way DeepSeek-V3 checkpoints are stored (real = fp8 * scale)."""
    E, O, D = w_EOD.shape
    ob, db = math.ceil(O / block[0]), math.ceil(D / block[1])
    padded = torch.zeros(E, ob * block[0], db * block[1])
    padded[:, :O, :D] = w_EOD
    scale = padded.view(E, ob, block[0], db, block[1]).abs().amax(dim=(2, 4)).clamp(min=1e-12) / FP8_MAX
    full = scale.repeat_interleave(block[0], 1).repeat_interleave(block[1], 2)[:, :O, :D]
    return (w_EOD / full).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale


def test_kernels_is_this_repo_package():
    # `kernels` is also a PyPI package (pulled in by transformers 5.x); make sure we test ours.
    assert kernels.__file__ is not None and Path(kernels.__file__).resolve().is_relative_to(REPO), kernels.__file__


def test_align_worked_example():
    # pairs 0..5 = (token, slot) of [[2, 0], [-1, 2], [0, 2]]; expert 0 gets pairs 1, 4; expert 2 gets
    # 0, 3, 5 padded to 4 with the sentinel 6 = T * K; pair 2 (id -1) is left out; P = 6 + 4 * (2 - 1).
    ids = torch.tensor([[2, 0], [-1, 2], [0, 2]])
    sorted_ids, expert_ids, num_post = moe_align_block_size(ids, block_m=2, num_experts=4)
    assert sorted_ids.tolist() == [1, 4, 0, 3, 5, 6, 6, 6, 6, 6]
    assert expert_ids.tolist() == [0, 2, 2, -1, -1]
    assert num_post.tolist() == [6]


@pytest.mark.parametrize("block_m", [1, 4, 16])
def test_align_random(block_m):
    T, K, E = 29, 3, 7
    ids = torch.randint(-1, E, (T, K), generator=torch.Generator().manual_seed(block_m))
    sorted_ids, expert_ids, num_post = moe_align_block_size(ids.int(), block_m, E)
    n = int(num_post)
    assert n % block_m == 0 and sorted_ids.numel() == expert_ids.numel() * block_m
    real = sorted_ids[:n][sorted_ids[:n] < T * K]
    assert sorted(real.tolist()) == [p for p in range(T * K) if ids.view(-1)[p] >= 0]
    assert (sorted_ids[n:] == T * K).all() and (expert_ids[n // block_m :] == -1).all()
    for b in range(n // block_m):
        pairs = sorted_ids[b * block_m : (b + 1) * block_m]
        pairs = pairs[pairs < T * K]
        assert len(pairs) > 0 and (ids.view(-1)[pairs.long()] == expert_ids[b]).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", CASES)
def test_torch_path_matches_reference(case, dtype):
    args = make_inputs(*CASES[case], dtype=dtype)
    out = fused_moe(*args, backend="torch")
    assert out.dtype == dtype and out.shape == args[0].shape
    assert rel_err(out, fused_moe_reference(*args)) <= TOL[dtype]


def test_torch_path_row_chunks_split_experts(monkeypatch):
    monkeypatch.setattr("moe_serve.kernels.fused_moe_torch.SCRATCH_BYTES", 0)
    monkeypatch.setattr("moe_serve.kernels.fused_moe_torch.MIN_CHUNK_ROWS", 7)  # 7-row chunks cut through experts
    for dtype in TOL:
        args = make_inputs(*CASES["several_blocks_per_expert"], dtype=dtype)
        assert rel_err(fused_moe_torch(*args), fused_moe_reference(*args)) <= TOL[dtype]


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", CASES)
def test_triton_path_matches_reference(case, dtype):
    args = make_inputs(*CASES[case], dtype=dtype)
    out = fused_moe(*args, backend="triton")
    assert out.dtype == dtype and out.shape == args[0].shape
    assert rel_err(out, fused_moe_reference(*args)) <= TOL[dtype]


@needs_triton
@pytest.mark.parametrize("blocks", [(16, 32, 32, 1), (32, 16, 16, 4)], ids=["m16n32k32g1", "m32n16k16g4"])
def test_triton_block_sizes(blocks):
    bm, bn, bk, gm = blocks
    config = dict(BLOCK_SIZE_M=bm, BLOCK_SIZE_N=bn, BLOCK_SIZE_K=bk, GROUP_SIZE_M=gm, num_warps=4, num_stages=2)
    args = make_inputs(*CASES["several_blocks_per_expert"], seed=1)
    out = triton_path.fused_moe_triton(*args, config=config)
    assert rel_err(out, fused_moe_reference(*args)) <= 1e-4


@pytest.mark.parametrize("backend", [None, "torch", pytest.param("triton", marks=needs_triton)])
def test_zero_tokens(backend):
    x, w13, w2, weights, ids = make_inputs(4, 64, 32, 4, 2, 0.0, None)
    out = fused_moe(x[:0], w13, w2, weights[:0], ids[:0], backend=backend)
    assert out.shape == (0, 64) and out.dtype == x.dtype


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=needs_triton)])
def test_int32_ids_and_default_backend(backend):
    x, w13, w2, weights, ids = make_inputs(*CASES["ragged_T13_E6"])
    out = fused_moe(x, w13, w2, weights, ids.int(), backend=backend)
    ref = fused_moe_reference(x, w13, w2, weights, ids)
    assert rel_err(out, ref) <= 1e-4
    if DEVICE == "cpu":
        assert torch.equal(fused_moe(x, w13, w2, weights, ids), fused_moe(x, w13, w2, weights, ids, backend="torch"))


# name: (T, H, I, E, K, share of -1 ids, empty expert); H = 192 and I = 96 leave partial 128-blocks.
FP8_CASES = {"full_blocks": (13, 256, 128, 6, 3, 0.2, 2), "partial_blocks_K8": (5, 192, 96, 12, 8, 0.3, None)}


def make_fp8_inputs(case):
    x, w13, w2, weights, ids = make_inputs(*FP8_CASES[case], seed=2)
    (w13_q, w13_s), (w2_q, w2_s) = quant_weight_fp8(w13.cpu()), quant_weight_fp8(w2.cpu())
    scales = dict(w13_scale=w13_s.to(DEVICE), w2_scale=w2_s.to(DEVICE), block_shape=[128, 128])
    return (x.bfloat16(), w13_q.to(DEVICE), w2_q.to(DEVICE), weights, ids), scales


@pytest.mark.parametrize("case", FP8_CASES)
def test_torch_path_fp8_weights(case):
    args, scales = make_fp8_inputs(case)  # torch path: dequantized weights, bf16 activations
    assert rel_err(fused_moe(*args, backend="torch", **scales), fused_moe_reference(*args, **scales)) <= 2e-2


@needs_triton
@pytest.mark.parametrize("case", FP8_CASES)
def test_triton_path_fp8_w8a8(case):
    args, scales = make_fp8_inputs(case)
    out = fused_moe(*args, backend="triton", **scales)
    assert out.dtype == torch.bfloat16
    assert rel_err(out, fused_moe_reference(*args, quant_act=True, **scales)) <= 4e-2
    assert rel_err(out, fused_moe_reference(*args, **scales)) <= 1e-1


@needs_triton
def test_fp8_activation_quant_kernel():
    from moe_serve.kernels.fp8_quant_triton import quant_fp8_per_token_group

    x = torch.randn(7, 200, generator=torch.Generator().manual_seed(3)) * 5
    x[2, :128] = 0  # an all-zero group gets the eps scale, not a division by zero
    q, scale = quant_fp8_per_token_group(x.to(DEVICE), group_size=128)
    q_ref, scale_ref = quant_fp8_per_token_group_reference(x, group_size=128)
    assert scale.shape == (7, 2) and torch.allclose(scale.cpu(), scale_ref, rtol=1e-6, atol=0)
    assert (q.cpu().float() == q_ref.float()).float().mean() >= 0.99  # a GPU's fp32 divide may flip a tie
    assert torch.allclose(q.cpu().float(), q_ref.float(), rtol=0.125, atol=0)


def test_dequant_fp8_block_partial_blocks():
    w = torch.ones(1, 3, 5).to(FP8_DTYPE)
    scale = torch.tensor([[[1.0, 2.0], [3.0, 4.0]]])
    out = dequant_fp8_block(w, scale, (2, 4))
    assert out[0].tolist() == [[1, 1, 1, 1, 2], [1, 1, 1, 1, 2], [3, 3, 3, 3, 4]]
    with pytest.raises(ValueError, match="expected"):
        dequant_fp8_block(w, scale[:, :1], (2, 4))


def test_bad_inputs_say_what_is_wrong():
    x, w13, w2, weights, ids = make_inputs(*CASES["ragged_T13_E6"])
    with pytest.raises(ValueError, match="should be \\[E, 2I, H\\]"):
        fused_moe(x, w13[:, :-1], w2, weights, ids)
    with pytest.raises(ValueError, match="must both be \\[T=13, K\\]"):
        fused_moe(x, w13, w2, weights[:, :1], ids)
    with pytest.raises(ValueError, match="backend"):
        fused_moe(x, w13, w2, weights, ids, backend="cuda")
    with pytest.raises(ValueError, match=r"must lie in \[-1, 6\)"):
        fused_moe(x, w13, w2, weights, torch.full_like(ids, 6), backend="torch")
    with pytest.raises(TypeError, match="float8_e4m3fn"):
        fused_moe(x, w13, w2, weights, ids, w13_scale=torch.ones(1), w2_scale=torch.ones(1))


def test_config_tables(tmp_path):
    name = config_file_name(6, 32, 64, "NVIDIA_H200", "bf16")
    assert name == "E=6,N=32,K=64,device_name=NVIDIA_H200,dtype=bf16.json"
    small = dict(BLOCK_SIZE_M=16, BLOCK_SIZE_N=32, BLOCK_SIZE_K=64, GROUP_SIZE_M=1, num_warps=4, num_stages=3)
    big = dict(small, BLOCK_SIZE_M=128, GROUP_SIZE_M=16)
    (tmp_path / name).write_text(json.dumps({"1": small, "1024": big}))
    lookup = dict(E=6, N=32, K=64, dtype="bf16", device="NVIDIA_H200", config_dir=tmp_path)
    assert get_config(M=8, **lookup) == small and get_config(M=900, **lookup) == big
    assert get_config(M=8, **dict(lookup, dtype="fp32")) == default_config(8, 6)
    fp8 = default_config(4096, 256, fp8_block_shape=(128, 128))
    assert 128 % fp8["BLOCK_SIZE_K"] == 0
