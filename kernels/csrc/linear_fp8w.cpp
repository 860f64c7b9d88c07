/* y = x w^T for float32 x and a block-quantised FP8 e4m3fn w (DeepSeek-V3's format: the weight is
 * w[o, k] * scale[o / bo, k / bk]), float32 accumulation, on AVX2 + FMA + F16C: a quarter of the bytes a
 * float32 weight reads, half of bf16's (kernels/cpu_bf16w.py holds its reference, F.linear on the
 * dequantised weight).
 *
 * Each group of 8 weights (16 in the AVX-512 builds) is widened in registers (load_fp8x8, load_fp8x16: exact,
 * times 2^-8); each block of bk inputs
 * sums x times the widened weights, and that sum, times the block's scale (times 2^8), is added to the
 * row's total: one multiply per block instead of one per weight (10-20% faster, the conversion being the
 * bottleneck). Results equal the reference up to float32 rounding: the reference rounds each w * scale
 * before multiplying by x, this kernel rounds the block's sum; with one nonzero term, w * scale exactly.
 * The blocks of rows and their accumulators are as in linear_bf16w.cpp, whose drivers (tiles, threads,
 * batches) call fp8w_block. In the AVX512-BF16 build, for a model served in bf16 (set_fp8_tiles), products go to
 * linear_dpbf16.cpp instead: many rows on its blocks of 16 rows, few along K (fp8_decode_dp, called from here).
 */
#include "bf16w.h"

/* One vector of float32 lanes: 8 with AVX2; 16 in the AVX-512 builds (load_fp8x16, bf16w.h: twice the
 * multiply-adds an instruction, the weight's lines prefetched PREFETCH_FP8 bytes ahead as the bf16 kernel does, and
 * the 8 inputs a block of bk, a multiple of 8, may leave past whole vectors go as one vector with its top 8 lanes
 * zero). Sums in another order in the two, the same arithmetic otherwise. On a Zen 5 VM (2 threads) the AVX-512
 * blocks took 19-33% less time than the AVX2 ones for decode products of 1-12 rows by a 1536 x 512 FP8 weight
 * (scripts/bench_linear.py --fp8-weights, two runs each). */
#ifdef __AVX512F__
#define FLANES 16
typedef __m512 fvec;
#define FZERO _mm512_setzero_ps
#define FLOADX _mm512_loadu_ps
#define FLOADW load_fp8x16
#define FLOADX_HALF(p) _mm512_maskz_loadu_ps(0xff, p)
#define FLOADW_HALF load_fp8x8_of16
#define FFMA _mm512_fmadd_ps
#define FADD _mm512_add_ps
#define FSET1 _mm512_set1_ps
#define FPREFETCH(p) _mm_prefetch((const char *)(p) + 4096, _MM_HINT_T0)
#else
#define FLANES 8
typedef __m256 fvec;
#define FZERO _mm256_setzero_ps
#define FLOADX _mm256_loadu_ps
#define FLOADW load_fp8x8
#define FLOADX_HALF FLOADX /* (never used: 8 lanes leave no half vector) */
#define FLOADW_HALF FLOADW
#define FFMA _mm256_fmadd_ps
#define FADD _mm256_add_ps
#define FSET1 _mm256_set1_ps
#define FPREFETCH(p) ((void)(p))
#endif

