/* y = x w^T for float32 x and a block-quantised FP8 e4m3fn w (DeepSeek-V3's format: the weight is
 * w[o, k] * scale[o / bo, k / bk]), float32 accumulation, on AVX2 + FMA + F16C: a quarter of the bytes a
 * float32 weight reads, half of bf16's (kernels/cpu_bf16w.py holds its reference, F.linear on the
 * dequantised weight).
 *
 * Each group of 8 weights is widened in registers (load_fp8x8: exact, times 2^-8); each block of bk inputs
 * sums x times the widened weights, and that sum, times the block's scale (times 2^8), is added to the
 * row's total: one multiply per block instead of one per weight (10-20% faster, the conversion being the
 * bottleneck). Results equal the reference up to float32 rounding: the reference rounds each w * scale
 * before multiplying by x, this kernel rounds the block's sum; with one nonzero term, w * scale exactly.
 * The blocks of rows and their accumulators are as in linear_bf16w.cpp, whose drivers (tiles, threads,
 * batches) call fp8w_block. In the AVX512-BF16 build, products of tile_rows+ rows go to linear_dpbf16.cpp instead.
 */
#include "bf16w.h"

#define BLOCK8(MB, U)                                                                                   \
    static void block8_##MB(const float *x, int64_t ldx, const Weight *w, int64_t o0, float *y,        \
                            int64_t ldy, int64_t K, int64_t O) {                                       \
        int64_t K8 = K & ~(int64_t)7, bk = w->bk;                                                      \
        for (int64_t o = 0; o < O; o++) {                                                              \
            const uint8_t *wr = (const uint8_t *)w->data + (o0 + o) * w->ld;                           \
            const float *sr = w->scale + (o0 + o) / w->bo * w->lds;                                    \
            __m256 tot[MB], acc[MB][U];                                                                \
            for (int m = 0; m < MB; m++) tot[m] = _mm256_setzero_ps();                                 \
            for (int64_t k0 = 0; k0 < K8; k0 += bk) {                                                  \
                int64_t end = k0 + bk < K8 ? k0 + bk : K8, k = k0;                                     \
                for (int m = 0; m < MB; m++)                                                           \
                    for (int u = 0; u < U; u++) acc[m][u] = _mm256_setzero_ps();                       \
                for (; k + 8 * U <= end; k += 8 * U)                                                   \
                    for (int u = 0; u < U; u++) {                                                      \
                        __m256 wv = load_fp8x8(wr + k + 8 * u);                                        \
                        for (int m = 0; m < MB; m++)                                                   \
                            acc[m][u] = _mm256_fmadd_ps(_mm256_loadu_ps(x + m * ldx + k + 8 * u), wv,  \
                                                        acc[m][u]);                                    \
                    }                                                                                  \
                for (; k < end; k += 8) {                                                              \
                    __m256 wv = load_fp8x8(wr + k);                                                    \
                    for (int m = 0; m < MB; m++)                                                       \
                        acc[m][0] = _mm256_fmadd_ps(_mm256_loadu_ps(x + m * ldx + k), wv, acc[m][0]);  \
                }                                                                                      \
                __m256 sv = _mm256_set1_ps(sr[k0 / bk * w->ldsk] * 256.0f);                            \
                for (int m = 0; m < MB; m++) {                                                         \
                    __m256 t = acc[m][0];                                                              \
                    for (int u = 1; u < U; u++) t = _mm256_add_ps(t, acc[m][u]);                       \
                    tot[m] = _mm256_fmadd_ps(t, sv, tot[m]);                                           \
                }                                                                                      \
            }                                                                                          \
            for (int m = 0; m < MB; m++) {                                                             \
                float s = hsum8(tot[m]);                                                               \
                for (int64_t kk = K8; kk < K; kk++)                                                    \
                    s += x[m * ldx + kk] * (fp8_to_f32(wr[kk]) * sr[kk / bk * w->ldsk]);               \
                y[m * ldy + o] = s;                                                                    \
            }                                                                                          \
        }                                                                                              \
    }

typedef void (*block8_fn)(const float *, int64_t, const Weight *, int64_t, float *, int64_t, int64_t, int64_t);

#ifdef __AVX512F__
/* The AVX-512 builds: 16 weights a vector (load_fp8x16, bf16w.h), twice the multiply-adds an instruction of the AVX2 blocks
 * above, the weight's lines prefetched PREFETCH16 bytes ahead as the bf16 kernel does; the 8 inputs a block of
 * bk (a multiple of 8) may leave go as one vector with its top 8 lanes zero. Sums in another order than the AVX2
 * blocks', the same arithmetic otherwise. On a Zen 5 VM (AVX-512, 2 threads) decode products of 1-12 rows by a
 * 1536 x 512 FP8 weight took 19-33% less time (scripts/bench_linear.py --fp8-weights, two runs each). */
