"""The MoE gate: router scores -> top-k expert ids and their weights (logical expert ids), through the
kernel backend's routing op (kernels/routing.py holds its settings and torch reference).

Legend: T = tokens, H = hidden size, E = routed experts, K = experts per token.
"""

from __future__ import annotations

import torch

from moe_serve.kernels import ops
from moe_serve.kernels.routing import RouterConfig
from moe_serve.moe.config import ModelConfig

__all__ = ["RouterConfig", "router_config", "route"]


def router_config(cfg: ModelConfig) -> RouterConfig:
    return RouterConfig(
        num_experts=cfg.n_routed_experts,
        top_k=cfg.num_experts_per_tok,
        topk_method=cfg.topk_method,
        scoring_func=cfg.scoring_func,
        num_groups=cfg.n_group or 1,
        topk_group=cfg.topk_group or 1,
        norm_topk_prob=cfg.norm_topk_prob,
        routed_scaling_factor=cfg.routed_scaling_factor,
    )


def route(x_TH: torch.Tensor, gate_weight_EH: torch.Tensor, rc: RouterConfig,
          bias_E: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (topk_weights_TK float32, topk_ids_TK int64). The bias steers the choice only."""
    return ops.route(x_TH, gate_weight_EH, bias_E, rc)
