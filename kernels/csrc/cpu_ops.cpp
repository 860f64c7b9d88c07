/* The small per-layer ops of a decode step in float32, one call each instead of several torch ops
 * (kernels/cpu_ops.py holds their torch references): RMSNorm, rotary embedding, and DeepSeek-V3's
 * router (sigmoid scores, bias-corrected group-limited top-k). At decode sizes each torch op costs
 * 5-15 us of dispatch for well under a microsecond of arithmetic.
 */
#include <string.h>
#include <math.h>

#include "bf16w.h"

/* 1 / sqrt(mean(x^2) + eps) over D values */
static inline float rms_scale(const float *x, int64_t D, float eps) {
    __m256 acc = _mm256_setzero_ps();
    int64_t d = 0;
    for (; d + 8 <= D; d += 8) {
        __m256 v = _mm256_loadu_ps(x + d);
        acc = _mm256_fmadd_ps(v, v, acc);
    }
    float ss = hsum8(acc);
    for (; d < D; d++) ss += x[d] * x[d];
    return 1.0f / sqrtf(ss / (float)D + eps);
}

/* y[t] = w * (x[t] / sqrt(mean(x[t]^2) + eps)); x [T, D] (row stride ldx), y [T, D] (row stride ldy). */
void rms_norm_f32(const float *x, int64_t ldx, const float *w, float *y, int64_t ldy, int64_t T, int64_t D,
                  float eps) {
    int nt = threads_for_region();
    parallel_rows(T, T * D >= PARALLEL_MIN_VALUES ? nt : 1, [&](int64_t t1, int64_t t2) {
        for (int64_t t = t1; t < t2; t++) {
            const float *xt = x + t * ldx;
            float *yt = y + t * ldy;
            float r = rms_scale(xt, D, eps);
            __m256 vr = _mm256_set1_ps(r);
            int64_t d = 0;
            for (; d + 8 <= D; d += 8)
                _mm256_storeu_ps(yt + d,
                                 _mm256_mul_ps(_mm256_loadu_ps(w + d), _mm256_mul_ps(_mm256_loadu_ps(xt + d), vr)));
            for (; d < D; d++) yt[d] = w[d] * (xt[d] * r);
        }
    });
}

/* Rotary embedding of x [T, N, R] (strides ldx_t, ldx_n) by cos / sin [T, R/2] (contiguous) into
 * y [T, N, R] (strides ldy_t, ldy_n), laid out as [first of each pair, second of each pair]. Pairs are
 * (x[2i], x[2i+1]) when interleaved, else (x[i], x[i + R/2]). */
void rope_f32(const float *x, int64_t ldx_t, int64_t ldx_n, const float *cos_, const float *sin_, float *y,
              int64_t ldy_t, int64_t ldy_n, int64_t T, int64_t N, int64_t R, int64_t interleaved) {
    int64_t h = R / 2;
    int nt = threads_for_region();
    parallel_rows(T, T * N * R >= PARALLEL_MIN_VALUES ? nt : 1, [&](int64_t t1, int64_t t2) {
        for (int64_t t = t1; t < t2; t++) {
            const float *c = cos_ + t * h, *s = sin_ + t * h;
            for (int64_t n = 0; n < N; n++) {
                const float *xr = x + t * ldx_t + n * ldx_n;
                float *yr = y + t * ldy_t + n * ldy_n;
                for (int64_t i = 0; i < h; i++) {
                    float a = interleaved ? xr[2 * i] : xr[i], b = interleaved ? xr[2 * i + 1] : xr[i + h];
                    yr[i] = a * c[i] - b * s[i];
                    yr[i + h] = b * c[i] + a * s[i];
                }
            }
        }
    });
}

/* logits[t, e] = x[t] . gate[e]: RT tokens by 4 experts at a time, their sums in registers, so each vector of x
 * and of the gate is loaded once a block (a dot product at a time loads two vectors a multiply-add). Past T
 * and E the last token and expert are repeated, their sums not stored. */
