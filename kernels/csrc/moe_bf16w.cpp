/* Routed experts with bf16 or block-FP8 weights and float32 activations on AVX2 + FMA, in one call (the torch path's
 * sort, gather, grouped GEMMs and scatter of kernels/fused_moe_torch.py; reference: kernels/reference.py).
 *
 *   out[t] = sum_k wts[t, k] * w2[e] (silu(gate) * up),  gate | up = w13[e] x[t],  e = ids[t, k] != -1
 *
 * Pairs (t, k) are counted into expert order (stable); each expert's rows, up to CHUNK at a time, are one
 * work item: gathered, multiplied by w13[e] and w2[e] through linear_w (which reads each weight once for
 * all the rows) with a vectorised SiLU between. With one thread, or fewer than two items per thread, items
 * run in turn, each product splitting its weight rows over the threads, and add into out as they finish;
 * otherwise threads take whole items and out is summed per token afterwards (see moe_w).
 *
 * With sw13 (may be NULL) a shared expert of intermediate size Is, sw13 [2 Is, H] and sw2 [H, Is], is added
 * for every token (DeepSeek's shared experts, weight 1); with E = 0 it is a dense MLP.
 *
 * Shapes: x [T, H] (row stride ldx), w13 [E, 2I, H] and w2 [E, H, I] (Weight: bf16 or FP8), ids [T, K] int64
 * and wts [T, K] float32 contiguous, out [T, H] float32 contiguous (overwritten).
 * Returns 0; 1 + the index of the first pair whose id lies outside [-1, E) (nothing computed then); or -1
 * when the scratch memory cannot be had.
 */
#include <string.h>

#include "bf16w.h"

#define CHUNK 256
#define SHARED_CHUNK 64  /* the shared expert's items: every token's, so smaller, for the threads' balance */
#define PAIR_BUFFER_MAX ((size_t)256 << 20)  /* bytes of per-pair outputs beyond which experts go one by one */

/* h[r, :I] <- silu(h[r, :I]) * h[r, I:2I] for R rows of stride 2I; sigmoid from exp(-|g|) <= 1 */
static void silu_and_mul(float *h, int64_t R, int64_t I) {
    const __m256 one = _mm256_set1_ps(1.0f), zero = _mm256_setzero_ps(), sign = _mm256_set1_ps(-0.0f);
    for (int64_t r = 0; r < R; r++) {
        float *g = h + r * 2 * I, *u = g + I;
        int64_t i = 0;
        for (; i + 8 <= I; i += 8) {
            __m256 v = _mm256_loadu_ps(g + i);
            __m256 e = exp_neg(_mm256_or_ps(v, sign));
            __m256 d = _mm256_div_ps(one, _mm256_add_ps(one, e));
            __m256 sig = _mm256_blendv_ps(_mm256_mul_ps(e, d), d, _mm256_cmp_ps(v, zero, _CMP_GE_OQ));
            _mm256_storeu_ps(g + i, _mm256_mul_ps(_mm256_mul_ps(v, sig), _mm256_loadu_ps(u + i)));
        }
        for (; i < I; i++) g[i] = g[i] / (1.0f + __builtin_expf(-g[i])) * u[i];
    }
}

/* o[r] += w * y[r] over H columns */
static inline void add_scaled(float *o, const float *y, float w, int64_t H) {
    __m256 wv = _mm256_set1_ps(w);
    int64_t c = 0;
    for (; c + 8 <= H; c += 8)
        _mm256_storeu_ps(o + c, _mm256_fmadd_ps(wv, _mm256_loadu_ps(y + c), _mm256_loadu_ps(o + c)));
    for (; c < H; c++) o[c] += w * y[c];
}

/* An expert's product: on the tiles from min_rows rows, else as any linear */
static inline void expert_linear(const float *x, int64_t ldx, const Weight *w, float *y, int64_t ldy, int64_t M,
                                 int64_t K, int64_t O, int64_t min_rows) {
    if (!linear_tiles_min(x, ldx, w, y, ldy, M, K, O, min_rows)) linear_w(x, ldx, w, y, ldy, M, K, O);
}

