"""The operations the model calls, dispatched to one kernel backend chosen once per process.

The model never asks which machine it runs on: its modules call these functions unconditionally, and
the active backend (kernels/select.py picks it from `--kernel-backend`) decides how each runs:
  torch  the reference: plain torch ops on any device, computing in the weights' dtype; block-FP8
         weights are dequantised per call (kernels/backend_torch.py).
  cpu    x86 with AVX2 + FMA: activations in float32, bf16 / FP8 weights widened in registers by the C
         kernels, and a whole decoder layer of a decode step in one call (kernels/backend_cpu.py).
  cuda   Triton fused MoE and w8a8 block-FP8 GEMMs, torch CUDA ops elsewhere (kernels/backend_cuda.py).
Until a runner installs one (`use`), the torch backend is active.

The operations (shapes in names; weights [out, in] as in checkpoints; `scale_inv` = a block-FP8
weight's per-block scales, None for other weights):
  embedding(ids_T, weight_VH) -> x_TH              rows in the backend's activation dtype
  linear(x_TI, w_OI, scale_inv, bias_O) -> y_TO
  rms_norm(x_TD, w_D, eps) -> y_TD
  rope(x_TNR, cos_TR2, sin_TR2, interleaved) -> y_TNR
  silu_and_mul(x_T2I) -> y_TI                      silu(gate) * up, gate columns first
  mla_cache_write(kv_TD, norm_w_C, eps, cos_TR2, sin_TR2, interleaved, kv_cache, slots_T)
  bmm_wt(x_BMK, w_BOK, scale_inv) -> y_BMO         y[b] = x[b] w[b]^T (MLA's absorbed per-head weights)
  mla_decode(q_BNK, kv_cache, meta, latent_dim, scale) -> out_BNC
  prefill_attention(q_NQK, k_NLK, v_NLV, scale, stored_dtype) -> out_NQV   a prompt chunk's causal attention
                                                   (query i at position L - Q + i); k and v computed from a
                                                   cache held in stored_dtype
  route(x_TH, gate_EH, bias_E, router_config) -> (topk_weights_TK float32, topk_ids_TK int64)
  fused_moe(x_TH, experts, topk_weights_TK, topk_ids_TK, shared) -> y_TH   routed (+ shared) experts
  prepare(model)                                   once after loading: the weights as the backend wants them
  fused_decode_layer(spec) -> callable | None      an optional whole-layer fast path for decode steps (the
                                                   callable returns None for inputs it does not take; its
                                                   `chunk_rows`: prompt chunks of up to this many queries,
                                                   and `chunk_context`: chunks whose context ends by this
                                                   many tokens, are worth giving as decode rows to take it)
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import NamedTuple

import torch


class MLPWeights(NamedTuple):
    """A SiLU-gated MLP's weights, or a stack of them (routed experts): w13 [(E,) 2I, H] gate rows then up
    rows, w2 [(E,) H, I], and their block-FP8 scales (None for other weights)."""

    w13: torch.Tensor
    w2: torch.Tensor
    w13_scale: torch.Tensor | None = None
    w2_scale: torch.Tensor | None = None


def _torch_backend():
    from moe_serve.kernels.backend_torch import TorchBackend

    return TorchBackend()


_active = None


def backend():
    """The active backend (the torch reference until `use` installs another)."""
    global _active
    if _active is None:
        _active = _torch_backend()
    return _active


def use(b) -> None:
    """Install `b` as the backend of every op in this process (the runner does, once, before it builds the
    model)."""
    global _active
    _active = b


@contextmanager
def using(b):
    """Run a block with `b` active, then restore the previous backend (tests comparing backends)."""
    prev = backend()
    use(b)
    try:
        yield b
    finally:
        use(prev)


def step_threads():
    """A context for one engine step: the CPU backend runs its kernels on the cores and torch's ops on one thread
    for its length (kernels/cpu_build.py kernel_threads); the others change nothing."""
    return backend().step_threads()


def embedding(ids_T, weight_VH):
    return backend().embedding(ids_T, weight_VH)


def linear(x_TI, w_OI, scale_inv=None, bias_O=None):
    return backend().linear(x_TI, w_OI, scale_inv, bias_O)


def rms_norm(x_TD, w_D, eps: float):
    return backend().rms_norm(x_TD, w_D, eps)


def rope(x_TNR, cos_TR2, sin_TR2, interleaved: bool):
    return backend().rope(x_TNR, cos_TR2, sin_TR2, interleaved)


def silu_and_mul(x_T2I):
    return backend().silu_and_mul(x_T2I)


def mla_cache_write(kv_TD, norm_w_C, eps: float, cos_TR2, sin_TR2, interleaved: bool, kv_cache, slots_T) -> None:
    backend().mla_cache_write(kv_TD, norm_w_C, eps, cos_TR2, sin_TR2, interleaved, kv_cache, slots_T)


def bmm_wt(x_BMK, w_BOK, scale_inv=None):
    return backend().bmm_wt(x_BMK, w_BOK, scale_inv)


def mla_decode(q_BNK, kv_cache, meta, latent_dim: int, scale: float):
    return backend().mla_decode(q_BNK, kv_cache, meta, latent_dim, scale)


def prefill_attention(q_NQK, k_NLK, v_NLV, scale: float, stored_dtype: torch.dtype):
    return backend().prefill_attention(q_NQK, k_NLK, v_NLV, scale, stored_dtype)


def route(x_TH, gate_EH, bias_E, router_config):
    return backend().route(x_TH, gate_EH, bias_E, router_config)


def fused_moe(x_TH, experts: MLPWeights, topk_weights_TK, topk_ids_TK, shared: MLPWeights | None = None):
    return backend().fused_moe(x_TH, experts, topk_weights_TK, topk_ids_TK, shared)


def prepare(model: torch.nn.Module) -> None:
    backend().prepare(model)


def fused_decode_layer(spec):
    return backend().fused_decode_layer(spec)
