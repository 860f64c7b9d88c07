"""A whole decoder layer of a decode step in one C call (csrc/decode_layer.c): how `--dtype bfloat16` runs
its all-decode steps on a CPU without bf16 arithmetic, without tensor or expert parallelism.

The layer's kernels (RMSNorm, the bf16-weight linears, the MLA cache write, W_UK / W_UV, MLA decode, the
router, the experts) are the ones the model otherwise calls one by one from Python; between them, Python
and torch dispatch cost ~1 ms a layer on a 2 GHz core, more than the arithmetic of a few tokens. Here they
run back to back in C. The reference is the model's own layer made of those calls (moe/model.py
DecoderLayer with its decode kernel off); tests/test_cpu_kernels.py holds them equal.

`DecodeLayerKernel` takes the layer's tensors once (it keeps references to them: the C side holds their
addresses) and then runs steps. Legend: T tokens (= decode sequences), H hidden size, K experts per token.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from moe_serve.kernels import cpu_build

_I64, _F32, _P = ctypes.c_int64, ctypes.c_float, ctypes.c_void_p


class _DecodeLayer(ctypes.Structure):
    """Mirror of csrc/decode_layer.c's DecodeLayer (the library reports its size; `DecodeLayerKernel` checks)."""

    _fields_ = [(n, _I64) for n in ("H", "Qr", "N", "Dn", "R", "Dv", "C", "interleaved")] + \
               [(n, _F32) for n in ("eps_in", "eps_q", "eps_kv", "eps_post", "softmax_scale", "routed_scale")] + \
               [(n, _P) for n in ("in_norm", "q_a_norm", "kv_a_norm", "post_norm", "q_a", "q_b", "kv_a", "w_uk",
                                  "w_uv", "o")] + \
               [(n, _I64) for n in ("E", "G", "topk_group", "K", "norm_topk")] + \
               [(n, _P) for n in ("router", "router_bias")] + \
               [(n, _I64) for n in ("Ie", "Is")] + \
               [(n, _P) for n in ("w13", "w2", "sw13", "sw2")]


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
    [out, in]. q_a / q_a_norm None without q compression (then q_b is q_proj). w_uk [N, C, Dn], w_uv [N, Dv, C].
    The MLP: routed experts (router, w13 [E, 2 Ie, H], w2 [E, H, Ie]) plus an optional shared expert, or a
    dense MLP alone (router None): gate rows then up rows in mlp_w13 [2 I, H], mlp_w2 [H, I]."""

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


def _check(name: str, t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if t.dtype != dtype or not t.is_cpu or not t.is_contiguous():
        raise ValueError(f"decode layer kernel: {name} must be a contiguous {dtype} CPU tensor, "
                         f"got {t.dtype} {tuple(t.shape)} on {t.device}")
    return t


class DecodeLayerKernel:
    """The C layer for one decoder layer's weights; RuntimeError where the kernels cannot be built
    (`cpu_build.lib()` is None)."""

    def __init__(self, w: LayerWeights):
        lib = cpu_build.lib()
        if lib is None:
            raise RuntimeError("the CPU kernels are not built here")
        if lib.decode_layer_struct_size() != ctypes.sizeof(_DecodeLayer):
            raise RuntimeError("kernels/cpu_decode_layer.py's struct does not match csrc/decode_layer.c")
        bf16, f32 = torch.bfloat16, torch.float32
        N, C, Dn = w.w_uk_NCD.shape
        Dv, R = w.w_uv_NVC.shape[1], w.kv_a.shape[0] - C
        H, Qr = w.kv_a.shape[1], 0 if w.q_a is None else w.q_a.shape[0]
        s = _DecodeLayer(H=H, Qr=Qr, N=N, Dn=Dn, R=R, Dv=Dv, C=C,
                         interleaved=int(w.rope_interleaved), softmax_scale=w.softmax_scale)
        shapes = {"in_norm": (H,), "post_norm": (H,), "q_a": (Qr, H), "q_a_norm": (Qr,), "q_b": (N * (Dn + R), Qr or H),
                  "kv_a_norm": (C,), "w_uv": (N, Dv, C), "o": (H, N * Dv)}
        if w.router is not None:
            E, G, K = w.router.gate_EH.shape[0], w.router.num_groups, w.router.top_k
            if R % 2 or G < 1 or E % G or not 0 < K <= w.router.topk_group * (E // G):
                raise ValueError(f"decode layer kernel: routing {K} of {E} experts in {G} groups "
                                 f"(top {w.router.topk_group} groups) or rope dims {R} not supported")
            Ie = w.w2.shape[2]
            shapes.update({"router": (E, H), "router bias": (E,), "w13": (E, 2 * Ie, H), "w2": (E, H, Ie)})
        if w.mlp_w2 is not None:
            Is = w.mlp_w2.shape[1]
            shapes.update({"mlp_w13": (2 * Is, H), "mlp_w2": (H, Is)})
        held = []  # the tensors whose addresses the struct holds

        def ptr(name, t, dtype):
            held.append(_check(name, t, dtype))
            if name in shapes and tuple(t.shape) != shapes[name]:
                raise ValueError(f"decode layer kernel: {name} must be {shapes[name]}, got {tuple(t.shape)}")
            return t.data_ptr()

        s.in_norm, s.eps_in = ptr("in_norm", w.in_norm[0], f32), w.in_norm[1]
        if w.q_a is not None:
            s.q_a, (s.q_a_norm, s.eps_q) = ptr("q_a", w.q_a, bf16), (ptr("q_a_norm", w.q_a_norm[0], f32), w.q_a_norm[1])
        s.q_b = ptr("q_b", w.q_b, bf16)
        s.kv_a, (s.kv_a_norm, s.eps_kv) = ptr("kv_a", w.kv_a, bf16), (ptr("kv_a_norm", w.kv_a_norm[0], f32), w.kv_a_norm[1])
        s.w_uk, s.w_uv, s.o = ptr("w_uk", w.w_uk_NCD, bf16), ptr("w_uv", w.w_uv_NVC, bf16), ptr("o", w.o, bf16)
        s.post_norm, s.eps_post = ptr("post_norm", w.post_norm[0], f32), w.post_norm[1]
        if w.router is not None:
            r = w.router
            s.E, s.G, s.topk_group, s.K = r.gate_EH.shape[0], r.num_groups, r.topk_group, r.top_k
            s.norm_topk, s.routed_scale = int(r.norm_topk_prob), r.scale
            s.router = ptr("router", r.gate_EH, f32)
            s.router_bias = None if r.bias_E is None else ptr("router bias", r.bias_E, f32)
            s.Ie, s.w13, s.w2 = w.w2.shape[2], ptr("w13", w.w13, bf16), ptr("w2", w.w2, bf16)
        elif w.mlp_w13 is None:
            raise ValueError("decode layer kernel: a layer needs routed experts or a dense MLP")
        if w.mlp_w13 is not None:
            s.Is, s.sw13, s.sw2 = w.mlp_w2.shape[1], ptr("mlp_w13", w.mlp_w13, bf16), ptr("mlp_w2", w.mlp_w2, bf16)
        self._struct, self._held, self.top_k = s, held, s.K
        self._fn = lib.decode_layer_f32

    def forward(self, x_TH: torch.Tensor, cos_TR2: torch.Tensor, sin_TR2: torch.Tensor, kv_cache_NbD: torch.Tensor,
                slots_T: torch.Tensor, rows_B: torch.Tensor, tables_BM: torch.Tensor, lens_B: torch.Tensor,
                max_len: int, ids_TK: torch.Tensor | None = None) -> None:
        """x += the layer's attention, then x += its MLP, in place, for T decode tokens (T = B): sequence b is
        token row rows[b]. x float32 [T, H] contiguous; cos / sin float32 [T, R/2] contiguous; the bf16 cache
        contiguous; slots, rows, tables, lens contiguous int64 (max_len: the longest of lens). ids_TK
        (int64 [T, K], contiguous): receives the routed expert ids."""
        T = x_TH.shape[0]
        if max_len > tables_BM.shape[1] * kv_cache_NbD.shape[1]:
            raise ValueError(f"a context of {max_len} tokens does not fit {tables_BM.shape[1]} blocks of "
                             f"{kv_cache_NbD.shape[1]}")
        status = self._fn(ctypes.byref(self._struct), x_TH.data_ptr(), T, cos_TR2.data_ptr(), sin_TR2.data_ptr(),
                          kv_cache_NbD.data_ptr(), kv_cache_NbD.shape[1], slots_T.data_ptr(), rows_B.data_ptr(),
                          tables_BM.data_ptr(), tables_BM.stride(0), lens_B.data_ptr(),
                          None if ids_TK is None else ids_TK.data_ptr())
        if status > 0:
            raise ValueError(f"decode layer kernel: routed expert id out of range at pair {status - 1}")
        if status < 0:
            raise MemoryError("decode layer kernel: no memory for its scratch")


def fits(x_TH: torch.Tensor, cos_TR2: torch.Tensor, sin_TR2: torch.Tensor, kv_cache_NbD: torch.Tensor,
         slots_T: torch.Tensor) -> bool:
    """Whether a step's tensors suit the kernel (float32 activations, a bf16 cache, int64 slots, all contiguous
    on CPU)."""
    return (x_TH.dtype == cos_TR2.dtype == sin_TR2.dtype == torch.float32 and kv_cache_NbD.dtype == torch.bfloat16
            and slots_T.dtype == torch.int64 and x_TH.is_cpu and x_TH.is_contiguous() and cos_TR2.is_contiguous()
            and sin_TR2.is_contiguous() and kv_cache_NbD.is_contiguous() and slots_T.is_contiguous())
