"""A DeepSeek-V2/V3-family decoder: embedding, MLA + (dense MLP | MoE) blocks, final norm, lm head.

Runs on its own on random weights: `python -m moe.model`.
Legend: T = tokens in the step, H = hidden size, V = vocabulary, E = routed experts, K = top-k.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from moe_serve.balancer.locality import node_local_view
from moe_serve.balancer.placement import ReplicaChooser, build_log2phy
from moe_serve.experts.dispatch import DispatchStats, combine, dispatch
from moe_serve.experts.relocate import relocate
from moe_serve.experts.router import route, router_config
from moe_serve.experts.weights import ExpertWeights
from moe_serve.kernels import ops
from moe_serve.kernels.layer_spec import DecoderLayerSpec, Linear, Norm
from moe_serve.moe.attention import AttentionMetadata, MLAttention
from moe_serve.moe.config import ModelConfig
from moe_serve.moe.layers import MLP, RMSNorm, RotaryEmbedding
from moe_serve.moe.parallel_linear import ParallelLMHead, VocabParallelEmbedding, all_reduce, group_rank_size

class Gate(nn.Module):
    """The router's weight [E, H] and DeepSeek-V3's score-correction bias [E], float32 whatever the serving
    dtype (the reference routes in float32: a narrower gate could pick other experts)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        E = cfg.n_routed_experts
        self.weight = nn.Parameter(torch.empty(E, cfg.hidden_size, dtype=torch.float32), requires_grad=False)
        bias = torch.zeros(E, dtype=torch.float32) if cfg.topk_method == "noaux_tc" else None
        self.e_score_correction_bias = None if bias is None else nn.Parameter(bias, requires_grad=False)