/* y [R, H] = w2 (silu(gate) * up) with gate | up = w13 x for R rows of x (row stride ldx); h [R, 2I] scratch.
 * min_rows: a routed expert's products take the tiles from expert_tile_rows() rows (the rows an expert gets
 * depend on the batch anyway); the shared expert's, as every linear of the tokens, from set_tile_rows' */
static inline void expert_rows(const float *x, int64_t ldx, int64_t R, int64_t H, const Weight *w13,
                               const Weight *w2, int64_t I, float *h, float *y, int64_t min_rows) {
    expert_linear(x, ldx, w13, h, 2 * I, R, H, 2 * I, min_rows);
    silu_and_mul(h, R, I);
    expert_linear(h, 2 * I, w2, y, H, R, I, H, min_rows);
}

/* The sorted pairs and the work list of one call, shared by the threads */
typedef struct {
    const float *x;
    int64_t ldx, T, H, K, I, Is;
    const Weight *w13, *w2, *sw13, *sw2;
    const int64_t *start, *order, *item_e, *item_r;  /* see moe_w */
} Work;

/* Runs work item `it` into y [R, H] and returns R: the shared expert's rows r0.. of x for e = -1, else expert
 * e's sorted pairs r0.. (row r is pair order[r0 + r]), gathered into xg first. h: [R, 2 max(I, Is)] scratch. */
static int64_t run_item(const Work *w, int64_t it, float *xg, float *h, float *y) {
    int64_t e = w->item_e[it], r0 = w->item_r[it], H = w->H;
    if (e < 0) {
        int64_t R = w->T - r0 < SHARED_CHUNK ? w->T - r0 : SHARED_CHUNK;
        expert_rows(w->x + r0 * w->ldx, w->ldx, R, H, w->sw13, w->sw2, w->Is, h, y, set_tile_rows(-1));
        return R;
    }
    int64_t R = w->start[e + 1] - r0 < CHUNK ? w->start[e + 1] - r0 : CHUNK;
    for (int64_t r = 0; r < R; r++)
        memcpy(xg + r * H, w->x + (w->order[r0 + r] / w->K) * w->ldx, H * sizeof(float));
    Weight w13 = weight_at(*w->w13, e), w2 = weight_at(*w->w2, e);
    expert_rows(xg, H, R, H, &w13, &w2, w->I, h, y, expert_tile_rows());
    return R;
}

