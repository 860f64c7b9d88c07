"""RMSNorm, rotary embedding and DeepSeek-V3's router for float32 on CPU, one C call each
(csrc/cpu_ops.cpp, torch ops moe_serve::rms_norm / rope / mla_cache_write / route_noaux_tc), beside their
torch references. The model uses them where it computes bf16 weights in
float32 (the cpu kernel backend, kernels/backend_cpu.py), as the other kernels of that mode: at decode sizes the composite
torch versions cost 5-15 us of dispatch per op, several ops each, on every layer.

Legend: T tokens, D features, N heads, R rope dims, E routed experts, G groups, K experts per token.
"""

from __future__ import annotations

import torch

from moe_serve.kernels import cpu_build


def _f32_cpu(*tensors: torch.Tensor) -> bool:
    return all(t.dtype == torch.float32 and t.is_cpu for t in tensors) and cpu_build.available()


def rms_norm_reference(x_TD: torch.Tensor, weight_D: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x_TD.float()
    return weight_D * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x_TD.dtype)


def rms_norm(x_TD: torch.Tensor, weight_D: torch.Tensor, eps: float) -> torch.Tensor:
    """As rms_norm_reference, through the C kernel for float32 x (any leading dims) and weight."""
    D = x_TD.shape[-1]
    rows_TD = x_TD.reshape(-1, D)
    if not (_f32_cpu(rows_TD, weight_D) and rows_TD.stride(1) == 1 and weight_D.is_contiguous()):
        return rms_norm_reference(x_TD, weight_D, eps)
    y_TD = rows_TD.new_empty(rows_TD.shape)
    torch.ops.moe_serve.rms_norm(rows_TD, weight_D, eps, y_TD)
    return y_TD.view(x_TD.shape)


def rope_reference(x_TNR: torch.Tensor, cos_TR2: torch.Tensor, sin_TR2: torch.Tensor, interleaved: bool) -> torch.Tensor:
    if interleaved:
        x1, x2 = x_TNR[..., 0::2], x_TNR[..., 1::2]
    else:
        half = x_TNR.shape[-1] // 2
        x1, x2 = x_TNR[..., :half], x_TNR[..., half:]
    cos, sin = cos_TR2[:, None, :].to(x_TNR.dtype), sin_TR2[:, None, :].to(x_TNR.dtype)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def _rope_fits(x_TNR: torch.Tensor, cos_TR2: torch.Tensor, sin_TR2: torch.Tensor) -> bool:
    return (_f32_cpu(x_TNR, cos_TR2, sin_TR2) and x_TNR.stride(2) == 1 and cos_TR2.is_contiguous()
            and sin_TR2.is_contiguous() and x_TNR.shape[2] % 2 == 0)


def rope(x_TNR: torch.Tensor, cos_TR2: torch.Tensor, sin_TR2: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """As rope_reference (output [first of each pair, second of each pair]), through the C kernel for
    float32 x with unit stride in R and contiguous float32 cos / sin."""
    if not _rope_fits(x_TNR, cos_TR2, sin_TR2):
        return rope_reference(x_TNR, cos_TR2, sin_TR2, interleaved)
    y_TNR = x_TNR.new_empty(x_TNR.shape)
    rope_into(x_TNR, cos_TR2, sin_TR2, interleaved, y_TNR)
    return y_TNR


def rope_into(x_TNR: torch.Tensor, cos_TR2: torch.Tensor, sin_TR2: torch.Tensor, interleaved: bool,
              out_TNR: torch.Tensor) -> None:
    """out = rope(x) for an output with unit stride in R (e.g. the rope tail of MLA's decode queries)."""
    if not (_rope_fits(x_TNR, cos_TR2, sin_TR2) and out_TNR.dtype == torch.float32 and out_TNR.stride(2) == 1):
        out_TNR.copy_(rope_reference(x_TNR, cos_TR2, sin_TR2, interleaved))
        return
    torch.ops.moe_serve.rope(x_TNR, cos_TR2, sin_TR2, interleaved, out_TNR)


def mla_cache_write_reference(kv_TD: torch.Tensor, norm_weight_C: torch.Tensor, eps: float, cos_TR2, sin_TR2,
                              interleaved: bool, kv_cache_NbD: torch.Tensor, slots_T: torch.Tensor) -> None:
    C = norm_weight_C.shape[0]
    latent_TC = rms_norm_reference(kv_TD[:, :C], norm_weight_C, eps)
    k_pe_TR = rope_reference(kv_TD[:, None, C:], cos_TR2, sin_TR2, interleaved)[:, 0]
    flat = kv_cache_NbD.view(-1, kv_cache_NbD.shape[-1])
    flat.index_copy_(0, slots_T, torch.cat((latent_TC, k_pe_TR), dim=-1).to(flat.dtype))


def mla_cache_write(kv_TD: torch.Tensor, norm_weight_C: torch.Tensor, eps: float, cos_TR2: torch.Tensor,
                    sin_TR2: torch.Tensor, interleaved: bool, kv_cache_NbD: torch.Tensor, slots_T: torch.Tensor) -> None:
    """MLA's cache write: each row of kv [T, C + R] (kv_a_proj_with_mqa's output) goes into cache row
    slots[t] as [kv_a_layernorm(latent), rope(k_pe)], rounded to the cache's bf16, in one call."""
    if not (_f32_cpu(kv_TD, norm_weight_C, cos_TR2, sin_TR2) and kv_cache_NbD.dtype == torch.bfloat16
            and kv_TD.stride(1) == 1 and kv_cache_NbD.is_contiguous() and norm_weight_C.is_contiguous()
            and cos_TR2.is_contiguous() and sin_TR2.is_contiguous() and slots_T.dtype == torch.int64
            and slots_T.is_contiguous()):
        mla_cache_write_reference(kv_TD, norm_weight_C, eps, cos_TR2, sin_TR2, interleaved, kv_cache_NbD, slots_T)
        return
    torch.ops.moe_serve.mla_cache_write(kv_TD, norm_weight_C, eps, cos_TR2, sin_TR2, interleaved, kv_cache_NbD,
                                        slots_T)


def route_noaux_tc(x_TH: torch.Tensor, gate_weight_EH: torch.Tensor, bias_E: torch.Tensor | None, num_groups: int,
                   topk_group: int, top_k: int, norm_topk_prob: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3's routing (noaux_tc, sigmoid) of float32 x by a float32 gate weight, logits included:
    (weights [T, K] float32, ids [T, K] int64), ids in descending order of choice. Reference:
    kernels.routing.route_reference (the torch version); the caller checks `route_fits`."""
    T = x_TH.shape[0]
    ids_TK = torch.empty(T, top_k, dtype=torch.int64)
    weights_TK = torch.empty(T, top_k, dtype=torch.float32)
    torch.ops.moe_serve.route_noaux_tc(x_TH, gate_weight_EH, bias_E, num_groups, topk_group, norm_topk_prob, scale,
                                       weights_TK, ids_TK)
    return weights_TK, ids_TK


def route_fits(x_TH: torch.Tensor, gate_weight_EH: torch.Tensor, bias_E: torch.Tensor | None, num_groups: int,
               topk_group: int, top_k: int) -> bool:
    E = gate_weight_EH.shape[0]
    return (_f32_cpu(x_TH, gate_weight_EH) and x_TH.dim() == 2 and x_TH.stride(1) == 1
            and gate_weight_EH.is_contiguous() and E % num_groups == 0 and top_k <= topk_group * (E // num_groups)
            and (bias_E is None or (_f32_cpu(bias_E) and bias_E.is_contiguous() and bias_E.numel() == E)))
