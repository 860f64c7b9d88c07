"""Linear layers with bf16 weights and float32 activations on CPU: how `--dtype bfloat16` computes on a CPU
without bf16 arithmetic (server/runner.compute_dtype).

There torch's bf16 matmuls are scalar loops, so the model computes in float32 while its linear and expert
weights stay bf16: half the memory, and at decode sizes, where a linear reads its whole weight for a few
rows, half the bytes. Up to MAX_ROWS rows go through csrc/linear_bf16w.c, an AVX2 kernel that widens the
weight in registers: 1.8-2.7x faster than the same weight held in float32 through MKL at 1-8 rows and 1.4x
at 16, one thread (scripts/bench_linear.py --bf16-weights; docs/benchmarks.md). On one thread MKL on a
widened copy catches up with it at 48-64 rows; on two, the kernel (splitting weight rows) stays ahead to a
few hundred rows: a 256-token prompt chunk of the benchmark model ran 7% faster with the kernel than with
MKL beyond 40 rows (docs/benchmarks.md, run 6). Beyond MAX_ROWS the weight is widened to a float32 copy for
F.linear (MKL). The reference is F.linear(x, w.float(), b).

kernels/cpu_build.py compiles the C once per machine and loads it through ctypes. Without a compiler, or on
a CPU without AVX2 and FMA, every call takes the F.linear path: the same results, slower.

Legend: M rows, K in features, O out features.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from moe_serve.kernels import cpu_build

MAX_ROWS = 512  # beyond, MKL on a widened copy is faster (65 vs 54 GFLOP/s at 2048 rows, two threads)


def _lib():
    return cpu_build.lib()


def available() -> bool:
    return _lib() is not None


def reference(x_MK: torch.Tensor, w_OK: torch.Tensor, bias_O: torch.Tensor | None = None) -> torch.Tensor:
    return F.linear(x_MK, w_OK.float(), None if bias_O is None else bias_O.float())


def _fits(x_MK: torch.Tensor, w_OK: torch.Tensor) -> bool:
    """Whether x w^T can go through the C kernel: float32 x with unit column stride, a bf16 w with
    contiguous rows, 1 to MAX_ROWS rows, on CPU, and the kernel built."""
    return (0 < x_MK.shape[0] <= MAX_ROWS and x_MK.dtype == torch.float32 and w_OK.dtype == torch.bfloat16
            and x_MK.is_cpu and x_MK.stride(1) == 1 and w_OK.stride(1) == 1 and _lib() is not None)


def _kernel_into(x_MK: torch.Tensor, w_OK: torch.Tensor, out_MO: torch.Tensor) -> None:
    """out = x w^T through the C kernel; the caller checked `_fits` (out: float32, unit column stride)."""
    M, K = x_MK.shape
    _lib().linear_bf16w(x_MK.data_ptr(), x_MK.stride(0), w_OK.data_ptr(), w_OK.stride(0), out_MO.data_ptr(),
                        out_MO.stride(0), M, K, w_OK.shape[0])


def linear(x_TK: torch.Tensor, w_OK: torch.Tensor, bias_O: torch.Tensor | None = None) -> torch.Tensor:
    """x W^T (+ b) for float32 x (any leading dims) and a bf16 weight; float32 out."""
    rows_MK = x_TK if x_TK.dim() == 2 else x_TK.reshape(-1, x_TK.shape[-1])
    if rows_MK.stride(-1) != 1:
        rows_MK = rows_MK.contiguous()
    if not _fits(rows_MK, w_OK):
        return reference(x_TK, w_OK, bias_O)
    y_MO = rows_MK.new_empty(rows_MK.shape[0], w_OK.shape[0])
    _kernel_into(rows_MK, w_OK, y_MO)
    if bias_O is not None:
        y_MO += bias_O
    return y_MO if x_TK.dim() == 2 else y_MO.view(*x_TK.shape[:-1], w_OK.shape[0])


def mm_into(x_MK: torch.Tensor, w_OK: torch.Tensor, out_MO: torch.Tensor) -> None:
    """out = x w^T for float32 x and out and a bf16 w (an expert's GEMM in kernels/fused_moe_torch.py)."""
    if _fits(x_MK, w_OK) and out_MO.dtype == torch.float32 and out_MO.stride(1) == 1:
        _kernel_into(x_MK, w_OK, out_MO)
    else:
        torch.mm(x_MK, w_OK.float().t(), out=out_MO)


def bmm(x_BMK: torch.Tensor, w_BOK: torch.Tensor) -> torch.Tensor:
    """out[b] = x[b] w[b]^T for float32 x and a bf16 w (per-head weights: MLA's W_UK / W_UV absorption);
    float32 out [B, M, O]."""
    out_BMO = x_BMK.new_empty(x_BMK.shape[0], x_BMK.shape[1], w_BOK.shape[1])
    bmm_into(x_BMK, w_BOK, out_BMO)
    return out_BMO


def bmm_into(x_BMK: torch.Tensor, w_BOK: torch.Tensor, out_BMO: torch.Tensor) -> None:
    """out[b] = x[b] w[b]^T into a float32 out with unit stride in O (e.g. a column slice of a wider row)."""
    B, M, K = x_BMK.shape
    O = w_BOK.shape[1]
    if not (M > 0 and x_BMK.dtype == out_BMO.dtype == torch.float32 and w_BOK.dtype == torch.bfloat16
            and x_BMK.is_cpu and x_BMK.stride(2) == 1 and w_BOK.stride(2) == 1 and out_BMO.stride(2) == 1
            and _lib() is not None):
        out_BMO.copy_(torch.bmm(x_BMK, w_BOK.float().transpose(1, 2)))
        return
    _lib().linear_bf16w_batched(x_BMK.data_ptr(), x_BMK.stride(1), x_BMK.stride(0), w_BOK.data_ptr(),
                                w_BOK.stride(1), w_BOK.stride(0), out_BMO.data_ptr(), out_BMO.stride(1),
                                out_BMO.stride(0), M, K, O, B)
