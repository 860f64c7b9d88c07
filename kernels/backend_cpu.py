"""The CPU backend: x86 with AVX2 + FMA and the C kernels built (kernels/cpu_build.py).

Activations are float32; linear, expert and absorbed-attention weights stay as loaded (bf16, or FP8 with
block scales) and the kernels widen them in registers as they compute: half (a quarter) the bytes a
decode step reads, and float32 arithmetic on CPUs with or without bf16 instructions. At decode sizes
the torch ops' dispatch costs more than their arithmetic, so RMSNorm, rope, the MLA cache write, the
router and the experts are one C call each, and an all-decode step runs each decoder layer in one call
(`fused_decode_layer`, csrc/decode_layer.c) where the layer has no tensor or expert parallelism.
Whatever a kernel does not take (float32 or float16 weights, other routing methods) runs the torch
reference of kernels/backend_torch.py.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from moe_serve.kernels import cpu_attention, cpu_bf16w, cpu_build, cpu_decode_layer, cpu_mla, cpu_moe, cpu_ops
from moe_serve.kernels.backend_torch import TorchBackend
from moe_serve.kernels.layer_spec import DecoderLayerSpec
from moe_serve.kernels.ops import MLPWeights
from moe_serve.kernels.routing import RouterConfig

log = logging.getLogger(__name__)


def _kernel_weight(w: torch.Tensor, scale: torch.Tensor | None) -> bool:
    """A weight the C kernels widen as they compute: bf16 without scales, or block FP8 with its scales."""
    return (w.dtype == torch.bfloat16 and scale is None) or (w.dtype == torch.float8_e4m3fn and scale is not None)


def _linear_shapes(model: torch.nn.Module, most: int = 4) -> list[tuple[int, int]]:
    """The (out, in) shapes of the model's bf16 linear weights that hold the most parameters in all, up to `most`."""
    count: dict[tuple[int, int], int] = {}
    for module in model.modules():
        w = getattr(module, "weight", None)
        if isinstance(w, torch.Tensor) and w.dim() == 2 and w.dtype == torch.bfloat16 \
                and not isinstance(module, torch.nn.Embedding):
            count[tuple(w.shape)] = count.get(tuple(w.shape), 0) + w.numel()
    return sorted(count, key=count.get, reverse=True)[:most]