/* As linear_bf16w.cpp's blocks, each output's vector is summed with FLANES - 1 others' at once (store_sums). */
#define BLOCK8(MB, U)                                                                                   \
    static void block8_##MB(const float *x, int64_t ldx, const Weight *w, int64_t o0, float *y,        \
                            int64_t ldy, int64_t K, int64_t O) {                                       \
        int64_t K8 = K & ~(int64_t)7, bk = w->bk;                                                      \
        alignas(64) fvec tots[MB][FLANES];                                                             \
        for (int64_t og = 0; og < O; og += FLANES) {                                                   \
            const int n = O - og < FLANES ? (int)(O - og) : FLANES;                                    \
            for (int j = 0; j < n; j++) {                                                              \
                const uint8_t *wr = (const uint8_t *)w->data + (o0 + og + j) * w->ld;                  \
                const float *sr = w->scale + (o0 + og + j) / w->bo * w->lds;                           \
                fvec tot[MB], acc[MB][U];                                                              \
                for (int m = 0; m < MB; m++) tot[m] = FZERO();                                         \
                for (int64_t k0 = 0; k0 < K8; k0 += bk) {                                              \
                    int64_t end = k0 + bk < K8 ? k0 + bk : K8, k = k0;                                 \
                    for (int m = 0; m < MB; m++)                                                       \
                        for (int u = 0; u < U; u++) acc[m][u] = FZERO();                               \
                    for (; k + FLANES * U <= end; k += FLANES * U) {                                   \
                        FPREFETCH(wr + k);                                                             \
                        for (int u = 0; u < U; u++) {                                                  \
                            fvec wv = FLOADW(wr + k + FLANES * u);                                     \
                            for (int m = 0; m < MB; m++)                                               \
                                acc[m][u] = FFMA(FLOADX(x + m * ldx + k + FLANES * u), wv, acc[m][u]); \
                        }                                                                              \
                    }                                                                                  \
                    for (; k + FLANES <= end; k += FLANES) {                                           \
                        fvec wv = FLOADW(wr + k);                                                      \
                        for (int m = 0; m < MB; m++)                                                   \
                            acc[m][0] = FFMA(FLOADX(x + m * ldx + k), wv, acc[m][0]);                  \
                    }                                                                                  \
                    if (FLANES > 8 && k < end) { /* 8 left */                                          \
                        fvec wv = FLOADW_HALF(wr + k);                                                 \
                        for (int m = 0; m < MB; m++)                                                   \
                            acc[m][0] = FFMA(FLOADX_HALF(x + m * ldx + k), wv, acc[m][0]);             \
                    }                                                                                  \
                    fvec sv = FSET1(sr[k0 / bk * w->ldsk] * 256.0f);                                   \
                    for (int m = 0; m < MB; m++) {                                                     \
                        fvec t = acc[m][0];                                                            \
                        for (int u = 1; u < U; u++) t = FADD(t, acc[m][u]);                            \
                        tot[m] = FFMA(t, sv, tot[m]);                                                  \
                    }                                                                                  \
                }                                                                                      \
                for (int m = 0; m < MB; m++) tots[m][j] = tot[m];                                      \
            }                                                                                          \
            for (int m = 0; m < MB; m++) {                                                             \
                float *ym = y + m * ldy + og;                                                          \
                store_sums(ym, tots[m], n);                                                            \
                for (int j = 0; K8 < K && j < n; j++) {                                                \
                    const uint8_t *wr = (const uint8_t *)w->data + (o0 + og + j) * w->ld;              \
                    const float *sr = w->scale + (o0 + og + j) / w->bo * w->lds;                       \
                    for (int64_t kk = K8; kk < K; kk++)                                                \
                        ym[j] += x[m * ldx + kk] * (fp8_to_f32(wr[kk]) * sr[kk / bk * w->ldsk]);       \
                }                                                                                      \
            }                                                                                          \
        }                                                                                              \
    }

BLOCK8(1, 4)
BLOCK8(2, 2)
BLOCK8(3, 2)
BLOCK8(4, 2)
BLOCK8(5, 1)
BLOCK8(6, 1)
BLOCK8(7, 1)
BLOCK8(8, 1)

typedef void (*block8_fn)(const float *, int64_t, const Weight *, int64_t, float *, int64_t, int64_t, int64_t);
static const block8_fn BLOCKS8[9] = {0, block8_1, block8_2, block8_3, block8_4, block8_5, block8_6, block8_7, block8_8};

void fp8w_block(int64_t MB, const float *x, int64_t ldx, const Weight *w, int64_t o0, float *y, int64_t ldy,
                int64_t K, int64_t O) {
    if (fp8_decode_dp(MB, x, ldx, w, o0, y, ldy, K, O)) return;  /* a model served in bf16, AVX512-BF16 */
    BLOCKS8[MB](x, ldx, w, o0, y, ldy, K, O);
}
