"""A whole decoder layer of a decode step in one C call (csrc/decode_layer.cpp, the torch op
moe_serve::decode_layer): how `--dtype bfloat16` runs its all-decode steps on a CPU without bf16 arithmetic,
without tensor or expert parallelism.

The layer's kernels (RMSNorm, the bf16- or FP8-weight linears, the MLA cache write, W_UK / W_UV, MLA decode,
the router, the experts) are the ones the model otherwise calls one by one from Python; between them,
Python and torch dispatch cost ~1 ms a layer on a 2 GHz core, more than the arithmetic of a few tokens.
Here they run back to back in C. The reference is the model's own layer made of those calls (moe/model.py
DecoderLayer with its decode kernel off); tests/test_cpu_kernels.py holds them equal.

`DecodeLayerKernel` takes the layer's tensors once (the op checks them then, and again, cheaply, on every
step) and then runs steps, passing them to the op as one list. Legend: T tokens (= decode sequences),
H hidden size, K experts per token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moe_serve.kernels import cpu_build

# The op's tensors, in its order (csrc/torch_ops.cpp, the enum before decode_layer); None where absent.
TENSORS = ("in_norm", "q_a", "q_a_scale", "q_a_norm", "q_b", "q_b_scale", "kv_a", "kv_a_scale", "kv_a_norm", "w_uk",
           "w_uk_scale", "w_uv", "w_uv_scale", "o", "o_scale", "post_norm", "router", "router_bias", "w13",
           "w13_scale", "w2", "w2_scale", "mlp_w13", "mlp_w13_scale", "mlp_w2", "mlp_w2_scale")


@dataclass
class Router:
    """DeepSeek-V3 routing (noaux_tc, sigmoid): the gate [E, H] and bias [E] (or None) float32."""

    gate_EH: torch.Tensor
    bias_E: torch.Tensor | None
    num_groups: int
    topk_group: int
    top_k: int
    norm_topk_prob: bool
    scale: float


@dataclass
class LayerWeights:
    """One decoder layer as the model holds it in this mode. Norm weights float32 with their eps; linears bf16
    [out, in], or FP8 with their block scales (the *_scale fields) in blocks of fp8_block; each with unit
    stride in `in`. q_a / q_a_norm None without q compression (then q_b is q_proj). w_uk [N, C, Dn],
    w_uv [N, Dv, C] (a view of kv_b_proj's weight will do). The MLP: routed experts (router, w13 [E, 2 Ie, H],
    w2 [E, H, Ie]) plus an optional shared expert, or a dense MLP alone (router None): gate rows then up rows
    in mlp_w13 [2 I, H], mlp_w2 [H, I]."""

    in_norm: tuple[torch.Tensor, float]
    q_a: torch.Tensor | None
    q_a_norm: tuple[torch.Tensor, float] | None
    q_b: torch.Tensor
    kv_a: torch.Tensor
    kv_a_norm: tuple[torch.Tensor, float]
    w_uk_NCD: torch.Tensor
    w_uv_NVC: torch.Tensor
    o: torch.Tensor
    softmax_scale: float
    rope_interleaved: bool
    post_norm: tuple[torch.Tensor, float]
    router: Router | None
    w13: torch.Tensor | None
    w2: torch.Tensor | None
    mlp_w13: torch.Tensor | None
    mlp_w2: torch.Tensor | None
    q_a_scale: torch.Tensor | None = None
    q_b_scale: torch.Tensor | None = None
    kv_a_scale: torch.Tensor | None = None
    w_uk_scale: torch.Tensor | None = None
    w_uv_scale: torch.Tensor | None = None
    o_scale: torch.Tensor | None = None
    w13_scale: torch.Tensor | None = None
    w2_scale: torch.Tensor | None = None
    mlp_w13_scale: torch.Tensor | None = None
    mlp_w2_scale: torch.Tensor | None = None
    fp8_block: tuple[int, int] | None = None


class DecodeLayerKernel:
    """The C layer for one decoder layer's weights: ValueError for weights it does not take (the op's
    message names the tensor), RuntimeError where the kernels cannot run here."""

    def __init__(self, w: LayerWeights):
        if not cpu_build.available():
            raise RuntimeError(f"the CPU kernels cannot run here: {cpu_build.unavailable_reason()}")
        r = w.router
        given = {**{name: getattr(w, name) for name in TENSORS if hasattr(w, name)},
                 "in_norm": w.in_norm[0], "q_a_norm": None if w.q_a_norm is None else w.q_a_norm[0],
                 "kv_a_norm": w.kv_a_norm[0], "w_uk": w.w_uk_NCD, "w_uv": w.w_uv_NVC, "post_norm": w.post_norm[0],
                 "router": None if r is None else r.gate_EH, "router_bias": None if r is None else r.bias_E}
        self._tensors = [given[name] for name in TENSORS]
        self._config = [int(w.rope_interleaved), 1 if r is None else r.num_groups, 1 if r is None else r.topk_group,
                        0 if r is None else r.top_k, int(r is not None and r.norm_topk_prob), *(w.fp8_block or (0, 0))]
        self._scalars = [w.in_norm[1], 0.0 if w.q_a_norm is None else w.q_a_norm[1], w.kv_a_norm[1], w.post_norm[1],
                         w.softmax_scale, 1.0 if r is None else r.scale]
        self.top_k = self._config[3]
        H, D, R = w.in_norm[0].shape[0], w.kv_a.shape[0], w.kv_a.shape[0] - w.kv_a_norm[0].shape[0]
        none_i64 = torch.empty(0, dtype=torch.int64)
        self.forward(torch.empty(0, H), torch.empty(0, R // 2), torch.empty(0, R // 2),  # a step of no tokens:
                     torch.empty(0, 1, D, dtype=torch.bfloat16), none_i64, none_i64,       # the op checks the weights
                     torch.empty(0, 1, dtype=torch.int64), none_i64, 0)

    def forward(self, x_TH: torch.Tensor, cos_TR2: torch.Tensor, sin_TR2: torch.Tensor, kv_cache_NbD: torch.Tensor,
                slots_T: torch.Tensor, rows_B: torch.Tensor, tables_BM: torch.Tensor, lens_B: torch.Tensor,
                max_len: int, ids_TK: torch.Tensor | None = None) -> None:
        """x += the layer's attention, then x += its MLP, in place, for T decode tokens (T = B): sequence b is
        token row rows[b]. x float32 [T, H] contiguous; cos / sin float32 [T, R/2] contiguous; the bf16 cache
        contiguous; slots, rows, lens contiguous int64, tables int64 (max_len, the longest of lens, is not
        needed: the op checks every length and block). ids_TK (int64 [T, K], contiguous): receives the routed
        expert ids."""
        torch.ops.moe_serve.decode_layer(x_TH, self._tensors, self._config, self._scalars, cos_TR2, sin_TR2,
                                         kv_cache_NbD, slots_T, rows_B, tables_BM, lens_B, ids_TK)


def fits(x_TH: torch.Tensor, cos_TR2: torch.Tensor, sin_TR2: torch.Tensor, kv_cache_NbD: torch.Tensor,
         slots_T: torch.Tensor) -> bool:
    """Whether a step's tensors suit the kernel (float32 activations, a bf16 cache, int64 slots, all contiguous
    on CPU)."""
    return (x_TH.dtype == cos_TR2.dtype == sin_TR2.dtype == torch.float32 and kv_cache_NbD.dtype == torch.bfloat16
            and slots_T.dtype == torch.int64 and x_TH.is_cpu and x_TH.is_contiguous() and cos_TR2.is_contiguous()
            and sin_TR2.is_contiguous() and kv_cache_NbD.is_contiguous() and slots_T.is_contiguous())
