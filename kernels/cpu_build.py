"""Builds and loads the CPU kernels of kernels/csrc (AVX2 + FMA + F16C, C compiled as C++) as torch ops,
`torch.ops.moe_serve.<name>`, on first use: torch's extension builder (torch.utils.cpp_extension.load with
ninja) compiles them with the torch-op shim csrc/torch_ops.cpp into its build folder (TORCH_EXTENSIONS_DIR,
default ~/.cache/torch_extensions), rebuilds when a source or flag changes, and serialises processes that
build at once with its lock file. The first build takes about half a minute, dominated by the shim's
torch headers (MAX_JOBS caps the parallel compiles); later processes load the built library.

The modules beside each kernel (cpu_bf16w.py, cpu_mla.py, cpu_moe.py, cpu_ops.py) hold their torch
references and fall back to them where `available()` is False: no C++ compiler or ninja, a CPU without
AVX2, FMA and F16C, or a failed build (`unavailable_reason()` says which, in one line);
cpu_decode_layer.py (a whole decode layer) is then not used, and the model calls its layers' modules.
"""

from __future__ import annotations

import functools
import logging
import os
import platform
import shutil
from pathlib import Path

import torch

log = logging.getLogger(__name__)

NAME = "moe_serve_cpu_kernels"
CSRC = Path(__file__).parent / "csrc"
FLAGS = ["-O3", "-mavx2", "-mfma", "-mf16c"]
# With OpenMP the library needs libgomp.so.1, which resolves to the copy torch has already loaded: one
# thread pool for torch and these kernels, sized by torch.set_num_threads. Without it, one thread.
OPENMP = ["-fopenmp"]
CPU_FLAGS = ("avx2", "fma", "f16c")
OPS = ("mm_wt", "bmm_wt", "fused_moe", "mla_decode", "rms_norm", "rope", "mla_cache_write", "route_noaux_tc",
       "decode_layer")  # what csrc/torch_ops.cpp registers


def cpu_has(*flags: str) -> bool:
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    have = next((set(line.split(":", 1)[1].split()) for line in info.splitlines() if line.startswith("flags")), set())
    return all(f in have for f in flags)


def sources() -> list[Path]:
    return sorted(CSRC.glob("*.cpp"))


def _find_ninja() -> str | None:
    """Where ninja is not on PATH but its Python package is installed (a virtual environment that is not
    activated), put the package's copy on PATH, where torch's builder looks."""
    from torch.utils import cpp_extension

    if cpp_extension.is_ninja_available():
        return None
    try:
        import ninja
    except ImportError:
        return "ninja is not installed (pip install ninja)"
    os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
    return None if cpp_extension.is_ninja_available() else "ninja is installed but does not run"


def _build(openmp: bool) -> None:
    from torch.utils import cpp_extension

    flags = FLAGS + (OPENMP if openmp else [])
    load = functools.partial(cpp_extension.load, name=NAME, sources=[str(s) for s in sources()],
                             extra_cflags=flags, extra_ldflags=OPENMP if openmp else [], is_python_module=False)
    try:
        load()
    except OSError:  # a library that does not load (say, cut short by a full disk): build it again, once
        so = Path(cpp_extension._get_build_directory(NAME, False)) / f"{NAME}.so"
        log.warning("the built CPU kernels %s do not load; building them again", so)
        so.unlink(missing_ok=True)
        cpp_extension.JIT_EXTENSION_VERSIONER.entries.pop(NAME, None)  # else this process would not build again
        load()


@functools.cache
def unavailable_reason() -> str | None:
    """Why the CPU kernels cannot run here, in one line, or None once they are built and loaded."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return f"this is not an x86-64 CPU ({platform.machine()})"
    if not cpu_has(*CPU_FLAGS):
        return f"this CPU lacks one of {', '.join(CPU_FLAGS)}"
    cxx = os.environ.get("CXX", "c++")
    if shutil.which(cxx) is None:
        return f"no C++ compiler ({cxx}) on PATH"
    reason = _find_ninja()
    if reason:
        return reason
    try:
        try:
            _build(openmp=True)
        except Exception as err:  # noqa: BLE001 - the compiler's own message says why
            log.warning("building the CPU kernels with OpenMP failed (%s); they will use one thread",
                        str(err).strip()[-300:])
            _build(openmp=False)
    except Exception as err:  # noqa: BLE001
        reason = f"building the CPU kernels failed: {' '.join(str(err).split())[-300:]}"
        log.warning("%s; their torch references run instead", reason)
        return reason
    return None


def available() -> bool:
    """Whether the kernels run here (built on the first call)."""
    return unavailable_reason() is None


def lib():
    """The kernels' op namespace (torch.ops.moe_serve), or None where they cannot run."""
    return torch.ops.moe_serve if available() else None
