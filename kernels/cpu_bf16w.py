"""Linear layers with bf16 or block-FP8 weights and float32 activations on CPU: how `--dtype bfloat16` (and
an FP8 checkpoint) computes on a CPU without bf16 arithmetic (the cpu kernel backend, kernels/backend_cpu.py).

There torch's bf16 matmuls are scalar loops, so the model computes in float32 while its linear and expert
weights stay bf16: half the memory, and at decode sizes, where a linear reads its whole weight for a few
rows, half the bytes. Up to MAX_ROWS rows go through csrc/linear_bf16w.cpp, an AVX2 kernel that widens the
weight in registers: 1.8-2.7x faster than the same weight held in float32 through MKL at 1-8 rows and 1.4x
at 16, one thread (scripts/bench_linear.py --bf16-weights; docs/benchmarks.md). On one thread MKL on a
widened copy catches up with it at 48-64 rows; on two, the kernel (splitting weight rows) stays ahead to a
few hundred rows: a 256-token prompt chunk of the benchmark model ran 7% faster with the kernel than with
MKL beyond 40 rows (docs/benchmarks.md, run 6). Beyond MAX_ROWS the weight is widened to a float32 copy for
F.linear (MKL). The reference is F.linear(x, w.float(), b).

FP8 weights (float8_e4m3fn [O, K] with DeepSeek-V3's float32 block scales `scale_inv` [ceil(O / bo),
ceil(K / bk)], `block` = (bo, bk), both multiples of 8) go through csrc/linear_fp8w.cpp the same way, a
quarter of float32's bytes; the reference is F.linear on the dequantised weight (kernels.reference.
dequant_fp8_block), which the kernel equals up to the order of float32 sums. On the AVX512-BF16 build, for
a model served in bf16 (cpu_build.fp8_tiles()), FP8 products take the bf16 dot products too, x rounded to bf16 and
the weight widened exactly: those of cpu_build.tile_rows()+ rows in blocks of a multiple of 16 rows, and those of
any number of rows (decode) where K and the blocks' columns are multiples of 32 (`tiles_take`, `reference`).

kernels/cpu_build.py builds the kernels as torch ops (torch.ops.moe_serve.mm_wt / bmm_wt). Without a
compiler, or on a CPU without AVX2, FMA and F16C, every call takes the reference path: the same results,
slower.

Legend: M rows, K in features, O out features, B batch (heads)."""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from moe_serve.kernels import cpu_build
from moe_serve.kernels.reference import dequant_fp8_block

MAX_ROWS = 512  # beyond, MKL on a widened copy is faster (65 vs 54 GFLOP/s at 2048 rows, two threads)
Block = tuple[int, int]


def available() -> bool:
    return cpu_build.available()


def _dense(w: torch.Tensor, scale_inv: torch.Tensor | None, block: Block | None) -> torch.Tensor:
    """The weight in float32: widened, or dequantised from FP8."""
    if scale_inv is None:
        return w.float()
    if block is None:
        raise ValueError("an FP8 weight needs its block shape (block=(rows, cols)) with its scale_inv")
    return dequant_fp8_block(w, scale_inv, block)


def tiles_take(rows: int, K: int, O: int, scale_inv: torch.Tensor | None = None, block: Block | None = None) -> bool:
    """Whether the kernel runs a product of `rows` rows by this weight in bf16, rounding x (the AMX tiles,
    csrc/linear_amx.cpp, or AVX512-BF16 dot products, csrc/linear_dpbf16.cpp). A bf16 weight: K a multiple of 32,
    O of 16, at least cpu_build.tile_rows() rows. An FP8 one only where cpu_build.fp8_tiles() (AVX512-BF16, a model
    served in bf16): as a bf16 weight where its blocks are a multiple of 16 rows (each block of 32 weight rows
    widened to bf16 exactly), and at any number of rows where K and the blocks' columns are multiples of 32
    (fp8_decode_dp: 32 weights at a time widened in registers, along K). Each block of inputs' sum is scaled."""
    tiles = cpu_build.tile_rows()
    if scale_inv is None:
        return 0 < tiles <= rows and K % 32 == 0 and O % 16 == 0
    if block is None or not tiles or not cpu_build.fp8_tiles() or K % 32:
        return False
    return block[1] % 32 == 0 or (tiles <= rows and block[0] % 16 == 0 and O % 16 == 0)


