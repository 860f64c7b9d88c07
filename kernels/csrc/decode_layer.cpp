/* One whole decoder layer of a decode step (every token a single-token query) in one call: the CPU kernels
 * of this folder in the order the model's Python calls them (moe/model.py DecoderLayer, moe/attention.py
 * MLAttention._decode_cpu, MoEBlock), without the Python and torch dispatch between them, which costs more
 * than the arithmetic at decode sizes (~1 ms a layer on a 2 GHz core). The struct of the weights
 * (DecodeLayer, bf16w.h) is filled by torch_ops.cpp from the tensors kernels/cpu_decode_layer.py passes.
 *
 *   x += o_proj(MLA(rms_norm(x)))          MLA absorbed, over the paged bf16 latent cache (this step's
 *                                          latents and rope keys written first)
 *   x += mlp(rms_norm(x))                  DeepSeek-V3 router + routed experts + shared expert, or a dense
 *                                          SiLU MLP (E = 0: the "shared expert" alone)
 *
 * Weights as the model holds them in this mode: linears bf16, or FP8 with block scales, [out, in] with unit
 * stride in `in`; norms and the router's gate float32. Sizes: H hidden, Qr q_lora_rank (0: one q_proj),
 * N heads, Dn / R / Dv nope / rope / value head dims, C kv_lora_rank, E routed experts in G groups, K experts
 * per token, Ie / Is routed / shared (or dense) intermediate sizes.
 */
#include "bf16w.h"

/* x[t, :H] += y[t, :H] for T rows (both contiguous) */
static void add_into(float *x, const float *y, int64_t T, int64_t H) {
    int nt = threads_for_region();
    parallel_rows(T, T * H >= PARALLEL_MIN_VALUES ? nt : 1, [&](int64_t t1, int64_t t2) {
        for (int64_t t = t1; t < t2; t++) {
            float *xt = x + t * H;
            const float *yt = y + t * H;
            int64_t i = 0;
            for (; i + 8 <= H; i += 8)
                _mm256_storeu_ps(xt + i, _mm256_add_ps(_mm256_loadu_ps(xt + i), _mm256_loadu_ps(yt + i)));
            for (; i < H; i++) xt[i] += yt[i];
        }
    });
}

/* Query rows the attention half of the layer takes at a time: a prompt of many rows goes through it in blocks,
 * so that each block's intermediates (about 50 KiB a row in float32: q, the latent queries and outputs) stay in
 * the cache between the products, instead of streaming through memory once per product. */
#define ATTENTION_ROWS 256
/* With several threads and at least twice this many rows, each thread takes whole blocks of about this many rows
 * through the attention half on its own (its kernels on one thread): two parallel loops a layer's attention
 * instead of one or two per op, and no op's rows split thinner than a block. */
#define THREAD_BLOCK_ROWS 128

/* Floats of a block's intermediates per row: attention_out's (attention_kv's C + R of kv fit in its N (C + R)) */
static int64_t block_floats(const DecodeLayer *w) {
    int64_t N = w->N, D = w->C + w->R;
    return w->Qr + N * (w->Dn + w->R) + N * D + N * w->C + N * w->Dv + w->H;
}

/* The first part of the attention half for rows [t0, t0 + n): h (their rows) = rms_norm(x), and their latents
 * and rope keys into the cache (kv: n (C + R) floats of scratch) */
static void attention_kv(const DecodeLayer *w, const float *x, int64_t t0, int64_t n, const float *cos_,
                         const float *sin_, uint16_t *cache, const int64_t *slots, float *h, float *kv) {
    int64_t H = w->H, C = w->C, R = w->R, D = C + R;
    rms_norm_f32(x + t0 * H, H, w->in_norm, h, H, n, H, w->eps_in);
    linear_w(h, H, &w->kv_a, kv, D, n, H, D);
    mla_cache_write_bf16(kv, D, w->kv_a_norm, w->eps_kv, cos_ + t0 * (R / 2), sin_ + t0 * (R / 2), w->interleaved,
                         cache, slots + t0, n, C, R);
}