#ifdef __AVX512F__
#define RT 4
#else
#define RT 2
#endif
#define ROUTE_PARALLEL_MIN (1 << 18)  /* multiply-adds: fewer take one thread */

static void router_logits(const float *x, int64_t ldx, const float *gate, int64_t H, int64_t T, int64_t E,
                          float *logits) {
    int64_t blocks = (T + RT - 1) / RT;
    int nt = threads_for_region();
    parallel_rows(blocks, T * E * H >= ROUTE_PARALLEL_MIN ? nt : 1, [&](int64_t b1, int64_t b2) {
        for (int64_t b = b1; b < b2; b++) {
            const float *xr[RT];
            for (int i = 0; i < RT; i++) xr[i] = x + (b * RT + i < T ? b * RT + i : T - 1) * ldx;
            for (int64_t e0 = 0; e0 < E; e0 += 4) {
                const float *gr[4];
                for (int j = 0; j < 4; j++) gr[j] = gate + (e0 + j < E ? e0 + j : E - 1) * H;
                alignas(64) float sums[RT][4];
                int64_t h = 0;
                wvec acc[RT * 4];
                for (int i = 0; i < RT * 4; i++) acc[i] = WZERO();
                for (; h + WLANES <= H; h += WLANES) {
                    wvec g[4];
                    for (int j = 0; j < 4; j++) g[j] = WLOAD(gr[j] + h);
                    for (int i = 0; i < RT; i++) {
                        wvec xv = WLOAD(xr[i] + h);
                        for (int j = 0; j < 4; j++) acc[4 * i + j] = WFMA(xv, g[j], acc[4 * i + j]);
                    }
                }
#ifdef __AVX512F__
                _mm512_store_ps(&sums[0][0], sum16x16(acc));  /* lane 4i + j: token i, expert j */
#else
                for (int i = 0; i < RT; i++)
                    for (int j = 0; j < 4; j++) sums[i][j] = hsum8(acc[4 * i + j]);
#endif
                for (; h < H; h++)
                    for (int i = 0; i < RT; i++)
                        for (int j = 0; j < 4; j++) sums[i][j] += xr[i][h] * gr[j][h];
                for (int i = 0; i < RT && b * RT + i < T; i++)
                    for (int j = 0; j < 4 && e0 + j < E; j++) logits[(b * RT + i) * E + e0 + j] = sums[i][j];
            }
        }
    });
}

/* One token's choice from its logits [E] (turned into its scores in place); c [E], gs [G] scratch. */
static void route_one(float *s, const float *bias, int64_t E, int64_t G, int64_t topk_group, int64_t K,
                      int64_t norm, float scale, float *c, float *gs, int64_t *ids, float *wts) {
    int64_t per = E / G;
    for (int64_t e = 0; e < E; e++) {
        s[e] = 1.0f / (1.0f + expf(-s[e]));
        c[e] = bias ? s[e] + bias[e] : s[e];
    }
    for (int64_t g = 0; g < G; g++) {  /* group score: the sum of its two best choices */
        float b1 = -INFINITY, b2 = -INFINITY;
        for (int64_t e = g * per; e < (g + 1) * per; e++) {
            if (c[e] > b1) { b2 = b1; b1 = c[e]; }
            else if (c[e] > b2) b2 = c[e];
        }
        gs[g] = per > 1 ? b1 + b2 : b1;
    }
    for (int64_t j = 0; j < topk_group && j < G; j++) {  /* keep the best groups: mark them +inf */
        int64_t best = -1;
        for (int64_t g = 0; g < G; g++)
            if (gs[g] != INFINITY && (best < 0 || gs[g] > gs[best])) best = g;
        gs[best] = INFINITY;
    }
    for (int64_t g = 0; g < G; g++)  /* experts of the other groups are out */
        if (gs[g] != INFINITY)
            for (int64_t e = g * per; e < (g + 1) * per; e++) c[e] = -INFINITY;
    float sum = 0.0f;
    for (int64_t k = 0; k < K; k++) {
        int64_t best = -1;
        for (int64_t e = 0; e < E; e++)
            if (c[e] != -INFINITY && (best < 0 || c[e] > c[best])) best = e;
        ids[k] = best;
        wts[k] = best >= 0 ? s[best] : 0.0f;
        if (best >= 0) { sum += s[best]; c[best] = -INFINITY; }
    }
    for (int64_t k = 0; k < K; k++) {
        float v = wts[k];
        if (norm && K > 1) v = v / (sum + 1e-20f);
        wts[k] = v * scale;
    }
}

