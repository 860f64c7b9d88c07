"""Chooses the kernel backend once per process (`--kernel-backend auto|torch|cpu|cuda`), before any weight
loads: a backend this machine cannot run is a one-line error naming the flag and what to use instead.

auto: cuda on a CUDA device; on a CPU, cpu where the C kernels run (x86-64 with AVX2 + FMA and a
compiler), else torch (with one line saying why).
"""

from __future__ import annotations

import logging

import torch

from moe_serve.kernels.backend_cpu import CpuBackend
from moe_serve.kernels.backend_cuda import CudaBackend
from moe_serve.kernels.backend_torch import TorchBackend

log = logging.getLogger(__name__)

BACKENDS = {"torch": TorchBackend, "cpu": CpuBackend, "cuda": CudaBackend}
CHOICES = ("auto", *BACKENDS)


def select_backend(name: str, device: torch.device | str, fp8_block: tuple[int, int] | None = None):
    """The backend for `name` on `device`; ValueError (one line) where it cannot run here."""
    device = torch.device(device)
    if name not in CHOICES:
        raise ValueError(f"--kernel-backend must be one of {', '.join(CHOICES)}, got {name!r}")
    if name == "auto":
        if device.type == "cuda":
            name = "cuda"
        else:
            why = CpuBackend.unavailable_reason()
            name = "torch" if why else "cpu"
            if why:
                log.warning("kernel backend: torch (the CPU kernels cannot run: %s)", why)
    cls = BACKENDS[name]
    why = cls.unavailable_reason()
    if why:
        raise ValueError(f"--kernel-backend {name}: {why}; use --kernel-backend torch (or auto) instead")
    return cls(device, fp8_block)  # refuses a device it does not run on