int64_t moe_w(const float *x, int64_t ldx, int64_t T, int64_t H, const Weight *w13, const Weight *w2, int64_t E,
              int64_t I, const int64_t *ids, const float *wts, int64_t K, float *out, const Weight *sw13, int64_t Is,
              const Weight *sw2) {
    int64_t N = T * K;
    for (int64_t i = 0; i < N; i++)
        if (ids[i] < -1 || ids[i] >= E) return 1 + i;
    memset(out, 0, (size_t)(T * H) * sizeof(float));
    if (T == 0) return 0;
    int64_t Imax = sw13 && Is > I ? Is : I;
    size_t rows = (size_t)((N > T ? N : T) < CHUNK ? (N > T ? N : T) : CHUNK);
    size_t work = rows * (size_t)(H + 2 * Imax + H) * sizeof(float);  /* gathered x, h, y of one chunk */
    int64_t shared_items = sw13 ? (T + SHARED_CHUNK - 1) / SHARED_CHUNK : 0;
    /* Work items: the shared expert's chunks of tokens (expert -1, first token), then (expert, first sorted
     * slot) per chunk of an expert's rows */
    int64_t max_items = (N + CHUNK - 1) / CHUNK + E + shared_items;
    int nt = threads_for_region();
    size_t pair_bytes = (size_t)(N + (sw13 ? T : 0)) * (size_t)H * sizeof(float);
    size_t head = (size_t)(E + 1 + N + 2 * max_items) * sizeof(int64_t);
    /* With several threads and several items each, threads take whole items as they come free: each writes
     * its pairs' outputs to their own rows of a pair buffer, summed per token afterwards in a fixed order, so
     * results do not depend on which thread took what. Otherwise items go in turn and each product splits
     * its weight rows over the threads (decode: a few rows per expert). */
    int by_item = nt > 1 && pair_bytes <= PAIR_BUFFER_MAX;
    size_t need = head + 64 + (by_item ? pair_bytes + (size_t)nt * (work + 64) : work) + 64;
    char *buf = (char *)thread_scratch(need);
    if (!buf) return -1;
    int64_t *start = (int64_t *)buf;      /* start[e]: first sorted slot of expert e */
    int64_t *order = start + (E + 1);     /* sorted slot -> pair index */
    int64_t *item_e = order + N, *item_r = item_e + max_items;
    float *area = (float *)(((uintptr_t)(item_r + max_items) + 63) & ~(uintptr_t)63);

    memset(start, 0, (size_t)(E + 1) * sizeof(int64_t));
    for (int64_t i = 0; i < N; i++)
        if (ids[i] >= 0) start[ids[i] + 1]++;
    for (int64_t e = 0; e < E; e++) start[e + 1] += start[e];
    for (int64_t i = 0; i < N; i++)  /* stable: pairs of one expert stay in token order */
        if (ids[i] >= 0) order[start[ids[i]]++] = i;
    for (int64_t e = E; e > 0; e--) start[e] = start[e - 1];
    start[0] = 0;
    int64_t items = 0;
    for (int64_t t0 = 0; t0 < T && sw13; t0 += SHARED_CHUNK) { item_e[items] = -1; item_r[items++] = t0; }
    for (int64_t e = 0; e < E; e++)
        for (int64_t r0 = start[e]; r0 < start[e + 1]; r0 += CHUNK) { item_e[items] = e; item_r[items++] = r0; }
    by_item = by_item && items >= 2 * nt;

    const Work job = {x, ldx, T, H, K, I, Is, w13, w2, sw13, sw2, start, order, item_e, item_r};
    if (!by_item) {
        float *xg = area, *h = xg + rows * H, *y = h + rows * 2 * Imax;
        for (int64_t it = 0; it < items; it++) {
            int64_t R = run_item(&job, it, xg, h, y), r0 = item_r[it];
            for (int64_t r = 0; r < R; r++) {
                if (item_e[it] < 0) {
                    add_scaled(out + (r0 + r) * H, y + r * H, 1.0f, H);
                } else {
                    int64_t pair = order[r0 + r];
                    add_scaled(out + (pair / K) * H, y + r * H, wts[pair], H);
                }
            }
        }
        return 0;
    }

    float *pairs = area;  /* [N + T, H]: output of pair i in row i, the shared expert's of token t in row N + t */
    char *works = (char *)(((uintptr_t)(pairs + (size_t)(N + (sw13 ? T : 0)) * H) + 63) & ~(uintptr_t)63);
    parallel_for(items, nt, [&](int64_t it, int slot) {
        float *xg = (float *)(works + (size_t)slot * (work + 64)), *h = xg + rows * H;
        float *y = h + rows * 2 * Imax;
        int64_t R = run_item(&job, it, xg, h, y), r0 = item_r[it];
        for (int64_t r = 0; r < R; r++)
            memcpy(pairs + (item_e[it] < 0 ? N + r0 + r : order[r0 + r]) * H, y + r * H, H * sizeof(float));
    });
    parallel_rows(T, T * (K + 1) * H >= PARALLEL_MIN_VALUES ? nt : 1, [&](int64_t t1, int64_t t2) {
        for (int64_t t = t1; t < t2; t++) {  /* per token: its slots in order, then the shared expert */
            for (int64_t k = 0; k < K; k++)
                if (ids[t * K + k] >= 0) add_scaled(out + t * H, pairs + (t * K + k) * H, wts[t * K + k], H);
            if (sw13) add_scaled(out + t * H, pairs + (N + t) * H, 1.0f, H);
        }
    });
    return 0;
}