#define PREFETCH16 4096

#define BLOCK16(MB, U)                                                                                  \
    static void block16_##MB(const float *x, int64_t ldx, const Weight *w, int64_t o0, float *y,       \
                             int64_t ldy, int64_t K, int64_t O) {                                      \
        int64_t K8 = K & ~(int64_t)7, bk = w->bk;                                                      \
        for (int64_t o = 0; o < O; o++) {                                                              \
            const uint8_t *wr = (const uint8_t *)w->data + (o0 + o) * w->ld;                           \
            const float *sr = w->scale + (o0 + o) / w->bo * w->lds;                                    \
            __m512 tot[MB], acc[MB][U];                                                                \
            for (int m = 0; m < MB; m++) tot[m] = _mm512_setzero_ps();                                 \
            for (int64_t k0 = 0; k0 < K8; k0 += bk) {                                                  \
                int64_t end = k0 + bk < K8 ? k0 + bk : K8, k = k0;                                     \
                for (int m = 0; m < MB; m++)                                                           \
                    for (int u = 0; u < U; u++) acc[m][u] = _mm512_setzero_ps();                       \
                for (; k + 16 * U <= end; k += 16 * U) {                                               \
                    _mm_prefetch((const char *)(wr + k) + PREFETCH16, _MM_HINT_T0);                    \
                    for (int u = 0; u < U; u++) {                                                      \
                        __m512 wv = load_fp8x16(wr + k + 16 * u);                                      \
                        for (int m = 0; m < MB; m++)                                                   \
                            acc[m][u] = _mm512_fmadd_ps(_mm512_loadu_ps(x + m * ldx + k + 16 * u), wv, \
                                                        acc[m][u]);                                    \
                    }                                                                                  \
                }                                                                                      \
                for (; k + 16 <= end; k += 16) {                                                       \
                    __m512 wv = load_fp8x16(wr + k);                                                   \
                    for (int m = 0; m < MB; m++)                                                       \
                        acc[m][0] = _mm512_fmadd_ps(_mm512_loadu_ps(x + m * ldx + k), wv, acc[m][0]);  \
                }                                                                                      \
                if (k < end) { /* 8 left */                                                            \
                    __m512 wv = load_fp8x8_of16(wr + k);                                               \
                    for (int m = 0; m < MB; m++)                                                       \
                        acc[m][0] = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(0xff, x + m * ldx + k), wv,  \
                                                    acc[m][0]);                                        \
                }                                                                                      \
                __m512 sv = _mm512_set1_ps(sr[k0 / bk * w->ldsk] * 256.0f);                            \
                for (int m = 0; m < MB; m++) {                                                         \
                    __m512 t = acc[m][0];                                                              \
                    for (int u = 1; u < U; u++) t = _mm512_add_ps(t, acc[m][u]);                       \
                    tot[m] = _mm512_fmadd_ps(t, sv, tot[m]);                                           \
                }                                                                                      \
            }                                                                                          \
            for (int m = 0; m < MB; m++) {                                                             \
                float s = _mm512_reduce_add_ps(tot[m]);                                                \
                for (int64_t kk = K8; kk < K; kk++)                                                    \
                    s += x[m * ldx + kk] * (fp8_to_f32(wr[kk]) * sr[kk / bk * w->ldsk]);               \
                y[m * ldy + o] = s;                                                                    \
            }                                                                                          \
        }                                                                                              \
    }

BLOCK16(1, 4)
BLOCK16(2, 2)
BLOCK16(3, 2)
BLOCK16(4, 2)
BLOCK16(5, 1)
BLOCK16(6, 1)
BLOCK16(7, 1)
BLOCK16(8, 1)

static const block8_fn BLOCKS8[9] = {0, block16_1, block16_2, block16_3, block16_4, block16_5, block16_6, block16_7,
                                     block16_8};
#else
BLOCK8(1, 4)
BLOCK8(2, 2)
BLOCK8(3, 2)
BLOCK8(4, 2)
BLOCK8(5, 1)
BLOCK8(6, 1)
BLOCK8(7, 1)
BLOCK8(8, 1)

static const block8_fn BLOCKS8[9] = {0, block8_1, block8_2, block8_3, block8_4, block8_5, block8_6, block8_7, block8_8};
#endif

void fp8w_block(int64_t MB, const float *x, int64_t ldx, const Weight *w, int64_t o0, float *y, int64_t ldy,
                int64_t K, int64_t O) {
    BLOCKS8[MB](x, ldx, w, o0, y, ldy, K, O);
}
