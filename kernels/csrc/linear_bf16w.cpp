/* y = x w^T for float32 x and bf16 w, float32 accumulation, on AVX2 + FMA (or AVX-512): the linear of a bf16
 * model on a CPU without bf16 arithmetic (kernels/cpu_bf16w.py holds its reference). The drivers here (tiles,
 * threads, batches) also run FP8 weights, whose blocks of rows are in linear_fp8w.cpp.
 *
 * The weight is loaded as bf16 (2 bytes a value, half a float32 copy) and widened in registers. Rows go in
 * blocks of up to 8, each weight row (o) against every row of the block; a block of MB rows keeps MB x U
 * accumulators of LANES lanes (below), U independent chains over k so FMA latency does not serialise one
 * row. With more than 8 rows the weight goes in tiles of about 64 KiB, each tile against every block of
 * rows, so it is read from memory once and from cache by the other blocks.
 *
 * Shapes: x [M, K] (row stride ldx), w [O, K] (bf16 bits, row stride ldw), y [M, O] (row stride ldy).
 */
#include "bf16w.h"

/* One vector of float32 lanes: 8 with AVX2, 16 in the AVX-512 build (kernels/cpu_build.py builds it where the
 * CPU has AVX-512 F/BW/VL: twice the multiply-adds per instruction, and 32 vector registers for the
 * accumulators). The same order of work; sums differ between the builds only in float32 rounding. */
#ifdef __AVX512F__
#define LANES 16
typedef __m512 vecf;
#define VZERO _mm512_setzero_ps
#define VLOADX _mm512_loadu_ps
#define VLOADW load_bf16x16
#define VFMA _mm512_fmadd_ps
#define VADD _mm512_add_ps
#else
#define LANES 8
typedef __m256 vecf;
#define VZERO _mm256_setzero_ps
#define VLOADX _mm256_loadu_ps
#define VLOADW load_bf16x8
#define VFMA _mm256_fmadd_ps
#define VADD _mm256_add_ps
#endif

/* The weight is read once, from memory, as one stream per thread: a software prefetch PREFETCH_BYTES ahead
 * (one per 64-byte line; LINE_VECS vectors of bf16 a line) keeps more lines in flight than the hardware
 * prefetcher does on its own, which stops at each 4 KiB page. On a 2-core Intel Xeon VM a product of 1 / 2 / 4
 * rows by a 512 x 512 weight went from 29-30 / 31 / 35-38 to 26-31 / 26 / 30-31 us (scripts/bench_linear.py,
 * docs/benchmarks.md); the sums are unchanged (same order of work). */
#define PREFETCH_BYTES 4096
#define LINE_VECS (64 / (2 * LANES))

/* Each output's LANES partial sums are summed with those of LANES - 1 other outputs at once (store_sums, bf16w.h:
 * a transposed sum, a vector of LANES outputs stored at once), not one horizontal sum an output: with a short K
 * (128, MLA's per-head w_uk) one sum an output cost as much as the multiply-adds. The inputs past the last whole
 * vector are added after, in order, as before. */
