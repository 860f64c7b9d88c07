/* Routed experts with bf16 weights and float32 activations on AVX2 + FMA, in one call (the torch path's
 * sort, gather, grouped GEMMs and scatter of kernels/fused_moe_torch.py; reference: kernels/reference.py).
 *
 *   out[t] = sum_k wts[t, k] * w2[e] (silu(gate) * up),  gate | up = w13[e] x[t],  e = ids[t, k] != -1
 *
 * Pairs (t, k) are counted into expert order (stable), then each expert's rows, up to CHUNK at a time,
 * are gathered, multiplied by w13[e] and w2[e] through linear_bf16w (which reads each weight once for all
 * the rows, split over the threads) and added into out in that order.
 *
 * With sw13 (may be NULL) a shared expert of intermediate size Is, sw13 [2 Is, H] and sw2 [H, Is], is added
 * for every token after the routed ones (DeepSeek's shared experts, weight 1).
 *
 * Shapes: x [T, H] (row stride ldx), w13 [E, 2I, H] and w2 [E, H, I] bf16 contiguous, ids [T, K] int64
 * and wts [T, K] float32 contiguous, out [T, H] float32 contiguous (overwritten).
 * Returns 0; 1 + the index of the first pair whose id lies outside [-1, E) (nothing computed then); or -1
 * when the scratch memory cannot be had.
 */
#include <string.h>

#include "bf16w.h"

#define CHUNK 256

/* h[r, :I] <- silu(h[r, :I]) * h[r, I:2I] for R rows of stride 2I */
static void silu_and_mul(float *h, int64_t R, int64_t I) {
    for (int64_t r = 0; r < R; r++) {
        float *g = h + r * 2 * I, *u = g + I;
        for (int64_t i = 0; i < I; i++) g[i] = g[i] / (1.0f + __builtin_expf(-g[i])) * u[i];
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

int64_t moe_bf16w(const float *x, int64_t ldx, int64_t T, int64_t H, const uint16_t *w13, const uint16_t *w2,
                  int64_t E, int64_t I, const int64_t *ids, const float *wts, int64_t K, float *out,
                  const uint16_t *sw13, int64_t Is, const uint16_t *sw2) {
    int64_t N = T * K;
    for (int64_t i = 0; i < N; i++)
        if (ids[i] < -1 || ids[i] >= E) return 1 + i;
    memset(out, 0, (size_t)(T * H) * sizeof(float));
    size_t rows = (N > T ? N : T) < CHUNK ? (size_t)(N > T ? N : T) : CHUNK;
    int64_t Imax = sw13 && Is > I ? Is : I;
    size_t need = (size_t)(E + 1) * sizeof(int64_t) + (size_t)N * sizeof(int64_t) +
                  rows * (size_t)(H + 2 * Imax + H) * sizeof(float) + 256;
    char *buf = thread_scratch(need);
    if (!buf) return -1;
    int64_t *start = (int64_t *)buf;      /* start[e]: first sorted slot of expert e */
    int64_t *order = start + (E + 1);     /* sorted slot -> pair index */
    float *xg = (float *)(((uintptr_t)(order + N) + 63) & ~(uintptr_t)63);
    float *h = xg + rows * H, *y = h + rows * 2 * Imax;

    memset(start, 0, (size_t)(E + 1) * sizeof(int64_t));
    for (int64_t i = 0; i < N; i++)
        if (ids[i] >= 0) start[ids[i] + 1]++;
    for (int64_t e = 0; e < E; e++) start[e + 1] += start[e];
    for (int64_t i = 0; i < N; i++)  /* stable: pairs of one expert stay in token order */
        if (ids[i] >= 0) order[start[ids[i]]++] = i;
    for (int64_t e = E; e > 0; e--) start[e] = start[e - 1];
    start[0] = 0;

    for (int64_t e = 0; e < E; e++) {
        const uint16_t *w13e = w13 + e * 2 * I * H, *w2e = w2 + e * H * I;
        for (int64_t r0 = start[e]; r0 < start[e + 1]; r0 += CHUNK) {
            int64_t R = start[e + 1] - r0 < CHUNK ? start[e + 1] - r0 : CHUNK;
            for (int64_t r = 0; r < R; r++) memcpy(xg + r * H, x + (order[r0 + r] / K) * ldx, H * sizeof(float));
            linear_bf16w(xg, H, w13e, H, h, 2 * I, R, H, 2 * I);
            silu_and_mul(h, R, I);
            linear_bf16w(h, 2 * I, w2e, I, y, H, R, I, H);
            for (int64_t r = 0; r < R; r++) {
                int64_t pair = order[r0 + r];
                add_scaled(out + (pair / K) * H, y + r * H, wts[pair], H);
            }
        }
    }
    if (sw13) {  /* the shared expert: every token, in order, straight from x */
        for (int64_t t0 = 0; t0 < T; t0 += CHUNK) {
            int64_t R = T - t0 < CHUNK ? T - t0 : CHUNK;
            linear_bf16w(x + t0 * ldx, ldx, sw13, H, h, 2 * Is, R, H, 2 * Is);
            silu_and_mul(h, R, Is);
            linear_bf16w(h, 2 * Is, sw2, Is, y, H, R, Is, H);
            for (int64_t r = 0; r < R; r++) add_scaled(out + (t0 + r) * H, y + r * H, 1.0f, H);
        }
    }
    return 0;
}
