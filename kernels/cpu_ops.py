"""RMSNorm, rotary embedding and DeepSeek-V3's router for float32 on CPU, one C call each
(csrc/cpu_ops.c), beside their torch references. The model uses them where it computes bf16 weights in
float32 (server/runner.compute_dtype), as the other kernels of that mode: at decode sizes the composite
torch versions cost 5-15 us of dispatch per op, several ops each, on every layer.

Legend: T tokens, D features, N heads, R rope dims, E routed experts, G groups, K experts per token.
"""

from __future__ import annotations

import torch

from kernels import cpu_build


def _f32_cpu(*tensors: torch.Tensor) -> bool:
    return all(t.dtype == torch.float32 and t.device.type == "cpu" for t in tensors) and cpu_build.lib() is not None


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
    cpu_build.lib().rms_norm_f32(rows_TD.data_ptr(), rows_TD.stride(0), weight_D.data_ptr(), y_TD.data_ptr(), D,
                                 rows_TD.shape[0], D, eps)
    return y_TD.view(x_TD.shape)


def rope_reference(x_TNR: torch.Tensor, cos_TR2: torch.Tensor, sin_TR2: torch.Tensor, interleaved: bool) -> torch.Tensor:
    if interleaved:
        x1, x2 = x_TNR[..., 0::2], x_TNR[..., 1::2]
    else:
        half = x_TNR.shape[-1] // 2
        x1, x2 = x_TNR[..., :half], x_TNR[..., half:]
    cos, sin = cos_TR2[:, None, :].to(x_TNR.dtype), sin_TR2[:, None, :].to(x_TNR.dtype)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def rope(x_TNR: torch.Tensor, cos_TR2: torch.Tensor, sin_TR2: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """As rope_reference (output [first of each pair, second of each pair]), through the C kernel for
    float32 x with unit stride in R and contiguous float32 cos / sin."""
    T, N, R = x_TNR.shape
    if not (_f32_cpu(x_TNR, cos_TR2, sin_TR2) and x_TNR.stride(2) == 1 and cos_TR2.is_contiguous()
            and sin_TR2.is_contiguous() and R % 2 == 0):
        return rope_reference(x_TNR, cos_TR2, sin_TR2, interleaved)
    y_TNR = x_TNR.new_empty(T, N, R)
    cpu_build.lib().rope_f32(x_TNR.data_ptr(), x_TNR.stride(0), x_TNR.stride(1), cos_TR2.data_ptr(),
                             sin_TR2.data_ptr(), y_TNR.data_ptr(), N * R, R, T, N, R, int(interleaved))
    return y_TNR


def route_noaux_tc(logits_TE: torch.Tensor, bias_E: torch.Tensor | None, num_groups: int, topk_group: int,
                   top_k: int, norm_topk_prob: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3's routing (noaux_tc, sigmoid) of float32 logits: (weights [T, K] float32, ids [T, K] int64),
    ids in descending order of choice. Reference: experts.router.route (the torch version the model uses
    elsewhere); the caller checks `route_fits`."""
    T, E = logits_TE.shape
    ids_TK = torch.empty(T, top_k, dtype=torch.int64)
    weights_TK = torch.empty(T, top_k, dtype=torch.float32)
    bias_ptr = None if bias_E is None else bias_E.data_ptr()
    cpu_build.lib().route_noaux_tc_f32(logits_TE.data_ptr(), bias_ptr, T, E, num_groups, topk_group, top_k,
                                       int(norm_topk_prob), scale, ids_TK.data_ptr(), weights_TK.data_ptr())
    return weights_TK, ids_TK


def route_fits(logits_TE: torch.Tensor, bias_E: torch.Tensor | None, num_groups: int, topk_group: int,
               top_k: int) -> bool:
    E = logits_TE.shape[1]
    return (_f32_cpu(logits_TE) and logits_TE.is_contiguous() and E % num_groups == 0
            and top_k <= topk_group * (E // num_groups)
            and (bias_E is None or (_f32_cpu(bias_E) and bias_E.is_contiguous() and bias_E.numel() == E)))