#define BLOCK(MB, U)                                                                                    \
    static void block_##MB(const float *x, int64_t ldx, const uint16_t *w, int64_t ldw, float *y,     \
                           int64_t ldy, int64_t K, int64_t O) {                                        \
        alignas(64) vecf tot[MB][LANES];                                                               \
        const int64_t kv = K / (LANES * U) * (LANES * U), kl = K / LANES * LANES;                     \
        for (int64_t o0 = 0; o0 < O; o0 += LANES) {                                                    \
            const int n = O - o0 < LANES ? (int)(O - o0) : LANES;                                      \
            for (int j = 0; j < n; j++) {                                                              \
                const uint16_t *wr = w + (o0 + j) * ldw;                                               \
                vecf acc[MB][U];                                                                       \
                for (int m = 0; m < MB; m++)                                                           \
                    for (int u = 0; u < U; u++) acc[m][u] = VZERO();                                   \
                for (int64_t k = 0; k < kv; k += LANES * U) {                                          \
                    for (int u = 0; u < U; u += LINE_VECS)                                             \
                        _mm_prefetch((const char *)(wr + k + LANES * u) + PREFETCH_BYTES, _MM_HINT_T0);\
                    for (int u = 0; u < U; u++) {                                                      \
                        vecf wv = VLOADW(wr + k + LANES * u);                                          \
                        for (int m = 0; m < MB; m++)                                                   \
                            acc[m][u] = VFMA(VLOADX(x + m * ldx + k + LANES * u), wv, acc[m][u]);      \
                    }                                                                                  \
                }                                                                                      \
                for (int64_t k = kv; k < kl; k += LANES) {                                             \
                    vecf wv = VLOADW(wr + k);                                                          \
                    for (int m = 0; m < MB; m++)                                                       \
                        acc[m][0] = VFMA(VLOADX(x + m * ldx + k), wv, acc[m][0]);                      \
                }                                                                                      \
                for (int m = 0; m < MB; m++) {                                                         \
                    vecf t = acc[m][0];                                                                \
                    for (int u = 1; u < U; u++) t = VADD(t, acc[m][u]);                                \
                    tot[m][j] = t;                                                                     \
                }                                                                                      \
            }                                                                                          \
            for (int m = 0; m < MB; m++) {                                                             \
                float *ym = y + m * ldy + o0;                                                          \
                store_sums(ym, tot[m], n);                                                             \
                for (int j = 0; kl < K && j < n; j++) {                                                \
                    const uint16_t *wr = w + (o0 + j) * ldw;                                           \
                    for (int64_t kk = kl; kk < K; kk++) ym[j] += x[m * ldx + kk] * bf16_to_f32(wr[kk]);\
                }                                                                                      \
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

#define TILE_BYTES (64 << 10)

/* rows o0 .. o0 + O of w into y[:, 0..O), one thread */
static void linear_serial(const float *x, int64_t ldx, const Weight *w, int64_t o0, float *y, int64_t ldy,
                          int64_t M, int64_t K, int64_t O) {
    int64_t tile = M <= 8 ? O : TILE_BYTES / ((w->scale ? 1 : 2) * (K > 0 ? K : 1));
    if (tile < 8) tile = 8;
    for (int64_t t0 = 0; t0 < O; t0 += tile) {
        int64_t ot = O - t0 < tile ? O - t0 : tile;
        for (int64_t m0 = 0; m0 < M; m0 += 8) {
            int64_t mb = M - m0 < 8 ? M - m0 : 8;
            if (w->scale)
                fp8w_block(mb, x + m0 * ldx, ldx, w, o0 + t0, y + m0 * ldy + t0, ldy, K, ot);
            else
                BLOCKS[mb](x + m0 * ldx, ldx, (const uint16_t *)w->data + (o0 + t0) * w->ld, w->ld,
                           y + m0 * ldy + t0, ldy, K, ot);
        }
    }
}

int linear_tiles(const float *x, int64_t ldx, const Weight *w, float *y, int64_t ldy, int64_t M, int64_t K,
                 int64_t O) {
    return linear_tiles_min(x, ldx, w, y, ldy, M, K, O, set_tile_rows(-1));
}

void linear_w(const float *x, int64_t ldx, const Weight *w, float *y, int64_t ldy, int64_t M, int64_t K, int64_t O) {
    if (linear_tiles(x, ldx, w, y, ldy, M, K, O)) return;  /* the AMX build, enough rows: linear_amx.cpp */
    int nt = threads_for_region();
    if (nt > 1 && O >= 16 && O * K >= PARALLEL_MIN_WEIGHTS) {
        /* runs of weight rows (multiples of 8, about 8 per thread) handed out as threads come free: a thread
         * that another process preempts holds up the others by one run, not by its whole share */
        int64_t run = (O / (8 * nt) + 7) & ~(int64_t)7;
        if (run < 16) run = 16;
        parallel_for((O + run - 1) / run, nt, [&](int64_t r, int) {
            int64_t o0 = r * run;
            linear_serial(x, ldx, w, o0, y + o0, ldy, M, K, O - o0 < run ? O - o0 : run);
        });
        return;
    }
    linear_serial(x, ldx, w, 0, y, ldy, M, K, O);
}

void linear_bf16w(const float *x, int64_t ldx, const uint16_t *w, int64_t ldw, float *y, int64_t ldy,
                  int64_t M, int64_t K, int64_t O) {
    Weight wb = bf16_weight(w, ldw, 0);
    linear_w(x, ldx, &wb, y, ldy, M, K, O);
}

/* The same for a batch of independent products (per-head weights): x and y of batch b start at x + b * bsx
 * and y + b * bsy, its weight is weight_at(*w, b). */
void linear_w_batched(const float *x, int64_t ldx, int64_t bsx, const Weight *w, float *y, int64_t ldy, int64_t bsy,
                      int64_t M, int64_t K, int64_t O, int64_t batch) {
    parallel_for(batch, threads_for_region(), [&](int64_t b, int) {
        Weight wb = weight_at(*w, b);
        if (!linear_tiles(x + b * bsx, ldx, &wb, y + b * bsy, ldy, M, K, O))  /* bf16 products: as linear_w */
            linear_serial(x + b * bsx, ldx, &wb, 0, y + b * bsy, ldy, M, K, O);
    });
}