class MoEBlock(nn.Module):
    """Router -> routed experts -> + shared experts.

    Without expert parallelism every rank holds every expert, tensor-parallel over `tp_group`, and
    one all-reduce sums routed and shared partial outputs. With it (`ep_group` of size > 1) rank r
    of the EP group holds slots [r * S, (r + 1) * S): each TP rank dispatches its share of the tokens
    to the ranks holding their experts, computes what it received with the fused MoE op, combines the
    results back, and the same single all-reduce over `tp_group` assembles tokens and shared experts.
    """

    def __init__(self, cfg: ModelConfig, tp_group=None, ep_group=None, phy2log_R: list[int] | None = None):
        """phy2log_R: the logical expert held by each of the EP group's physical slots (default: slot i
        holds expert i). More slots than experts means redundant replicas of some experts."""
        super().__init__()
        self.router_config = router_config(cfg)
        self.tp_group, self.ep_group = tp_group, ep_group
        tp_rank, tp_size = group_rank_size(tp_group)
        ep_rank, self.ep_size = group_rank_size(ep_group)
        E = self.num_experts = cfg.n_routed_experts
        phy2log_R = list(range(E)) if phy2log_R is None else list(phy2log_R)
        if len(phy2log_R) % self.ep_size:
            raise ValueError(f"expert parallel size {self.ep_size} does not divide {len(phy2log_R)} expert slots")
        if len(phy2log_R) > E and self.ep_size == 1:
            raise ValueError("redundant expert slots need expert parallelism (enable_expert_parallel)")
        self.slots_per_rank = len(phy2log_R) // self.ep_size
        self.gate = Gate(cfg)
        self.set_placement(phy2log_R)
        local = phy2log_R[ep_rank * self.slots_per_rank:(ep_rank + 1) * self.slots_per_rank]
        fp8 = cfg.quant_block_shape
        if self.ep_size > 1:  # experts whole on their EP rank
            self.experts = ExpertWeights(local, cfg.hidden_size, cfg.moe_intermediate_size, fp8_block=fp8)
        else:  # every expert here, sharded over TP
            self.experts = ExpertWeights(local, cfg.hidden_size, cfg.moe_intermediate_size, tp_rank, tp_size, fp8)
        n_shared = cfg.n_shared_experts or 0
        self.shared_experts = (MLP(cfg.hidden_size, cfg.moe_intermediate_size * n_shared, tp_group, reduce=False,
                                   fp8_block=fp8) if n_shared else None)
        self.comm_stats = DispatchStats()  # running totals of what dispatch and combine moved
        # Expert-load hook: called with (topk_ids_TK, phy_ids_TK) every forward (balancer.stats.ExpertLoadRecorder.record
        # bound to this layer); it counts on the device, without a host sync. None = not recording.
        self.load_recorder: Callable[[torch.Tensor, torch.Tensor], None] | None = None

    def set_placement(self, phy2log_R: list[int]) -> None:
        """Which expert each physical slot holds (the maps only; weights move with `relocate_experts`)."""
        self.phy2log_R = list(phy2log_R)
        self.identity_placement = self.phy2log_R == list(range(self.num_experts))
        log2phy_1EX, logcnt_1E = build_log2phy(torch.tensor([self.phy2log_R]), self.num_experts)
        device = self.gate.weight.device
        self.log2phy_EX, self.logcnt_E = log2phy_1EX[0].to(device), logcnt_1E[0].to(device)
        # each token's replica, chosen from the batch's load on the EP ranks (balancer/placement.py); when the EP
        # group spans nodes, among the replicas on this rank's node where the expert has some, else on its home
        # node (the node-local rule, balancer/locality.py)
        log2phy_EX, logcnt_E = self.log2phy_EX, self.logcnt_E
        if self.ep_group is not None and self.ep_group.num_nodes > 1:
            log2phy_EX, logcnt_E = node_local_view(log2phy_EX, logcnt_E, self.slots_per_rank,
                                                   self.ep_group.nodes, self.ep_group.nodes[self.ep_group.index])
        self.replica_chooser = ReplicaChooser(log2phy_EX, logcnt_E, self.ep_size, self.slots_per_rank)

    def relocate_experts(self, new_phy2log_R: list[int]) -> int:
        """Between steps: load the slots whose expert changes (weights and any FP8 scales) from the ranks
        holding those experts, then switch the maps. Returns how many slots (all ranks) loaded new weights."""
        moved = relocate(self.experts.slot_tensors(), self.phy2log_R, new_phy2log_R, self.ep_group)
        ep_rank, _ = group_rank_size(self.ep_group)
        self.experts.slot_to_expert = list(new_phy2log_R[ep_rank * self.slots_per_rank:(ep_rank + 1) * self.slots_per_rank])
        self.set_placement(new_phy2log_R)
        return moved

    def forward(self, x_TH: torch.Tensor) -> torch.Tensor:
        topk_weights_TK, topk_ids_TK = route(x_TH, self.gate.weight, self.router_config,
                                             self.gate.e_score_correction_bias)
        phy_ids_TK = topk_ids_TK if self.identity_placement else self.replica_chooser(topk_ids_TK)
        if self.load_recorder is not None:
            self.load_recorder(topk_ids_TK, phy_ids_TK)
        if self.ep_size == 1:  # routed and shared experts in one op
            shared = None if self.shared_experts is None else self.shared_experts.weights()
            y_TH = ops.fused_moe(x_TH, self.experts.weights(), topk_weights_TK, phy_ids_TK, shared)
        else:
            y_TH = self._expert_parallel(x_TH, topk_weights_TK, phy_ids_TK)
            if self.shared_experts is not None:
                y_TH = y_TH + self.shared_experts(x_TH)
        return all_reduce(y_TH, self.tp_group)

    def _expert_parallel(self, x_TH, topk_weights_TK, topk_ids_TK) -> torch.Tensor:
        """Each TP rank dispatches rows [lo, hi) of the (TP-replicated) tokens; the rows of the other
        TP ranks stay 0 here and arrive through the all-reduce."""
        tp_rank, tp_size = group_rank_size(self.tp_group)
        T = x_TH.shape[0]
        lo, hi = T * tp_rank // tp_size, T * (tp_rank + 1) // tp_size
        recv_x, recv_ids, recv_w, handle = dispatch(x_TH[lo:hi], topk_ids_TK[lo:hi], topk_weights_TK[lo:hi],
                                                    self.slots_per_rank, self.ep_group)
        y_recv = ops.fused_moe(recv_x, self.experts.weights(), recv_w, recv_ids)
        y_TH = torch.zeros_like(x_TH)
        y_TH[lo:hi] = combine(y_recv, handle, self.ep_group)
        self.comm_stats = self.comm_stats + handle.stats
        return y_TH


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, rope: RotaryEmbedding, tp_group=None, ep_group=None,
                 phy2log_R: list[int] | None = None):
        super().__init__()
        self.self_attn = MLAttention(cfg, rope, tp_group)
        self.mlp = (MoEBlock(cfg, tp_group, ep_group, phy2log_R) if cfg.is_moe_layer(layer_idx)
                    else MLP(cfg.hidden_size, cfg.intermediate_size, tp_group, fp8_block=cfg.quant_block_shape))
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.parallel = group_rank_size(tp_group)[1] > 1 or group_rank_size(ep_group)[1] > 1
        # The kernel backend's whole-layer path for steps of decode queries only (ops.fused_decode_layer,
        # set after loading), or None: the layer runs its modules.
        self.fast_decode: Callable | None = None

    def forward(self, x_TH, cos_TR2, sin_TR2, kv_cache, meta: AttentionMetadata) -> torch.Tensor:
        if self.fast_decode is not None and meta.all_decode:
            y_TH = self.fast_decode(x_TH, cos_TR2, sin_TR2, kv_cache, meta, getattr(self.mlp, "load_recorder", None))
            if y_TH is not None:  # None: inputs the fast path does not take (e.g. the KV cache's dtype)
                return y_TH
        x_TH = x_TH + self.self_attn(self.input_layernorm(x_TH), cos_TR2, sin_TR2, kv_cache, meta)
        return x_TH + self.mlp(self.post_attention_layernorm(x_TH))

    def kernel_spec(self) -> DecoderLayerSpec:
        """The layer's weights (its modules' own tensors), described for a backend's whole-layer path."""
        attn, mlp = self.self_attn, self.mlp
        moe = isinstance(mlp, MoEBlock)
        dense = mlp.shared_experts if moe else mlp
        q_lora = attn.q_lora_rank is not None

        def lin(m):
            return Linear(m.weight, m.weight_scale_inv)

        def norm(m):
            return Norm(m.weight, m.eps)

        return DecoderLayerSpec(
            in_norm=norm(self.input_layernorm), q_a=lin(attn.q_a_proj) if q_lora else None,
            q_a_norm=norm(attn.q_a_layernorm) if q_lora else None,
            q_b=lin(attn.q_b_proj if q_lora else attn.q_proj), kv_a=lin(attn.kv_a_proj_with_mqa),
            kv_a_norm=norm(attn.kv_a_layernorm), w_uk_NCD=attn.w_uk_NCD, w_uv_NVC=attn.w_uv_NVC,
            w_uk_scale=attn.w_uk_scale, w_uv_scale=attn.w_uv_scale, o=lin(attn.o_proj), softmax_scale=attn.scale,
            rope_interleaved=attn.rope.interleaved, post_norm=norm(self.post_attention_layernorm),
            router=mlp.router_config if moe else None, gate_EH=mlp.gate.weight if moe else None,
            gate_bias_E=mlp.gate.e_score_correction_bias if moe else None,
            experts=mlp.experts.weights() if moe else None, mlp=None if dense is None else dense.weights(),
            fp8_block=attn.fp8_block, parallel=self.parallel)