def reference(x_MK: torch.Tensor, w_OK: torch.Tensor, bias_O: torch.Tensor | None = None,
              scale_inv: torch.Tensor | None = None, block: Block | None = None) -> torch.Tensor:
    """What the kernel computes, in torch: F.linear on the widened weight, of x rounded to bf16 where the
    product goes to the tiles (AMX or AVX512-BF16)."""
    rows = x_MK.numel() // max(1, x_MK.shape[-1])
    if tiles_take(rows, w_OK.shape[1], w_OK.shape[0], scale_inv, block):
        x_MK = x_MK.bfloat16().float()
    return F.linear(x_MK, _dense(w_OK, scale_inv, block), None if bias_O is None else bias_O.float())


def _weight_fits(w: torch.Tensor, scale_inv: torch.Tensor | None) -> bool:
    """A bf16 weight without scales or an FP8 one with float32 scales, unit stride in K, on CPU."""
    narrow = torch.bfloat16 if scale_inv is None else torch.float8_e4m3fn
    return (w.dtype == narrow and w.is_cpu and w.stride(-1) == 1
            and (scale_inv is None or scale_inv.dtype == torch.float32))


def _fits(x_MK: torch.Tensor, w_OK: torch.Tensor, scale_inv: torch.Tensor | None = None,
          block: Block | None = None) -> bool:
    """Whether x w^T can go through the C kernel: float32 x with unit column stride, a bf16 (or FP8) w with
    unit stride in K, 1 to MAX_ROWS rows (any number that the AMX tiles take), on CPU, and the kernels built."""
    rows = x_MK.shape[0]
    return (0 < rows and x_MK.dtype == torch.float32 and x_MK.is_cpu and x_MK.stride(1) == 1
            and _weight_fits(w_OK, scale_inv) and available()
            and (rows <= MAX_ROWS or tiles_take(rows, w_OK.shape[1], w_OK.shape[0], scale_inv, block)))


def _block(scale_inv: torch.Tensor | None, block: Block | None) -> list[int]:
    if scale_inv is None:
        return []
    if block is None:
        raise ValueError("an FP8 weight needs its block shape (block=(rows, cols)) with its scale_inv")
    return list(block)


def linear(x_TK: torch.Tensor, w_OK: torch.Tensor, bias_O: torch.Tensor | None = None,
           scale_inv: torch.Tensor | None = None, block: Block | None = None) -> torch.Tensor:
    """x W^T (+ b) for float32 x (any leading dims) and a bf16 weight, or an FP8 one with its block scales
    (scale_inv, block); float32 out."""
    rows_MK = x_TK if x_TK.dim() == 2 else x_TK.reshape(-1, x_TK.shape[-1])
    if rows_MK.stride(-1) != 1:
        rows_MK = rows_MK.contiguous()
    if not _fits(rows_MK, w_OK, scale_inv, block):
        return reference(x_TK, w_OK, bias_O, scale_inv, block)
    y_MO = rows_MK.new_empty(rows_MK.shape[0], w_OK.shape[0])
    torch.ops.moe_serve.mm_wt(rows_MK, w_OK, scale_inv, _block(scale_inv, block), y_MO)
    if bias_O is not None:
        y_MO += bias_O
    return y_MO if x_TK.dim() == 2 else y_MO.view(*x_TK.shape[:-1], w_OK.shape[0])