class CpuBackend(TorchBackend):
    name = "cpu"
    linear_row_limit = cpu_bf16w.MAX_ROWS  # until prepare() measures it

    def __init__(self, device: torch.device | str = "cpu", fp8_block: tuple[int, int] | None = None):
        super().__init__(device, fp8_block)
        if self.device.type != "cpu":
            raise ValueError(f"--kernel-backend cpu runs on the CPU, not on {self.device}")
        if fp8_block and any(b <= 0 or b % 8 for b in fp8_block):
            raise ValueError(f"--kernel-backend cpu takes FP8 blocks of multiples of 8, this checkpoint's "
                             f"weight_block_size is {list(fp8_block)}; use --kernel-backend torch")

    @staticmethod
    def unavailable_reason() -> str | None:
        """Why this machine cannot run the backend, or None when it can (the kernels are built on this call)."""
        return cpu_build.unavailable_reason()

    def describe(self) -> str:
        isa = {"amx": "AVX-512 + AMX", "avx512bf16": "AVX-512 + AVX512-BF16", "avx512": "AVX-512"}.get(
            cpu_build.isa(), "AVX2 + FMA")
        where = "the AMX tiles" if cpu_build.isa() == "amx" else "AVX512-BF16 dot products"
        tiles = cpu_build.tile_rows()
        weights = ("bf16 weights (FP8 ones too, served in bf16)" if cpu_build.isa() == "avx512bf16"
                   else "bf16 weights")
        amx = (f"; products of {tiles}+ rows by {weights} on {where} in bf16 (float32 sums)" if tiles else "")
        return (f"C kernels ({isa}), float32 activations, bf16 and FP8 weights widened as used{amx}, "
                "one call per decoder layer for decode steps")

    # ---- preparation -------------------------------------------------------------------------
    def prepare(self, model: torch.nn.Module) -> None:
        """Vectors (norm weights, the router's correction bias) in float32, as the kernels take them; the
        weights of products stay as loaded."""
        for p in model.parameters():
            if p.dim() == 1 and p.is_floating_point() and p.dtype != torch.float32:
                p.data = p.data.float()
        # FP8 products on bf16 dot products (AVX512-BF16) for a model served in bf16, x rounded as
        # for its bf16 weights; served in float32 they stay float32 (the exact dequantised reference)
        cpu_build.fp8_tiles(getattr(model, "serving_dtype", torch.float32) == torch.bfloat16)
        self.linear_row_limit = cpu_bf16w.kernel_row_limit(_linear_shapes(model))
        log.info("cpu backend: linears of bf16 weights take the C kernel up to %d rows, MKL on a widened copy "
                 "beyond (measured on this machine)", self.linear_row_limit)

    def step_threads(self):
        return cpu_build.kernel_threads()

    def fused_decode_layer(self, spec: DecoderLayerSpec):
        """The whole layer in one C call (csrc/decode_layer.c), or None where it does not apply: tensor or
        expert parallelism, routing other than DeepSeek-V3's, or weights other than bf16."""
        if spec.parallel:
            return None
        rc = spec.router
        if rc is not None and not (rc.topk_method == "noaux_tc" and rc.scoring_func == "sigmoid"):
            return None
        linears = [spec.q_b, spec.kv_a, spec.o] + ([spec.q_a] if spec.q_a is not None else [])
        mlps = [m for m in (spec.experts, spec.mlp) if m is not None]
        if (not all(_kernel_weight(lin.weight, lin.scale_inv) for lin in linears)
                or not all(_kernel_weight(m.w13, m.w13_scale) and _kernel_weight(m.w2, m.w2_scale) for m in mlps)
                or not _kernel_weight(spec.w_uk_NCD, spec.w_uk_scale) or not _kernel_weight(spec.w_uv_NVC, spec.w_uv_scale)
                or (rc is not None and spec.gate_EH.dtype != torch.float32)):
            return None
        router = None if rc is None else cpu_decode_layer.Router(
            spec.gate_EH, spec.gate_bias_E, rc.num_groups, rc.topk_group, rc.top_k, rc.norm_topk_prob,
            rc.routed_scaling_factor)
        norm = lambda n: (n.weight, n.eps)  # noqa: E731
        ex, mlp = spec.experts, spec.mlp
        weights = cpu_decode_layer.LayerWeights(
            in_norm=norm(spec.in_norm), q_a=None if spec.q_a is None else spec.q_a.weight,
            q_a_norm=None if spec.q_a_norm is None else norm(spec.q_a_norm), q_b=spec.q_b.weight,
            kv_a=spec.kv_a.weight, kv_a_norm=norm(spec.kv_a_norm), w_uk_NCD=spec.w_uk_NCD, w_uv_NVC=spec.w_uv_NVC,
            o=spec.o.weight, softmax_scale=spec.softmax_scale, rope_interleaved=spec.rope_interleaved,
            post_norm=norm(spec.post_norm), router=router,
            w13=None if ex is None else ex.w13, w2=None if ex is None else ex.w2,
            mlp_w13=None if mlp is None else mlp.w13, mlp_w2=None if mlp is None else mlp.w2,
            q_a_scale=None if spec.q_a is None else spec.q_a.scale_inv, q_b_scale=spec.q_b.scale_inv,
            kv_a_scale=spec.kv_a.scale_inv, w_uk_scale=spec.w_uk_scale, w_uv_scale=spec.w_uv_scale,
            o_scale=spec.o.scale_inv, w13_scale=None if ex is None else ex.w13_scale,
            w2_scale=None if ex is None else ex.w2_scale, mlp_w13_scale=None if mlp is None else mlp.w13_scale,
            mlp_w2_scale=None if mlp is None else mlp.w2_scale, fp8_block=self.fp8_block)
        try:
            return FusedDecodeLayer(cpu_decode_layer.DecodeLayerKernel(weights))
        except (ValueError, RuntimeError):  # a shape the kernel does not take: the layer runs op by op
            return None

    # ---- ops ---------------------------------------------------------------------------------
    def embedding(self, ids_T: torch.Tensor, weight_VH: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids_T, weight_VH).float()

    def linear(self, x_TI, w_OI, scale_inv=None, bias_O=None) -> torch.Tensor:
        if scale_inv is None and x_TI.numel() > self.linear_row_limit * x_TI.shape[-1]:
            return super().linear(x_TI, w_OI, scale_inv, bias_O)  # many rows of a bf16 weight: MKL (measured)
        if _kernel_weight(w_OI, scale_inv) and x_TI.dtype == torch.float32:
            return cpu_bf16w.linear(x_TI, w_OI, bias_O, scale_inv, self.fp8_block)
        return super().linear(x_TI, w_OI, scale_inv, bias_O)

    def rms_norm(self, x_TD, w_D, eps: float) -> torch.Tensor:
        return cpu_ops.rms_norm(x_TD, w_D, eps)

    def rope(self, x_TNR, cos_TR2, sin_TR2, interleaved: bool) -> torch.Tensor:
        return cpu_ops.rope(x_TNR, cos_TR2, sin_TR2, interleaved)

    def mla_cache_write(self, kv_TD, norm_w_C, eps, cos_TR2, sin_TR2, interleaved, kv_cache, slots_T) -> None:
        cpu_ops.mla_cache_write(kv_TD, norm_w_C, eps, cos_TR2, sin_TR2, interleaved, kv_cache, slots_T)

    def bmm_wt(self, x_BMK: torch.Tensor, w_BOK: torch.Tensor, scale_inv=None) -> torch.Tensor:
        if _kernel_weight(w_BOK, scale_inv) and x_BMK.dtype == torch.float32:
            return cpu_bf16w.bmm(x_BMK, w_BOK, scale_inv, self.fp8_block)
        return super().bmm_wt(x_BMK, w_BOK, scale_inv)

    def mla_decode(self, q_BNK, kv_cache, meta, latent_dim: int, scale: float) -> torch.Tensor:
        if not cpu_mla.fits(q_BNK, kv_cache):
            return super().mla_decode(q_BNK, kv_cache, meta, latent_dim, scale)
        _, tables_BM, lens_B, max_len = meta.decode_i64()
        out_BNC = q_BNK.new_empty(q_BNK.shape[0], q_BNK.shape[1], latent_dim)
        if q_BNK.shape[0]:
            cpu_mla.mla_decode_into(q_BNK, kv_cache, tables_BM, lens_B, latent_dim, scale, None, max_len, out_BNC)
        return out_BNC

    def prefill_attention(self, q_NQK, k_NLK, v_NLV, scale: float, stored_dtype: torch.dtype) -> torch.Tensor:
        if cpu_attention.fits(q_NQK, k_NLK, v_NLV, stored_dtype):
            return cpu_attention.prefill_attention_bf16(q_NQK, k_NLK, v_NLV, scale)
        return super().prefill_attention(q_NQK, k_NLK, v_NLV, scale, stored_dtype)

    def route(self, x_TH, gate_EH, bias_E, rc: RouterConfig):
        if (rc.topk_method == "noaux_tc" and rc.scoring_func == "sigmoid"
                and cpu_ops.route_fits(x_TH, gate_EH, bias_E, rc.num_groups, rc.topk_group, rc.top_k)):
            return cpu_ops.route_noaux_tc(x_TH, gate_EH, bias_E, rc.num_groups, rc.topk_group, rc.top_k,
                                          rc.norm_topk_prob, rc.routed_scaling_factor)
        return super().route(x_TH, gate_EH, bias_E, rc)

    def fused_moe(self, x_TH, experts: MLPWeights, topk_weights_TK, topk_ids_TK,
                  shared: MLPWeights | None = None) -> torch.Tensor:
        """Routed experts and the shared expert in one C call where the weights are bf16 or block FP8."""
        shared_ok = shared is None or cpu_moe.fits(x_TH, shared.w13[None], shared.w2[None], shared.w13_scale,
                                                   shared.w2_scale)
        if shared_ok and cpu_moe.fits(x_TH, experts.w13, experts.w2, experts.w13_scale, experts.w2_scale):
            s = shared or MLPWeights(None, None)
            return cpu_moe.fused_moe_bf16w(x_TH, experts.w13, experts.w2, topk_weights_TK, topk_ids_TK, s.w13, s.w2,
                                           w13_scale=experts.w13_scale, w2_scale=experts.w2_scale,
                                           shared_w13_scale=s.w13_scale, shared_w2_scale=s.w2_scale,
                                           block=self.fp8_block)
        return super().fused_moe(x_TH, experts, topk_weights_TK, topk_ids_TK, shared)


