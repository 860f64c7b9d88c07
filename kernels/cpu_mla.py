"""MLA decode attention over a paged bf16 latent cache with float32 queries, on CPU: how `--dtype bfloat16`
attends on a CPU without bf16 arithmetic (the cpu kernel backend, kernels/backend_cpu.py), through csrc/mla_decode_bf16.cpp (the
torch op moe_serve::mla_decode).

In torch that step gathers each sequence's cache blocks, widens them to float32, and runs two bmm, a
masked softmax and a concatenation per layer; the kernel reads each cached row in place, twice (scores,
then values). Where the bf16 products are on (`bf16_products`) the two products take bf16 operands: on
AVX512-BF16 dot products, or in the AMX build on the AMX tiles (csrc/mla_decode_amx.cpp, 16 heads a pass, for
a block size that is a multiple of 16). `reference` is the same computation in torch, the test oracle.

Legend: B decode sequences, N heads, D = C + R cached dims per token (latent C, rope key R), M blocks per
row of the block table, L context length.
"""

from __future__ import annotations

import torch

from moe_serve.kernels import cpu_build


def available() -> bool:
    return cpu_build.available()


def fits(q_BND: torch.Tensor, kv_cache_NbD: torch.Tensor) -> bool:
    """Whether the kernel takes these inputs: float32 queries with unit stride within a head, a contiguous
    bf16 cache on CPU, and the kernels built."""
    return (q_BND.dtype == torch.float32 and kv_cache_NbD.dtype == torch.bfloat16 and q_BND.is_cpu
            and q_BND.stride(2) == 1 and kv_cache_NbD.is_contiguous() and available())


def bf16_products(kv_cache_NbD: torch.Tensor, latent_dim: int) -> bool:
    """Whether the kernel runs both products in bf16 (reference(bf16_products=True)): where the bf16 products
    of linears are on (the AVX512-BF16 or AMX build, cpu_build.tile_rows() > 0), with D and the latent
    dims multiples of 32 and an even block size; else in float32."""
    _, bs, D = kv_cache_NbD.shape
    return cpu_build.tile_rows() > 0 and D % 32 == 0 and latent_dim % 32 == 0 and bs % 2 == 0


def reference(q_BND: torch.Tensor, kv_cache_NbD: torch.Tensor, block_tables_BM: torch.Tensor,
              context_lens_B: torch.Tensor, latent_dim: int, scale: float, bf16_products: bool = False
              ) -> torch.Tensor:
    """out[b, n] = softmax(scale * q[b, n] . kv[l]) over the context of b, times kv[l, :latent_dim].
    bf16_products: q rounded to bf16 for the scores, the probabilities rounded to bf16 for the values (sums in
    float32), as the kernel runs where `bf16_products` says so."""
    B, N, D = q_BND.shape
    bs = kv_cache_NbD.shape[1]
    out_BNC = q_BND.new_zeros(B, N, latent_dim)
    for b in range(B):
        L = int(context_lens_B[b])
        if L == 0:
            continue
        blocks = block_tables_BM[b, : (L + bs - 1) // bs]
        kv_LD = kv_cache_NbD[blocks].reshape(-1, D)[:L].float()
        q_ND = q_BND[b].bfloat16().float() if bf16_products else q_BND[b]
        probs_NL = (q_ND @ kv_LD.t() * scale).softmax(dim=-1)
        if bf16_products:
            probs_NL = probs_NL.bfloat16().float()
        out_BNC[b] = probs_NL @ kv_LD[:, :latent_dim]
    return out_BNC


def mla_decode(q_BND: torch.Tensor, kv_cache_NbD: torch.Tensor, block_tables_BM: torch.Tensor,
               context_lens_B: torch.Tensor, latent_dim: int, scale: float) -> torch.Tensor:
    """As `reference`; through the C kernel where `fits`."""
    if not fits(q_BND, kv_cache_NbD):
        return reference(q_BND, kv_cache_NbD, block_tables_BM, context_lens_B, latent_dim, scale)
    B, N, _ = q_BND.shape
    out_BNC = q_BND.new_empty(B, N, latent_dim)
    if B:
        lens_B = context_lens_B.to(torch.int64).contiguous()
        tables_BM = block_tables_BM.to(torch.int64)
        mla_decode_into(q_BND, kv_cache_NbD, tables_BM, lens_B, latent_dim, scale, None, 0, out_BNC)
    return out_BNC


def mla_decode_into(q_TND: torch.Tensor, kv_cache_NbD: torch.Tensor, block_tables_BM: torch.Tensor,
                    context_lens_B: torch.Tensor, latent_dim: int, scale: float, rows_B: torch.Tensor | None,
                    max_len: int, out_TNC: torch.Tensor) -> None:
    """The kernel alone, for inputs that `fits`: sequence b attends with query row rows[b] (b without
    rows) and writes that row of out (float32, unit stride in C); other rows are left as they are.
    Tables, lengths and rows: int64, contiguous lengths and rows. max_len (the longest of the lengths) is
    not needed: the op checks every length against the table and every block in use against the cache
    (ValueError)."""
    torch.ops.moe_serve.mla_decode(q_TND, kv_cache_NbD, block_tables_BM, context_lens_B, rows_B, latent_dim, scale,
                                   out_TNC)
