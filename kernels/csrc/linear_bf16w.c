/* y = x w^T for float32 x and bf16 w, float32 accumulation, on AVX2 + FMA: the decode-size linear of a bf16
 * model on a CPU without bf16 arithmetic (kernels/cpu_bf16w.py builds this file and holds its reference).
 *
 * A few rows of x against a weight read once from memory: the weight is loaded as bf16 (2 bytes a value,
 * half a float32 copy) and widened in registers (bf16 is the top half of a float32). Rows go in blocks of
 * up to 8, each weight row (o) against every row of the block; a block of MB rows keeps MB x U
 * accumulators of 8 lanes, U independent chains over k so FMA latency does not serialise one row.
 *
 * Shapes: x [M, K] (row stride ldx), w [O, K] (bf16 bits, row stride ldw), y [M, O] (row stride ldy).
 */
#include <immintrin.h>
#include <stdint.h>

static inline __m256 load_bf16x8(const uint16_t *p) {
    __m128i h = _mm_loadu_si128((const __m128i *)p);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

static inline float bf16_to_f32(uint16_t h) {
    union { uint32_t u; float f; } v;
    v.u = (uint32_t)h << 16;
    return v.f;
}

#define BLOCK(MB, U)                                                                                    \
    static void block_##MB(const float *x, int64_t ldx, const uint16_t *w, int64_t ldw, float *y,     \
                           int64_t ldy, int64_t K, int64_t O) {                                        \
        for (int64_t o = 0; o < O; o++) {                                                              \
            const uint16_t *wr = w + o * ldw;                                                          \
            __m256 acc[MB][U];                                                                         \
            for (int m = 0; m < MB; m++)                                                               \
                for (int u = 0; u < U; u++) acc[m][u] = _mm256_setzero_ps();                           \
            int64_t k = 0;                                                                             \
            for (; k + 8 * U <= K; k += 8 * U)                                                         \
                for (int u = 0; u < U; u++) {                                                          \
                    __m256 wv = load_bf16x8(wr + k + 8 * u);                                           \
                    for (int m = 0; m < MB; m++)                                                       \
                        acc[m][u] = _mm256_fmadd_ps(_mm256_loadu_ps(x + m * ldx + k + 8 * u), wv,      \
                                                    acc[m][u]);                                        \
                }                                                                                      \
            for (; k + 8 <= K; k += 8) {                                                               \
                __m256 wv = load_bf16x8(wr + k);                                                       \
                for (int m = 0; m < MB; m++)                                                           \
                    acc[m][0] = _mm256_fmadd_ps(_mm256_loadu_ps(x + m * ldx + k), wv, acc[m][0]);      \
            }                                                                                          \
            for (int m = 0; m < MB; m++) {                                                             \
                __m256 t = acc[m][0];                                                                  \
                for (int u = 1; u < U; u++) t = _mm256_add_ps(t, acc[m][u]);                           \
                float s = hsum8(t);                                                                    \
                for (int64_t kk = k; kk < K; kk++) s += x[m * ldx + kk] * bf16_to_f32(wr[kk]);         \
                y[m * ldy + o] = s;                                                                    \
            }                                                                                          \
        }                                                                                              \
    }

BLOCK(1, 4)
BLOCK(2, 2)
BLOCK(3, 2)
BLOCK(4, 2)
BLOCK(5, 1)
BLOCK(6, 1)
BLOCK(7, 1)
BLOCK(8, 1)

typedef void (*block_fn)(const float *, int64_t, const uint16_t *, int64_t, float *, int64_t, int64_t, int64_t);
static const block_fn BLOCKS[9] = {0, block_1, block_2, block_3, block_4, block_5, block_6, block_7, block_8};

void linear_bf16w(const float *x, int64_t ldx, const uint16_t *w, int64_t ldw, float *y, int64_t ldy,
                  int64_t M, int64_t K, int64_t O) {
    for (int64_t m0 = 0; m0 < M; m0 += 8) {
        int64_t mb = M - m0 < 8 ? M - m0 : 8;
        BLOCKS[mb](x + m0 * ldx, ldx, w, ldw, y + m0 * ldy, ldy, K, O);
    }
}