/* The rest for rows [t0, t0 + n), whose cache rows (and those of every row they attend to) are written: queries,
 * MLA, o_proj, added into x. h: their normed rows; scratch: block_floats(w) n floats. Sequence b is token row b,
 * or rows[b] where rows is given (then t0 = 0 and n = every row). 0, or -1 when scratch memory ran out. */
static int attention_out(const DecodeLayer *w, float *x, int64_t t0, int64_t n, const float *cos_, const float *sin_,
                         const uint16_t *cache, int64_t bs, const int64_t *rows, const int64_t *tables, int64_t ld_t,
                         const int64_t *lens, const float *h, float *scratch) {
    int64_t H = w->H, N = w->N, C = w->C, R = w->R, Dn = w->Dn, Dv = w->Dv, Dq = Dn + R, D = C + R;
    float *qa = scratch, *q = qa + n * w->Qr, *qlat = q + n * N * Dq, *olat = qlat + n * N * D;
    float *attn = olat + n * N * C, *y = attn + n * N * Dv;
    cos_ += t0 * (R / 2), sin_ += t0 * (R / 2);
    if (w->Qr) {
        linear_w(h, H, &w->q_a, qa, w->Qr, n, H, w->Qr);
        rms_norm_f32(qa, w->Qr, w->q_a_norm, qa, w->Qr, n, w->Qr, w->eps_q);
        linear_w(qa, w->Qr, &w->q_b, q, N * Dq, n, w->Qr, N * Dq);
    } else {
        linear_w(h, H, &w->q_b, q, N * Dq, n, H, N * Dq);
    }
    /* per head: q_lat = [W_UK^T q_nope, rope(q_pe)] */
    linear_w_batched(q, N * Dq, Dq, &w->w_uk, qlat, N * D, D, n, Dn, C, N);
    rope_f32(q + Dn, N * Dq, Dq, cos_, sin_, qlat + C, N * D, D, n, N, R, w->interleaved);
    if (mla_decode_bf16(qlat, N * D, D, cache, bs, D, tables + t0 * ld_t, ld_t, lens + t0, olat, N * C, C, n, N, C,
                        w->softmax_scale, rows))
        return -1;
    linear_w_batched(olat, N * C, C, &w->w_uv, attn, N * Dv, Dv, n, C, Dv, N);
    linear_w(attn, N * Dv, &w->o, y, H, n, N * Dv, H);
    add_into(x + t0 * H, y, n, H);
    return 0;
}

/* The attention half by whole blocks of rows per thread (rows in order, nt threads): every block's cache rows
 * first, then every block's queries. h [T, H] (the normed rows), scratch: nt areas of `area` floats. */
static int attention_by_thread(const DecodeLayer *w, float *x, int64_t T, int64_t nt, const float *cos_,
                               const float *sin_, uint16_t *cache, int64_t bs, const int64_t *slots,
                               const int64_t *tables, int64_t ld_t, const int64_t *lens, float *h, float *scratch,
                               int64_t rows_per_block, size_t area) {
    int64_t blocks = (T + rows_per_block - 1) / rows_per_block, failed = 0;
    parallel_for(blocks, (int)nt, [&](int64_t b, int slot) {
        int64_t t0 = b * rows_per_block, n = T - t0 < rows_per_block ? T - t0 : rows_per_block;
        attention_kv(w, x, t0, n, cos_, sin_, cache, slots, h + t0 * w->H, scratch + (size_t)slot * area);
    });
    parallel_for(blocks, (int)nt, [&](int64_t b, int slot) {
        int64_t t0 = b * rows_per_block, n = T - t0 < rows_per_block ? T - t0 : rows_per_block;
        if (attention_out(w, x, t0, n, cos_, sin_, cache, bs, NULL, tables, ld_t, lens, h + t0 * w->H,
                          scratch + (size_t)slot * area))
            __atomic_store_n(&failed, 1, __ATOMIC_RELAXED);  /* by any thread */
    });
    return failed ? -1 : 0;
}