class MissingLayer(nn.Module):
    """Placeholder for a layer that lives on another pipeline stage (keeps checkpoint names aligned)."""


class DeepseekModel(nn.Module):
    """Parameter names match the checkpoint's (`model.layers.3.self_attn.kv_b_proj.weight`, ...).
    A pipeline stage holds layers [start, end); the first stage the embedding, the last the norm."""

    def __init__(self, cfg: ModelConfig, tp_group=None, ep_group=None, layer_range: tuple[int, int] | None = None,
                 placement: dict[int, list[int]] | None = None):
        super().__init__()
        self.config = cfg
        placement = placement or {}
        self.start, self.end = layer_range or (0, cfg.num_hidden_layers)
        self.is_first, self.is_last = self.start == 0, self.end == cfg.num_hidden_layers
        self.rope = RotaryEmbedding(cfg)
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp_group) if self.is_first else None
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, i, self.rope, tp_group, ep_group, placement.get(i)) if self.start <= i < self.end
            else MissingLayer()
            for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps) if self.is_last else None
        # This stage's layers, in order (slicing the ModuleList built a new one every forward: 18 us a step)
        self.local_layers: tuple[nn.Module, ...] = tuple(self.layers[self.start:self.end])

    def forward(self, input_ids_T, positions_T, kv_caches: list[torch.Tensor], meta: AttentionMetadata,
                hidden_TH: torch.Tensor | None = None) -> torch.Tensor:
        """`kv_caches` holds this stage's layers in order; later stages pass the previous stage's
        hidden states instead of token ids."""
        x_TH = self.embed_tokens(input_ids_T) if self.is_first else hidden_TH
        cos_TR2, sin_TR2 = self.rope.cos_sin(positions_T)
        for layer, kv_cache in zip(self.local_layers, kv_caches):
            x_TH = layer(x_TH, cos_TR2, sin_TR2, kv_cache, meta)
        return self.norm(x_TH) if self.is_last else x_TH


class DeepseekForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, tp_group=None, ep_group=None, layer_range: tuple[int, int] | None = None,
                 placement: dict[int, list[int]] | None = None):
        """placement: per MoE layer index, the expert held by each physical slot of the EP group."""
        super().__init__()
        self.config = cfg
        self.serving_dtype = torch.get_default_dtype()  # the runner builds the model under the serving dtype
        self.model = DeepseekModel(cfg, tp_group, ep_group, layer_range, placement)
        self.lm_head = ParallelLMHead(cfg.hidden_size, cfg.vocab_size, tp_group) if self.model.is_last else None
        if cfg.tie_word_embeddings:
            if not (self.model.is_first and self.model.is_last):
                raise ValueError("tie_word_embeddings is not supported with pipeline parallelism")
            self.lm_head.weight = self.model.embed_tokens.weight

    @property
    def num_local_layers(self) -> int:
        return self.model.end - self.model.start

    def forward(self, input_ids_T, positions_T, kv_caches, meta: AttentionMetadata, hidden_TH=None) -> torch.Tensor:
        return self.model(input_ids_T, positions_T, kv_caches, meta, hidden_TH)

    def compute_logits(self, hidden_TH: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden_TH).float()

    def moe_blocks(self) -> dict[int, "MoEBlock"]:
        """This stage's MoE blocks by layer index."""
        return {i: layer.mlp for i, layer in enumerate(self.model.layers) if isinstance(getattr(layer, "mlp", None), MoEBlock)}

    def decode_rows_limit(self) -> int:
        """Prompt chunks of up to this many queries run as decode rows (one per query, the absorbed form)
        whatever their attention's cost: where every local layer has the backend's whole-layer path, which
        takes all-decode steps only, the fewest `chunk_rows` it names; else 0."""
        return self._whole_layer_limit("chunk_rows")

    def decode_context_limit(self) -> int:
        """Prompt chunks whose context ends by this many tokens run as decode rows too, however many their
        queries: as decode_rows_limit, the fewest `chunk_context` the whole-layer paths name."""
        return self._whole_layer_limit("chunk_context")

    def _whole_layer_limit(self, name: str) -> int:
        fast = [layer.fast_decode for layer in self.model.local_layers]
        if not fast or any(f is None for f in fast):
            return 0
        return min(getattr(f, name, 0) for f in fast)

    def after_loading(self) -> None:
        """Once, after the weights are in: MLA's absorbed per-head weights, the kernel backend's preparation
        (kernels/ops.py), and each layer's whole-layer decode path where the backend has one."""
        layers = self.model.local_layers
        for layer in layers:
            layer.self_attn.absorb_weights()
        ops.prepare(self)
        for layer in layers:
            layer.fast_decode = ops.fused_decode_layer(layer.kernel_spec())


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
    from moe_serve.moe.attention import PrefillSeq

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
