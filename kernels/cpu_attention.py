"""A prompt chunk's attention on the bf16 products of the AMX or AVX512-BF16 build (kernels/cpu_bf16w.py).

MLA's prompt attention runs in the non-absorbed form (moe/attention.py `_prefill`): per head, scores
q k^T over 192 key dims, a causal softmax, then p v over 128 value dims. In float32 the two products take
most of a long prompt's step (a 1024-token prompt: ~60 ms a layer on two cores, at ~90 GFLOP/s). Where the
cache holds the latents in bf16 (k and v are computed from them) and the build has bf16 products, both
products run there, as every linear of the bf16 model already does: q (scaled) and the probabilities rounded
to bf16, k and v held in bf16, float32 sums, a float32 softmax. Between the products the causal softmax and
the values' transposed bf16 layout run in C too (csrc/prompt_attention.cpp, ops moe_serve::causal_softmax and
moe_serve::values_t). `reference` is the same in torch.

Chunks of fewer than MIN_QUERIES queries stay in float32: converting and padding k and v costs more than
the faster products save there (16 queries: 1.5-1.7x slower; 32: even; 64 over 256 keys: 1.6x faster).
The products take K a multiple of 32 and O one of 16: the context is padded with zero keys to a multiple of
32 (masked like future ones), and the key and value dims with zeros to multiples of 32 and 16.

Shapes: q [N, Q, K] float32 (unit stride in K), k [N, L, K], v [N, L, V]; query i sits at position L - Q + i.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from moe_serve.kernels import cpu_bf16w
from moe_serve.kernels.backend_torch import future_mask


MIN_QUERIES = 64
QUERY_BLOCK = 256  # longer chunks go in blocks of about this many queries: the keys past a block's last query
# (masked) are neither multiplied nor put through the softmax, which saves up to half the work of a whole prompt


def _padded(n: int, to: int = 32) -> int:
    return -(-n // to) * to


def fits(q_NQK: torch.Tensor, k_NLK: torch.Tensor, v_NLV: torch.Tensor, stored_dtype: torch.dtype) -> bool:
    """A bf16 cache, float32 queries on CPU, MIN_QUERIES or more, and both products taken by the bf16 kernels."""
    N, Q, K = q_NQK.shape
    Lp, V = _padded(k_NLK.shape[1]), v_NLV.shape[2]
    return (Q >= MIN_QUERIES and stored_dtype == torch.bfloat16 and q_NQK.dtype == torch.float32 and q_NQK.is_cpu
            and cpu_bf16w.available() and cpu_bf16w.tiles_take(Q, _padded(K), Lp)
            and cpu_bf16w.tiles_take(Q, Lp, _padded(V, 16)))


def prefill_attention_bf16(q_NQK: torch.Tensor, k_NLK: torch.Tensor, v_NLV: torch.Tensor, scale: float
                           ) -> torch.Tensor:
    """out [N, Q, V] float32, for inputs that `fits`."""
    N, Q, K = q_NQK.shape
    L, V = k_NLK.shape[1], v_NLV.shape[2]
    Lp, Kp, Vp = _padded(L), _padded(K), _padded(V, 16)
    k_NPK = torch.zeros(N, Lp, Kp, dtype=torch.bfloat16)
    k_NPK[:, :L, :K] = k_NLK
    v_NVP = torch.empty(N, Vp, Lp, dtype=torch.bfloat16)
    torch.ops.moe_serve.values_t(v_NLV if v_NLV.stride(2) == 1 else v_NLV.contiguous(), v_NVP)  # zeros past V, L
    q_NQP = F.pad(q_NQK * scale, (0, Kp - K))
    out_NQV = q_NQK.new_empty(N, Q, V)
    blocks = -(-Q // QUERY_BLOCK)
    size = _padded(-(-Q // blocks), 16)
    for q0 in range(0, Q, size):  # a block of queries sees keys up to its last query's position only
        q1 = min(Q, q0 + size)
        kp = _padded(L - Q + q1)
        scores_NBP = cpu_bf16w.bmm(q_NQP[:, q0:q1], k_NPK[:, :kp])
        # query q0 + i sees keys up to its position L - Q + q0 + i; the rest (and the padding) get 0
        torch.ops.moe_serve.causal_softmax(scores_NBP.view(-1, kp), q1 - q0, L - Q + q0 + 1)
        out_NQV[:, q0:q1] = cpu_bf16w.bmm(scores_NBP, v_NVP[:, :, :kp])[..., :V]
    return out_NQV


def reference(q_NQK: torch.Tensor, k_NLK: torch.Tensor, v_NLV: torch.Tensor, scale: float) -> torch.Tensor:
    """`prefill_attention_bf16` in torch: bf16 operands, float32 products and softmax."""
    def bf16(t: torch.Tensor) -> torch.Tensor:
        return t.bfloat16().float()

    Q, L = q_NQK.shape[1], k_NLK.shape[1]
    scores_NQL = torch.matmul(bf16(q_NQK * scale), bf16(k_NLK).transpose(1, 2))
    scores_NQL.masked_fill_(future_mask(Q, L)[None], float("-inf"))
    return torch.matmul(bf16(scores_NQL.softmax(dim=-1)), bf16(v_NLV))
