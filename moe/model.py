"""A DeepSeek-V2/V3-family decoder: embedding, MLA + (dense MLP | MoE) blocks, final norm, lm head.

Runs on its own on random weights: `python -m moe.model`.
Legend: T = tokens in the step, H = hidden size, V = vocabulary, E = routed experts, K = top-k.
"""

from __future__ import annotations

import torch
from torch import nn

from experts.router import RouterConfig, route
from experts.weights import ExpertWeights
from kernels import fused_moe
from moe.attention import AttentionMetadata, MLAttention
from moe.config import ModelConfig
from moe.layers import MLP, RMSNorm, RotaryEmbedding


class Gate(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(cfg.n_routed_experts, cfg.hidden_size), requires_grad=False)
        bias = torch.zeros(cfg.n_routed_experts) if cfg.topk_method == "noaux_tc" else None
        self.e_score_correction_bias = None if bias is None else nn.Parameter(bias, requires_grad=False)


class MoEBlock(nn.Module):
    """Router -> routed experts (grouped GEMM) -> + shared experts."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.router_config = RouterConfig.from_model(cfg)
        self.gate = Gate(cfg)
        self.experts = ExpertWeights(cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size)
        n_shared = cfg.n_shared_experts or 0
        self.shared_experts = MLP(cfg.hidden_size, cfg.moe_intermediate_size * n_shared) if n_shared else None

    def forward(self, x_TH: torch.Tensor) -> torch.Tensor:
        topk_weights_TK, topk_ids_TK = route(x_TH, self.gate.weight, self.router_config, self.gate.e_score_correction_bias)
        y_TH = fused_moe(x_TH, self.experts.w13, self.experts.w2, topk_weights_TK, topk_ids_TK)
        if self.shared_experts is not None:
            y_TH = y_TH + self.shared_experts(x_TH)
        return y_TH


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, rope: RotaryEmbedding):
        super().__init__()
        self.self_attn = MLAttention(cfg, rope)
        self.mlp = MoEBlock(cfg) if cfg.is_moe_layer(layer_idx) else MLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x_TH, cos_TR2, sin_TR2, kv_cache, meta: AttentionMetadata) -> torch.Tensor:
        x_TH = x_TH + self.self_attn(self.input_layernorm(x_TH), cos_TR2, sin_TR2, kv_cache, meta)
        return x_TH + self.mlp(self.post_attention_layernorm(x_TH))


class DeepseekModel(nn.Module):
    """Parameter names match the checkpoint's (`model.layers.3.self_attn.kv_b_proj.weight`, ...)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.rope = RotaryEmbedding(cfg)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, self.rope) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, input_ids_T, positions_T, kv_caches: list[torch.Tensor], meta: AttentionMetadata) -> torch.Tensor:
        x_TH = self.embed_tokens(input_ids_T)
        cos_TR2, sin_TR2 = self.rope.cos_sin(positions_T)
        for layer, kv_cache in zip(self.layers, kv_caches):
            x_TH = layer(x_TH, cos_TR2, sin_TR2, kv_cache, meta)
        return self.norm(x_TH)


class DeepseekForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.model = DeepseekModel(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids_T, positions_T, kv_caches, meta: AttentionMetadata) -> torch.Tensor:
        return self.model(input_ids_T, positions_T, kv_caches, meta)

    def compute_logits(self, hidden_TH: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden_TH).float()

    def after_loading(self) -> None:
        for layer in self.model.layers:
            layer.self_attn.absorb_weights()


def _demo() -> None:
    """Random weights, one prompt of 5 tokens through a 2-block cache: prints the greedy next token."""
    cfg = ModelConfig(
        model_type="deepseek_v3", vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
        q_lora_rank=32, moe_intermediate_size=32, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
        first_k_dense_replace=1, n_group=2, topk_group=1, topk_method="noaux_tc", scoring_func="sigmoid",
    )
    torch.manual_seed(0)
    model = DeepseekForCausalLM(cfg)
    for p in model.parameters():
        p.data.normal_(0, 0.1)
    model.after_loading()
    block_size, T = 4, 5
    kv_caches = [torch.zeros(2, block_size, cfg.kv_cache_dim) for _ in range(cfg.num_hidden_layers)]
    from moe.attention import PrefillSeq

    meta = AttentionMetadata(
        slot_mapping_T=torch.arange(T), decode_token_idx_B=torch.empty(0, dtype=torch.long),
        decode_block_tables_BM=torch.empty(0, 1, dtype=torch.long), decode_context_lens_B=torch.empty(0, dtype=torch.long),
        prefills=[PrefillSeq(0, T, T, torch.tensor([0, 1]))],
    )
    with torch.no_grad():
        hidden = model(torch.tensor([1, 2, 3, 4, 5]), torch.arange(T), kv_caches, meta)
        print("next token:", model.compute_logits(hidden[-1:]).argmax(-1).item())


if __name__ == "__main__":
    _demo()