def kernel_row_limit(shapes_OK: list[tuple[int, int]], candidates: tuple[int, ...] = (64, 128, 256, 512),
                     repeats: int = 3) -> int:
    """The most rows for which the kernel is at least as fast as MKL on a widened copy, measured on this
    machine for these bf16 weight shapes (their times summed); rows above that go to MKL.

    Where the two cross differs between machines: on one AVX2 VM the kernel led up to a few hundred rows
    (docs/benchmarks.md, run 6), on another MKL on the widened copy was 5-40% faster from 128-256 rows
    (2026-12-05). Measured once, when the backend prepares the model (well under a second for the
    benchmark model's shapes, milliseconds for tiny ones)."""
    if not available() or not shapes_OK:
        return MAX_ROWS
    if cpu_build.tile_rows():  # bf16 products (AMX or AVX512-BF16): measured against MKL up to 2048 rows too
        candidates = candidates + (1024, 2048)
    gen = torch.Generator().manual_seed(0)

    def best(fn) -> float:
        fn()
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return min(times)

    limit = candidates[0]
    for rows in candidates:
        kernel_s = mkl_s = 0.0
        for O, K in shapes_OK:
            x = torch.randn(rows, K, generator=gen)
            w = torch.randn(O, K, generator=gen).to(torch.bfloat16)
            kernel_s += best(lambda: linear(x, w))
            mkl_s += best(lambda: F.linear(x, w.float()))
        if mkl_s < 0.95 * kernel_s:
            return limit
        limit = rows
    return limit if limit <= MAX_ROWS else 1 << 30  # the tiles lead at every size: no limit


def mm_into(x_MK: torch.Tensor, w_OK: torch.Tensor, out_MO: torch.Tensor, scale_inv: torch.Tensor | None = None,
            block: Block | None = None) -> None:
    """out = x w^T for float32 x and out and a bf16 (or FP8) w (an expert's GEMM in kernels/fused_moe_torch.py)."""
    if _fits(x_MK, w_OK, scale_inv, block) and out_MO.dtype == torch.float32 and out_MO.stride(1) == 1:
        torch.ops.moe_serve.mm_wt(x_MK, w_OK, scale_inv, _block(scale_inv, block), out_MO)
    else:
        torch.mm(x_MK, _dense(w_OK, scale_inv, block).t(), out=out_MO)


def bmm(x_BMK: torch.Tensor, w_BOK: torch.Tensor, scale_inv: torch.Tensor | None = None,
        block: Block | None = None) -> torch.Tensor:
    """out[b] = x[b] w[b]^T for float32 x and a bf16 w, or an FP8 one with scales [B, ceil(O / bo),
    ceil(K / bk)] (per-head weights: MLA's W_UK / W_UV absorption); float32 out [B, M, O]. Each head's product
    is one `linear`: with M of 16+ rows on the AMX or AVX512-BF16 build, x rounded to bf16 (`reference`)."""
    out_BMO = x_BMK.new_empty(x_BMK.shape[0], x_BMK.shape[1], w_BOK.shape[1])
    bmm_into(x_BMK, w_BOK, out_BMO, scale_inv, block)
    return out_BMO


def bmm_into(x_BMK: torch.Tensor, w_BOK: torch.Tensor, out_BMO: torch.Tensor, scale_inv: torch.Tensor | None = None,
             block: Block | None = None) -> None:
    """out[b] = x[b] w[b]^T into a float32 out with unit stride in O (e.g. a column slice of a wider row). w and
    its scales may be views (w with unit stride in K: e.g. W_UV, a slice of kv_b_proj's weight)."""
    if not (x_BMK.shape[1] > 0 and x_BMK.dtype == out_BMO.dtype == torch.float32 and x_BMK.is_cpu
            and x_BMK.stride(2) == 1 and out_BMO.stride(2) == 1 and _weight_fits(w_BOK, scale_inv) and available()):
        out_BMO.copy_(torch.bmm(x_BMK, _dense(w_BOK, scale_inv, block).transpose(1, 2)))
        return
    torch.ops.moe_serve.bmm_wt(x_BMK, w_BOK, scale_inv, _block(scale_inv, block), out_BMO)
