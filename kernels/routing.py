"""MoE routing as the kernels take it: the router's settings, and the torch reference of the routing op
(scores -> group-limited top-k expert ids and their weights, logical expert ids). The CPU backend runs
DeepSeek-V3's routing in one C call (kernels/cpu_ops.py); this is what it must equal.

Legend: T = tokens, H = hidden size, E = routed experts, G = expert groups, K = experts per token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class RouterConfig:
    num_experts: int
    top_k: int
    topk_method: str  # greedy | group_limited_greedy | noaux_tc
    scoring_func: str  # softmax | sigmoid
    num_groups: int
    topk_group: int
    norm_topk_prob: bool
    routed_scaling_factor: float


def _mask_to_top_groups(scores_for_choice_TE: torch.Tensor, group_scores_TG: torch.Tensor, rc: RouterConfig) -> torch.Tensor:
    """Keep only experts of the `topk_group` best groups; others get -inf so they are never chosen."""
    T = scores_for_choice_TE.shape[0]
    group_idx = group_scores_TG.topk(rc.topk_group, dim=-1, sorted=False).indices
    keep_TG = torch.zeros_like(group_scores_TG, dtype=torch.bool).scatter_(1, group_idx, True)
    keep_TE = keep_TG[:, :, None].expand(T, rc.num_groups, rc.num_experts // rc.num_groups).reshape(T, rc.num_experts)
    return scores_for_choice_TE.masked_fill(~keep_TE, float("-inf"))


def route_reference(x_TH: torch.Tensor, gate_weight_EH: torch.Tensor, bias_E: torch.Tensor | None,
                    rc: RouterConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (topk_weights_TK float32, topk_ids_TK int64), in float32 whatever x's dtype. The bias steers
    the choice only."""
    logits_TE = F.linear(x_TH.float(), gate_weight_EH.float())
    scores_TE = logits_TE.sigmoid() if rc.scoring_func == "sigmoid" else logits_TE.softmax(dim=-1)
    T = scores_TE.shape[0]
    if rc.topk_method == "greedy":
        choice_TE = scores_TE
    elif rc.topk_method == "group_limited_greedy":
        group_scores_TG = scores_TE.view(T, rc.num_groups, rc.num_experts // rc.num_groups).amax(dim=-1)
        choice_TE = _mask_to_top_groups(scores_TE, group_scores_TG, rc)
    else:  # noaux_tc: the correction bias enters the choice; groups rank by their top-2 sum
        choice_TE = scores_TE + bias_E[None, :].float() if bias_E is not None else scores_TE
        group_scores_TG = choice_TE.view(T, rc.num_groups, rc.num_experts // rc.num_groups).topk(2, dim=-1).values.sum(dim=-1)
        choice_TE = _mask_to_top_groups(choice_TE, group_scores_TG, rc)
    topk_ids_TK = choice_TE.topk(rc.top_k, dim=-1, sorted=False).indices
    topk_weights_TK = scores_TE.gather(1, topk_ids_TK)
    if rc.norm_topk_prob and rc.top_k > 1:
        topk_weights_TK = topk_weights_TK / (topk_weights_TK.sum(dim=-1, keepdim=True) + 1e-20)
    return topk_weights_TK * rc.routed_scaling_factor, topk_ids_TK