/* x [T, H] contiguous float32, updated in place. cos / sin [T, R/2] contiguous; cache [*, bs, C + R] bf16
 * contiguous; slots [T]; sequence b (of T) is token row rows[b], its block table tables[b] (row stride ld_t)
 * and context length lens[b] (this step's token included). ids [T, K] (may be NULL): receives the routed
 * expert ids, for load recording. Returns 0; -1 when scratch memory could not be had; 1 + the index of a bad
 * expert id (as moe_w).
 *
 * Where sequence b is row b (the rows of a prompt chunk in order, as the runner lays them out) and there are
 * more than ATTENTION_ROWS, the attention half goes in blocks of rows, each block's cache rows written before
 * its queries read the cache: a query's earlier rows lie in its own block or an earlier one. */
int64_t decode_layer_f32(const DecodeLayer *w, float *x, int64_t T, const float *cos_, const float *sin_,
                         uint16_t *cache, int64_t bs, const int64_t *slots, const int64_t *rows, const int64_t *tables,
                         int64_t ld_t, const int64_t *lens, int64_t *ids) {
    int64_t H = w->H, K = w->K;
    if (T <= 0) return 0;
    int64_t in_order = 1;
    for (int64_t b = 0; b < T && in_order; b++) in_order = rows[b] == b;
    int64_t nt = threads_for_region();
    /* blocks: of about THREAD_BLOCK_ROWS rows, as many as a multiple of the threads, one thread each; else of
     * ATTENTION_ROWS (or all the rows where they are not in order), every op over the threads */
    int64_t by_thread = in_order && nt > 1 && T >= 2 * THREAD_BLOCK_ROWS, Tb = T;
    if (by_thread) {
        int64_t blocks = (T + THREAD_BLOCK_ROWS - 1) / THREAD_BLOCK_ROWS;
        blocks = (blocks + nt - 1) / nt * nt;
        Tb = (T + blocks - 1) / blocks;
    } else if (in_order && T > ATTENTION_ROWS) {
        Tb = ATTENTION_ROWS;
    }
    size_t area = (size_t)Tb * (size_t)block_floats(w) + 16;
    size_t att = (by_thread ? (size_t)nt : 1) * area;
    size_t floats = (size_t)T * (size_t)(2 * H + K) + att + 64;
    size_t bytes = floats * sizeof(float) + (ids ? 0 : (size_t)(T * K) * sizeof(int64_t));
    float *h = (float *)thread_scratch(bytes);
    if (!h) return -1;
    float *y = h + T * H, *wts = y + T * H, *ah = wts + T * K;
    if (!ids) ids = (int64_t *)(((uintptr_t)(ah + att) + 63) & ~(uintptr_t)63);

    if (by_thread) {
        if (attention_by_thread(w, x, T, nt, cos_, sin_, cache, bs, slots, tables, ld_t, lens, h, ah, Tb, area))
            return -1;
    } else {
        for (int64_t t0 = 0; t0 < T; t0 += Tb) {
            int64_t n = T - t0 < Tb ? T - t0 : Tb;
            attention_kv(w, x, t0, n, cos_, sin_, cache, slots, h + t0 * H, ah);
            if (attention_out(w, x, t0, n, cos_, sin_, cache, bs, Tb < T ? NULL : rows, tables, ld_t, lens, h + t0 * H,
                              ah))
                return -1;
        }
    }

    /* MLP: routed experts (+ shared), or dense, over all the rows at once (each expert's weight read once) */
    rms_norm_f32(x, H, w->post_norm, h, H, T, H, w->eps_post);
    if (w->E)
        route_noaux_tc_f32(h, H, w->router, H, w->router_bias, T, w->E, w->G, w->topk_group, K, w->norm_topk,
                           w->routed_scale, ids, wts);
    int64_t status = moe_w(h, H, T, H, &w->w13, &w->w2, w->E, w->Ie, ids, wts, w->E ? K : 0, y,
                           w->sw13.data ? &w->sw13 : NULL, w->Is, &w->sw2);
    if (status) return status;
    add_into(x, y, T, H);
    return 0;
}
