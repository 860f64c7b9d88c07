/* One whole decoder layer of a decode step (every token a single-token query) in one call: the CPU kernels
 * of this folder in the order the model's Python calls them (moe/model.py DecoderLayer, moe/attention.py
 * MLAttention._decode_cpu, MoEBlock), without the Python and torch dispatch between them, which costs more
 * than the arithmetic at decode sizes (~1 ms a layer on a 2 GHz core). kernels/cpu_decode_layer.py builds
 * the weights' struct and holds the reference: the same layer through the model's own modules.
 *
 *   x += o_proj(MLA(rms_norm(x)))          MLA absorbed, over the paged bf16 latent cache (this step's
 *                                          latents and rope keys written first)
 *   x += mlp(rms_norm(x))                  DeepSeek-V3 router + routed experts + shared expert, or a dense
 *                                          SiLU MLP (E = 0: the "shared expert" alone)
 *
 * Weights as the model holds them in this mode: linears bf16 [out, in] with contiguous rows, norms and the
 * router's gate float32. Sizes: H hidden, Qr q_lora_rank (0: one q_proj), N heads, Dn / R / Dv nope / rope /
 * value head dims, C kv_lora_rank, E routed experts in G groups, K experts per token, Ie / Is routed /
 * shared (or dense) intermediate sizes.
 */
#include "bf16w.h"

typedef struct {
    int64_t H, Qr, N, Dn, R, Dv, C, interleaved;
    float eps_in, eps_q, eps_kv, eps_post, softmax_scale, routed_scale;
    const float *in_norm, *q_a_norm, *kv_a_norm, *post_norm;
    const uint16_t *q_a, *q_b; /* q_a [Qr, H], q_b [N (Dn + R), Qr]; with Qr = 0, q_b is q_proj [N (Dn + R), H] */
    const uint16_t *kv_a;      /* [C + R, H] */
    const uint16_t *w_uk;      /* [N, C, Dn] */
    const uint16_t *w_uv;      /* [N, Dv, C] */
    const uint16_t *o;         /* [H, N Dv] */
    int64_t E, G, topk_group, K, norm_topk;
    const float *router, *router_bias; /* [E, H], [E] (may be NULL) */
    int64_t Ie, Is;
    const uint16_t *w13, *w2;   /* [E, 2 Ie, H], [E, H, Ie] */
    const uint16_t *sw13, *sw2; /* [2 Is, H], [H, Is] (may be NULL when E > 0) */
} DecodeLayer;

int64_t decode_layer_struct_size(void) { return (int64_t)sizeof(DecodeLayer); }

static void add_into(float *x, const float *y, int64_t n) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(x + i, _mm256_add_ps(_mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
    for (; i < n; i++) x[i] += y[i];
}

/* x [T, H] contiguous float32, updated in place. cos / sin [T, R/2] contiguous; cache [*, bs, C + R] bf16
 * contiguous; slots [T]; sequence b (of T) is token row rows[b], its block table tables[b] (row stride ld_t)
 * and context length lens[b] (this step's token included). ids [T, K] (may be NULL): receives the routed
 * expert ids, for load recording. Returns 0; -1 when scratch memory could not be had; 1 + the index of a bad
 * expert id (as moe_bf16w). */
int64_t decode_layer_f32(const DecodeLayer *w, float *x, int64_t T, const float *cos_, const float *sin_,
                         uint16_t *cache, int64_t bs, const int64_t *slots, const int64_t *rows, const int64_t *tables,
                         int64_t ld_t, const int64_t *lens, int64_t *ids) {
    int64_t H = w->H, N = w->N, C = w->C, R = w->R, Dn = w->Dn, Dv = w->Dv, Dq = Dn + R, D = C + R, K = w->K;
    if (T <= 0) return 0;
    size_t floats = (size_t)T * (size_t)(2 * H + w->Qr + N * Dq + D + N * D + N * C + N * Dv + K) + 64;
    size_t bytes = floats * sizeof(float) + (ids ? 0 : (size_t)(T * K) * sizeof(int64_t));
    float *h = thread_scratch(bytes);
    if (!h) return -1;
    float *qa = h + T * H, *q = qa + T * w->Qr, *kv = q + T * N * Dq, *qlat = kv + T * D, *olat = qlat + T * N * D;
    float *attn = olat + T * N * C, *y = attn + T * N * Dv, *wts = y + T * H;
    if (!ids) ids = (int64_t *)(((uintptr_t)(wts + T * K) + 63) & ~(uintptr_t)63);

    /* attention */
    rms_norm_f32(x, H, w->in_norm, h, H, T, H, w->eps_in);
    if (w->Qr) {
        linear_bf16w(h, H, w->q_a, H, qa, w->Qr, T, H, w->Qr);
        rms_norm_f32(qa, w->Qr, w->q_a_norm, qa, w->Qr, T, w->Qr, w->eps_q);
        linear_bf16w(qa, w->Qr, w->q_b, w->Qr, q, N * Dq, T, w->Qr, N * Dq);
    } else {
        linear_bf16w(h, H, w->q_b, H, q, N * Dq, T, H, N * Dq);
    }
    linear_bf16w(h, H, w->kv_a, H, kv, D, T, H, D);
    mla_cache_write_bf16(kv, D, w->kv_a_norm, w->eps_kv, cos_, sin_, w->interleaved, cache, slots, T, C, R);
    /* per head: q_lat = [W_UK^T q_nope, rope(q_pe)] */
    linear_bf16w_batched(q, N * Dq, Dq, w->w_uk, Dn, C * Dn, qlat, N * D, D, T, Dn, C, N);
    rope_f32(q + Dn, N * Dq, Dq, cos_, sin_, qlat + C, N * D, D, T, N, R, w->interleaved);
    if (mla_decode_bf16(qlat, N * D, D, cache, bs, D, tables, ld_t, lens, olat, N * C, C, T, N, C, w->softmax_scale,
                        rows))
        return -1;
    linear_bf16w_batched(olat, N * C, C, w->w_uv, C, Dv * C, attn, N * Dv, Dv, T, C, Dv, N);
    linear_bf16w(attn, N * Dv, w->o, N * Dv, y, H, T, N * Dv, H);
    add_into(x, y, T * H);

    /* MLP: routed experts (+ shared), or dense */
    rms_norm_f32(x, H, w->post_norm, h, H, T, H, w->eps_post);
    if (w->E)
        route_noaux_tc_f32(h, H, w->router, H, w->router_bias, T, w->E, w->G, w->topk_group, K, w->norm_topk,
                           w->routed_scale, ids, wts);
    int64_t status = moe_bf16w(h, H, T, H, w->w13, w->w2, w->E, w->Ie, ids, wts, w->E ? K : 0, y, w->sw13, w->Is,
                               w->sw2);
    if (status) return status;
    add_into(x, y, T * H);
    return 0;
}
