"""Builds and loads the CPU kernels of kernels/csrc (AVX2 + FMA + F16C, and AVX-512 where the CPU has it;
C compiled as C++) as torch ops, `torch.ops.moe_serve.<name>`, on first use: torch's extension builder
(torch.utils.cpp_extension.load with ninja) compiles them with the torch-op shim csrc/torch_ops.cpp into its
build folder (TORCH_EXTENSIONS_DIR, default ~/.cache/torch_extensions), rebuilds when a source or flag
changes, and serialises processes that build at once with its lock file. The first build takes about half
a minute, dominated by the shim's torch headers (MAX_JOBS caps the parallel compiles); later processes load
the built library.

The modules beside each kernel (cpu_bf16w.py, cpu_mla.py, cpu_moe.py, cpu_ops.py) hold their torch
references and fall back to them where `available()` is False: no C++ compiler or ninja, a CPU without
AVX2, FMA and F16C, or a failed build (`unavailable_reason()` says which, in one line);
cpu_decode_layer.py (a whole decode layer) is then not used, and the model calls its layers' modules.
"""

from __future__ import annotations

import contextlib
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
# Where the CPU has AVX-512 F/BW/VL the kernels are built with it too (a library of its own name, so that a
# build folder shared between machine classes never loads the wrong one): the linears and experts then
# multiply-add 16 lanes at a time (csrc/linear_bf16w.cpp). MOE_CPU_KERNEL_ISA=avx2 builds the AVX2 library
# on such a CPU (to compare the two; like ATen's ATEN_CPU_CAPABILITY).
AVX512_CPU_FLAGS = ("avx512f", "avx512bw", "avx512vl")
AVX512_FLAGS = ["-mavx512f", "-mavx512bw", "-mavx512vl"]
# Where the CPU also has AMX with bf16 (Sapphire Rapids and later), the AVX-512 build adds the tile
# instructions (a third library name): products of at least TILE_ROWS rows of x by a bf16 weight round x to
# bf16 and multiply on the tiles, float32 sums (csrc/linear_amx.cpp): prompt chunks and large batches. Fewer
# rows (decode at low load) stay float32. MOE_CPU_KERNEL_ISA=avx512 keeps float32 for every product.
AMX_CPU_FLAGS = AVX512_CPU_FLAGS + ("amx_tile", "amx_bf16", "avx512_bf16")
AMX_FLAGS = ["-mamx-tile", "-mamx-bf16", "-mavx512bf16"]
# Where the CPU has AVX512-BF16 but no AMX (AMD Zen 4 and later), the same products round x to bf16 and
# multiply pairs on vdpbf16ps, 32 multiply-adds an instruction, float32 sums (csrc/linear_dpbf16.cpp; a fourth
# library name, "avx512bf16"). "Tiles" below means either.
AVX512BF16_CPU_FLAGS = AVX512_CPU_FLAGS + ("avx512_bf16",)
AVX512BF16_FLAGS = ["-mavx512bf16"]
TILE_ROWS = 16  # a routed expert's products from fewer in the AMX build (expert_tile_rows, csrc/linear_amx.cpp)
TILE_ISAS = ("amx", "avx512bf16")  # the builds whose products of TILE_ROWS+ rows are bf16
# The kernels run their loops on their own threads (csrc/pool.cpp); OpenMP only tells them how many torch uses
# (torch.set_num_threads), through libgomp.so.1, the copy torch has already loaded. Without it, one thread
# unless kernel_threads sets the count.
OPENMP = ["-fopenmp"]
CPU_FLAGS = ("avx2", "fma", "f16c")
OPS = ("mm_wt", "bmm_wt", "fused_moe", "mla_decode", "rms_norm", "rope", "mla_cache_write", "route_noaux_tc",
       "decode_layer", "causal_softmax", "values_t", "set_kernel_threads")  # what csrc/torch_ops.cpp registers


def cpu_has(*flags: str) -> bool:
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    have = next((set(line.split(":", 1)[1].split()) for line in info.splitlines() if line.startswith("flags")), set())
    return all(f in have for f in flags)


_ISA_FLAGS = {"avx2": CPU_FLAGS, "avx512": AVX512_CPU_FLAGS, "avx512bf16": AVX512BF16_CPU_FLAGS,
              "amx": AMX_CPU_FLAGS}
_ISA_EXTRA = {"avx2": [], "avx512": AVX512_FLAGS, "avx512bf16": AVX512_FLAGS + AVX512BF16_FLAGS,
              "amx": AVX512_FLAGS + AMX_FLAGS}


