"""Builds and loads the CPU kernels of kernels/csrc (AVX2 + FMA C, no Python or torch headers) as one
shared library, compiled once per machine with the system C compiler into a cache folder (about a second)
and called through ctypes. The modules beside each kernel (cpu_bf16w.py, cpu_mla.py, cpu_moe.py,
cpu_ops.py) hold their torch references and fall back to them where `lib()` is None: no compiler, or a CPU
without AVX2 and FMA; cpu_decode_layer.py (a whole decode layer) is then not used, and the model calls its
layers' modules.
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

log = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"
FLAGS = ["-O3", "-mavx2", "-mfma", "-shared", "-fPIC"]
# With OpenMP the library needs libgomp.so.1, which resolves to the copy torch has already loaded: one
# thread pool for torch and these kernels, sized by torch.set_num_threads. Without it, one thread.
OPENMP = ["-fopenmp"]

_P, _I64, _F32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
SIGNATURES = {  # name: (argument types, return type)
    "linear_bf16w": ([_P, _I64, _P, _I64, _P, _I64, _I64, _I64, _I64], None),
    "linear_bf16w_batched": ([_P, _I64, _I64, _P, _I64, _I64, _P, _I64, _I64, _I64, _I64, _I64, _I64], None),
    "mla_decode_bf16": ([_P, _I64, _I64, _P, _I64, _I64, _P, _I64, _P, _P, _I64, _I64, _I64, _I64, _I64, _F32, _P],
                        _I64),
    "rms_norm_f32": ([_P, _I64, _P, _P, _I64, _I64, _I64, _F32], None),
    "rope_f32": ([_P, _I64, _I64, _P, _P, _P, _I64, _I64, _I64, _I64, _I64, _I64], None),
    "route_noaux_tc_f32": ([_P, _I64, _P, _I64, _P, _I64, _I64, _I64, _I64, _I64, _I64, _F32, _P, _P], None),
    "mla_cache_write_bf16": ([_P, _I64, _P, _F32, _P, _P, _I64, _P, _P, _I64, _I64, _I64], None),
    "moe_bf16w": ([_P, _I64, _I64, _I64, _P, _P, _I64, _I64, _P, _P, _I64, _P, _P, _I64, _P], _I64),
    "decode_layer_struct_size": ([], _I64),
    "decode_layer_f32": ([_P, _P, _I64, _P, _P, _P, _I64, _P, _P, _P, _I64, _P, _P], _I64),
}


def cpu_has(*flags: str) -> bool:
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    have = next((set(line.split(":", 1)[1].split()) for line in info.splitlines() if line.startswith("flags")), set())
    return all(f in have for f in flags)


def cache_dir() -> Path:
    return Path(os.environ.get("MOE_KERNEL_CACHE") or Path.home() / ".cache" / "moe-serve" / "kernels")


def sources() -> list[Path]:
    return sorted(CSRC.glob("*.c"))


@functools.cache
def lib() -> ctypes.CDLL | None:
    """The compiled kernels (built on first use, then reused from the cache folder), or None if they cannot be."""
    if platform.machine() not in ("x86_64", "AMD64") or not cpu_has("avx2", "fma"):
        return None
    cc = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    files = [*sources(), *sorted(CSRC.glob("*.h"))]
    digest = hashlib.sha256(" ".join(FLAGS + OPENMP).encode())
    for f in files:
        digest.update(f.name.encode() + f.read_bytes())
    so = cache_dir() / f"moe_cpu_kernels-{digest.hexdigest()[:16]}.so"
    try:
        if not so.exists():
            if cc is None:
                raise RuntimeError("no C compiler (cc or gcc) on PATH")
            so.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(suffix=".so", dir=so.parent)  # several ranks may build at once
            os.close(fd)
            cmd = [cc, *FLAGS, "-o", tmp, *map(str, sources()), "-lm"]
            r = subprocess.run(cmd[:1] + OPENMP + cmd[1:], capture_output=True, text=True, timeout=120)
            if r.returncode != 0:
                log.warning("building the CPU kernels with OpenMP failed (%s); they will use one thread",
                            r.stderr.strip()[:200])
                r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
            if r.returncode != 0:
                os.unlink(tmp)
                raise RuntimeError(f"{cc} failed: {r.stderr.strip()[:300]}")
            os.replace(tmp, so)
            log.info("built %s", so)
        cdll = ctypes.CDLL(str(so))
    except (OSError, RuntimeError, subprocess.SubprocessError) as err:
        log.warning("CPU kernels unavailable (%s); their torch references run instead", err)
        return None
    for name, (argtypes, restype) in SIGNATURES.items():
        fn = getattr(cdll, name)
        fn.argtypes, fn.restype = argtypes, restype
    return cdll