/* DeepSeek-V3 routing (topk_method noaux_tc, scoring_func sigmoid) of x [T, H] (row stride ldx) by the gate
 * weight [E, H] (contiguous), all float32: logits = x gate^T; scores s = sigmoid(logits); choice
 * c = s + bias (bias may be NULL); groups of E / G experts rank by the sum of their two best c; among the
 * topk_group best groups the K best c are chosen (in descending order); weights are their s, divided by
 * their sum (norm, K > 1), times scale. ids, wts: [T, K]. Tokens are split over the threads. */
void route_noaux_tc_f32(const float *x, int64_t ldx, const float *gate, int64_t H, const float *bias, int64_t T,
                        int64_t E, int64_t G, int64_t topk_group, int64_t K, int64_t norm, float scale, int64_t *ids,
                        float *wts) {
    if (T <= 0) return;
    float *s = (float *)thread_scratch((size_t)(T * E) * sizeof(float));
    if (!s) {  /* no memory: mark every slot as routed nowhere */
        for (int64_t i = 0; i < T * K; i++) { ids[i] = -1; wts[i] = 0.0f; }
        return;
    }
    router_logits(x, ldx, gate, H, T, E, s);
    int nt = threads_for_region();
    parallel_rows(T, T * E * H >= ROUTE_PARALLEL_MIN ? nt : 1, [&](int64_t t1, int64_t t2) {
        float c[E], gs[G];
        for (int64_t t = t1; t < t2; t++)
            route_one(s + t * E, bias, E, G, topk_group, K, norm, scale, c, gs, ids + t * K, wts + t * K);
    });
}

/* MLA's cache write: row t of kv [T, C + R] (row stride ldkv; kv_a_proj_with_mqa's output) becomes
 * [rms_norm(latent) * w, rope(k_pe)] in bf16 at cache row slots[t] (cache [*, C + R] contiguous bf16).
 * cos / sin [T, R/2]; interleaved as in rope_f32. */
void mla_cache_write_bf16(const float *kv, int64_t ldkv, const float *norm_w, float eps, const float *cos_,
                          const float *sin_, int64_t interleaved, uint16_t *cache, const int64_t *slots, int64_t T,
                          int64_t C, int64_t R) {
    int64_t D = C + R, h = R / 2;
    int nt = threads_for_region();
    parallel_rows(T, T * D >= PARALLEL_MIN_VALUES ? nt : 1, [&](int64_t t1, int64_t t2) {
        for (int64_t t = t1; t < t2; t++) {
            const float *x = kv + t * ldkv;
            uint16_t *row = cache + slots[t] * D;
            float r = rms_scale(x, C, eps);
            for (int64_t c = 0; c < C; c++) row[c] = f32_to_bf16(norm_w[c] * (x[c] * r));
            const float *pe = x + C, *cs = cos_ + t * h, *sn = sin_ + t * h;
            for (int64_t i = 0; i < h; i++) {
                float a = interleaved ? pe[2 * i] : pe[i], b = interleaved ? pe[2 * i + 1] : pe[i + h];
                row[C + i] = f32_to_bf16(a * cs[i] - b * sn[i]);
                row[C + h + i] = f32_to_bf16(b * cs[i] + a * sn[i]);
            }
        }
    });
}