class FusedDecodeLayer:
    """A decoder layer's all-decode step in one C call: x [T, H] in, x plus attention plus MLP out."""

    # A step with one prompt chunk in it runs every layer op by op (~1 ms of Python and torch dispatch a layer
    # on a 2 GHz core, and the chunk's context decompressed). Up to this many queries a chunk is cheaper as
    # decode rows, one per query in the absorbed form, whatever the extra attention work that
    # moe/attention.py absorbed_is_cheaper counts. Bench model, 2 cores (docs/benchmarks.md): a whole prompt
    # of 8 / 64 / 256 tokens 6.4 -> 4.9, 13.9 -> 11.4, 37.6 -> 34.4 ms; chunks of 256 after 768 / 1792 cached
    # tokens 55 -> 51, 179 -> 98 ms.
    chunk_rows = 256
    # So is a longer chunk whose context ends by this many tokens (the layer takes its rows in blocks): whole
    # prompts of 384 / 1024 / 2048 tokens 60-66 -> 50-52, 257-265 -> 169-175, 593-596 -> 455-496 ms; chunks of
    # 1024 ending at 2048 / 3072 tokens 460 -> 317, 609 -> 555 ms, but at 4096 741 -> 794.
    chunk_context = 3072

    def __init__(self, kernel: cpu_decode_layer.DecodeLayerKernel):
        self.kernel = kernel

    def __call__(self, x_TH, cos_TR2, sin_TR2, kv_cache, meta, recorder=None) -> torch.Tensor | None:
        """The layer's output, or None for inputs the kernel does not take (float32 activations and a bf16 KV
        cache): the layer then runs op by op."""
        if not cpu_decode_layer.fits(x_TH, cos_TR2, sin_TR2, kv_cache, meta.slot_mapping_T):
            return None
        rows_B, tables_BM, lens_B, max_len = meta.decode_i64()
        x_TH = x_TH.clone()
        ids_TK = None if recorder is None else torch.empty(x_TH.shape[0], self.kernel.top_k, dtype=torch.int64)
        self.kernel.forward(x_TH, cos_TR2, sin_TR2, kv_cache, meta.slot_mapping_T, rows_B, tables_BM, lens_B,
                            max_len, ids_TK)
        if recorder is not None:
            recorder(ids_TK, ids_TK)  # one slot per expert without expert parallelism: physical ids are logical
        return x_TH