@functools.cache
def isa() -> str:
    """The instruction set the kernels are built for on this machine: "amx", "avx512bf16", "avx512" or "avx2"
    (the most this CPU has, or MOE_CPU_KERNEL_ISA)."""
    wanted = os.environ.get("MOE_CPU_KERNEL_ISA", "").strip().lower()
    if wanted not in ("", *_ISA_FLAGS):
        raise ValueError(f"MOE_CPU_KERNEL_ISA must be one of {', '.join(_ISA_FLAGS)}, got {wanted!r}")
    if wanted and not cpu_has(*_ISA_FLAGS[wanted]):
        raise ValueError(f"MOE_CPU_KERNEL_ISA={wanted}: this CPU lacks one of {', '.join(_ISA_FLAGS[wanted])}")
    best = next((name for name in ("amx", "avx512bf16", "avx512") if cpu_has(*_ISA_FLAGS[name])), "avx2")
    return wanted or best


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

    name = NAME + ("" if isa() == "avx2" else "_" + isa())
    flags = FLAGS + _ISA_EXTRA[isa()] + (OPENMP if openmp else [])
    load = functools.partial(cpp_extension.load, name=name, sources=[str(s) for s in sources()],
                             extra_cflags=flags, extra_ldflags=OPENMP if openmp else [], is_python_module=False)
    try:
        load()
    except OSError:  # a library that does not load (say, cut short by a full disk): build it again, once
        so = Path(cpp_extension._get_build_directory(name, False)) / f"{name}.so"
        log.warning("the built CPU kernels %s do not load; building them again", so)
        so.unlink(missing_ok=True)
        cpp_extension.JIT_EXTENSION_VERSIONER.entries.pop(name, None)  # else this process would not build again
        load()


@functools.cache
def unavailable_reason() -> str | None:
    """Why the CPU kernels cannot run here, in one line, or None once they are built and loaded."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return f"this is not an x86-64 CPU ({platform.machine()})"
    if not cpu_has(*CPU_FLAGS):
        return f"this CPU lacks one of {', '.join(CPU_FLAGS)}"
    try:
        isa()
    except ValueError as err:
        return str(err)
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
    if isa() in TILE_ISAS and torch.ops.moe_serve.set_tile_rows(TILE_ROWS) == 0:  # only AMX can be refused
        log.warning("the OS refused this process the AMX tiles (arch_prctl): every product stays float32")
    return None


def tile_rows(rows: int | None = None) -> int:
    """The fewest rows of x that a bf16 product takes to the tiles (AMX, or AVX512-BF16 dot products; 0: none
    do), after setting it to `rows` where given (0 turns the tiles off: the float32 kernels then run every
    product, as tests of their exact sums want). 0 without the AMX or AVX512-BF16 build."""
    if not available() or isa() not in TILE_ISAS:
        return 0
    return torch.ops.moe_serve.set_tile_rows(-1 if rows is None else max(0, rows))


def fp8_tiles(on: bool | None = None) -> bool:
    """Whether products by FP8 weights take the bf16 dot products too (x rounded to bf16, the weight widened exactly:
    csrc/linear_dpbf16.cpp; those of fewer than tile_rows() rows where K and the blocks' columns are multiples of
    32, kernels/cpu_bf16w.py tiles_take), after setting it to `on` where given. Only the AVX512-BF16
    build can; off until set: the CPU backend turns it on for a model served in bf16 and off for one served in
    float32 (kernels/backend_cpu.py), whose FP8 products then stay float32. One setting per process."""
    if not available() or isa() != "avx512bf16":
        return False
    return bool(torch.ops.moe_serve.set_fp8_tiles(-1 if on is None else int(on)))


@contextlib.contextmanager
def kernel_threads():
    """For the length of a block (an engine step), the kernels run on torch's thread count and torch's own ops
    on one thread. The kernels have their own threads (csrc/pool.cpp: a loop's caller never waits for a thread
    that has no work left, so a thread preempted by the server's front end costs one item, not a barrier);
    torch's OpenMP threads spin for milliseconds after each of its parallel ops, and on the same cores the two
    teams would take turns. torch's ops in a step are small (sampling, gathers). Nested, the inner block
    changes nothing."""
    threads = torch.get_num_threads()
    if threads <= 1 or not available():
        yield
        return
    before = torch.ops.moe_serve.set_kernel_threads(threads)
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
        torch.ops.moe_serve.set_kernel_threads(before)


def expert_tile_rows() -> int:
    """The fewest rows of a routed expert's products that take the tiles (at most tile_rows(); 8 in the AMX
    build, where a product of 8-15 rows by an expert's weight is faster on the tiles on one core; 0: none)."""
    if not available() or isa() not in TILE_ISAS:
        return 0
    return torch.ops.moe_serve.expert_tile_rows()


def available() -> bool:
    """Whether the kernels run here (built on the first call)."""
    return unavailable_reason() is None


def lib():
    """The kernels' op namespace (torch.ops.moe_serve), or None where they cannot run."""
    return torch.ops.moe_serve if available() else None
