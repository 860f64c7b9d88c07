"""Linear layers with bf16 weights and float32 activations on CPU: how `--dtype bfloat16` computes on a CPU
without bf16 arithmetic (server/runner.compute_dtype).

There torch's bf16 matmuls are scalar loops, so the model computes in float32 while its linear and expert
weights stay bf16: half the memory, and at decode sizes, where a linear reads its whole weight for a few
rows, half the bytes. Up to MAX_ROWS rows go through csrc/linear_bf16w.c, an AVX2 kernel that widens the
weight in registers: 1.8-2.7x faster than the same weight held in float32 through MKL at 1-8 rows and 1.4x
at 16, one thread (scripts/bench_linear.py --bf16-weights; docs/benchmarks.md). Larger inputs widen the
weight to a float32 copy and call F.linear (MKL), which catches up with the kernel at 48-64 rows. The
reference is F.linear(x, w.float(), b).

The C file is compiled once per machine with the system C compiler into a cache folder (no Python or
torch headers; about a second) and called through ctypes. Without a compiler, or on a CPU without AVX2
and FMA, every call takes the F.linear path: the same results, slower.

Legend: M rows, K in features, O out features.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

MAX_ROWS = 40  # beyond, MKL on a widened copy is as fast (kernel 1.1-1.5x faster at 24-32 rows, even at 48-64)
SOURCE = Path(__file__).parent / "csrc" / "linear_bf16w.c"
_I64 = ctypes.c_int64


def _cpu_has(*flags: str) -> bool:
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    have = next((set(line.split(":", 1)[1].split()) for line in info.splitlines() if line.startswith("flags")), set())
    return all(f in have for f in flags)


def cache_dir() -> Path:
    return Path(os.environ.get("MOE_KERNEL_CACHE") or Path.home() / ".cache" / "moe-serve" / "kernels")


@functools.cache
def _lib() -> ctypes.CDLL | None:
    """The compiled kernel (built on first use, then reused from the cache folder), or None if it cannot be."""
    if platform.machine() not in ("x86_64", "AMD64") or not _cpu_has("avx2", "fma"):
        return None
    cc = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    source = SOURCE.read_bytes()
    flags = ["-O3", "-mavx2", "-mfma", "-shared", "-fPIC"]
    tag = hashlib.sha256(source + " ".join(flags).encode()).hexdigest()[:16]
    so = cache_dir() / f"linear_bf16w-{tag}.so"
    try:
        if not so.exists():
            if cc is None:
                raise RuntimeError("no C compiler (cc or gcc) on PATH")
            so.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(suffix=".so", dir=so.parent)  # several ranks may build at once
            os.close(fd)
            r = subprocess.run([cc, *flags, "-o", tmp, str(SOURCE)], capture_output=True, text=True, timeout=120)
            if r.returncode != 0:
                os.unlink(tmp)
                raise RuntimeError(f"{cc} failed: {r.stderr.strip()[:300]}")
            os.replace(tmp, so)
            log.info("built %s", so)
        lib = ctypes.CDLL(str(so))
    except (OSError, RuntimeError, subprocess.SubprocessError) as err:
        log.warning("bf16-weight CPU kernel unavailable (%s); bf16 weights are widened for F.linear instead", err)
        return None
    lib.linear_bf16w.argtypes = [ctypes.c_void_p, _I64, ctypes.c_void_p, _I64, ctypes.c_void_p, _I64, _I64, _I64, _I64]
    lib.linear_bf16w.restype = None
    return lib


def available() -> bool:
    return _lib() is not None


def reference(x_MK: torch.Tensor, w_OK: torch.Tensor, bias_O: torch.Tensor | None = None) -> torch.Tensor:
    return F.linear(x_MK, w_OK.float(), None if bias_O is None else bias_O.float())


def _fits(x_MK: torch.Tensor, w_OK: torch.Tensor) -> bool:
    """Whether x w^T can go through the C kernel: float32 x with unit column stride, a bf16 w with
    contiguous rows, 1 to MAX_ROWS rows, on CPU, and the kernel built."""
    return (0 < x_MK.shape[0] <= MAX_ROWS and x_MK.dtype == torch.float32 and w_OK.dtype == torch.bfloat16
            and x_MK.device.type == "cpu" and x_MK.stride(1) == 1 and w_OK.stride(1) == 1 and _lib() is not None)


def _kernel_into(x_MK: torch.Tensor, w_OK: torch.Tensor, out_MO: torch.Tensor) -> None:
    """out = x w^T through the C kernel; the caller checked `_fits` (out: float32, unit column stride)."""
    M, K = x_MK.shape
    _lib().linear_bf16w(x_MK.data_ptr(), x_MK.stride(0), w_OK.data_ptr(), w_OK.stride(0), out_MO.data_ptr(),
                        out_MO.stride(0), M, K, w_OK.shape[0])


def linear(x_TK: torch.Tensor, w_OK: torch.Tensor, bias_O: torch.Tensor | None = None) -> torch.Tensor:
    """x W^T (+ b) for float32 x (any leading dims) and a bf16 weight; float32 out."""
    rows_MK = x_TK.reshape(-1, x_TK.shape[-1])
    if rows_MK.stride(-1) != 1:
        rows_MK = rows_MK.contiguous()
    if not _fits(rows_MK, w_OK):
        return reference(x_TK, w_OK, bias_O)
    y_MO = rows_MK.new_empty(rows_MK.shape[0], w_OK.shape[0])
    _kernel_into(rows_MK, w_OK, y_MO)
    if bias_O is not None:
        y_MO += bias_O
    return y_MO.view(*x_TK.shape[:-1], w_OK.shape[0])


def mm_into(x_MK: torch.Tensor, w_OK: torch.Tensor, out_MO: torch.Tensor) -> None:
    """out = x w^T for float32 x and out and a bf16 w (an expert's GEMM in kernels/fused_moe_torch.py)."""
    if _fits(x_MK, w_OK) and out_MO.dtype == torch.float32 and out_MO.stride(1) == 1:
        _kernel_into(x_MK, w_OK, out_MO)
    else:
        torch.mm(x_MK, w_OK.float().t(), out=out_MO)
