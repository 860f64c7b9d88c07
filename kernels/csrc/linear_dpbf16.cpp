/* y = x w^T for float32 x and a bf16 w on AVX512-BF16 dot products (AMD Zen 4 and later, Intel Cooper Lake):
 * the x rows are rounded to bf16 (to nearest even, as torch's .bfloat16()), products of bf16 pairs are summed
 * in float32, y is float32: the same arithmetic as the AMX tiles (linear_amx.cpp), for CPUs that have
 * AVX512-BF16 but no tiles. Only in the AVX512-BF16 build (kernels/cpu_build.py) and only for products of at
 * least `tile_rows` rows (set_tile_rows): the prompt-sized GEMMs, where the float32 kernels of
 * linear_bf16w.cpp are bound by arithmetic (widening each weight, then 16 multiply-adds an instruction) and
 * one vdpbf16ps does 32. The reference is F.linear(x.bfloat16().float(), w.float()) (kernels/cpu_bf16w.py),
 * which this equals up to the order of float32 sums.
 *
 * x is packed once per call, by all the threads, into blocks of 16 rows of (bf16, bf16) pairs along K (pack_x,
 * pack_bf16.h), so 16 x rows' pairs at one k lie in one vector; the weight stays as loaded ([O, K]): its pair (w[o,
 * 2kp], w[o, 2kp + 1]) is one 32-bit value, broadcast to all lanes. A step of the inner loop multiplies 8 weight rows
 * by up to 48 x rows (24 accumulators of 16 lanes: lane j holds y[m0 + 16i + j, o0 + o]), or 16 weight rows by the
 * last 16 (decode batches of 16: twice the sums in flight); the next group of weight rows is prefetched meanwhile.
 * Each thread takes 32 weight rows at a time against all of x, 48 x rows at a time, their 48 x 32 outputs gathered in
 * a buffer and copied into y a row at a time (stored straight into y, the scattered columns cost up to half the time
 * where y rows are long). A last block of up to 8 rows (M = 20: 4) goes along K instead (tail_rows), where a
 * block of 16 lanes would be mostly zeros: products of 17-24 rows took 12-25% less time on a Zen 5 VM. Shapes that this does not cover (O not a multiple of 16, K not one of 32, FP8 weights)
 * return 0 and the float32 kernel runs.
 */
#include <string.h>

#include "bf16w.h"
#include "pack_bf16.h"

#if defined(__AVX512BF16__) && !HAVE_AMX_BF16

static int64_t dp_rows; /* 0: off */

#define TAIL_ROWS 8 /* a last block of this many x rows or fewer goes along K (tail_rows) */

/* weight rows o0 .. o0 + NO against x rows m0 .. m0 + 16 * NM (zeros past M in xp), into columns oc .. oc + NO
 * of c [16 * NM][32] */
template <int NO, int NM>
static void rows_block(const uint16_t *w, int64_t ldw, const uint32_t *xp, int64_t K, int64_t m0,
                       int64_t o0, float *c, int oc) {
    __m512 acc[NO][NM];
    const int32_t *wr[NO];
    for (int o = 0; o < NO; o++) {
        wr[o] = (const int32_t *)(w + (o0 + o) * ldw);
        for (int i = 0; i < NM; i++) acc[o][i] = _mm512_setzero_ps();
    }
    const uint32_t *xr = xp + m0 * (K / 2);  /* 16 x rows a block, [K / 2, 16] each */
    for (int64_t kp = 0; kp < K / 2; kp++, xr += 16) {
        if ((kp & 15) == 0) /* the same line of the next NO weight rows: NO short rows read side by side are
                               more streams than the hardware prefetcher follows, on a weight read from memory */
            for (int o = 0; o < NO; o++) _mm_prefetch((const char *)(wr[o] + NO * ldw / 2 + kp), _MM_HINT_T0);
        __m512bh xv[NM];
        for (int i = 0; i < NM; i++) xv[i] = (__m512bh)_mm512_loadu_si512(xr + i * 8 * K);
        for (int o = 0; o < NO; o++) {
            __m512bh wv = (__m512bh)_mm512_set1_epi32(wr[o][kp]);
            for (int i = 0; i < NM; i++) acc[o][i] = _mm512_dpbf16_ps(acc[o][i], xv[i], wv);
        }
    }
    alignas(64) float lanes[16];
    for (int i = 0; i < NM; i++)
        for (int o = 0; o < NO; o++) {
            _mm512_store_ps(lanes, acc[o][i]);
            for (int j = 0; j < 16; j++) c[(16 * i + j) * 32 + oc + o] = lanes[j];
        }
}

/* The last R (< 16) x rows of a product, where a block of 16 lanes would be mostly zeros: lanes along K instead.
 * x rows in bf16 in row order (xt [R][K]); weight rows o0 .. o0 + NO each loaded 32 values at a time and dotted
 * with every x row, then each sum of 16 lanes reduced. A weight row costs R K / 32 dot products here against
 * K / 2 for a padded block of 16 rows. Into columns oc .. oc + NO of c [.][32], rows m0 .. m0 + NR. */
template <int NO, int NR>
static void tail_block(const uint16_t *w, int64_t ldw, const uint16_t *xt, int64_t K, int64_t o0, float *c,
                       int oc, int m0) {
    __m512 acc[NR][NO];
    for (int r = 0; r < NR; r++)
        for (int o = 0; o < NO; o++) acc[r][o] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += 32) {
        __m512bh wv[NO];
        for (int o = 0; o < NO; o++) wv[o] = (__m512bh)_mm512_loadu_si512(w + (o0 + o) * ldw + k);
        for (int r = 0; r < NR; r++) {
            __m512bh xv = (__m512bh)_mm512_loadu_si512(xt + r * K + k);
            for (int o = 0; o < NO; o++) acc[r][o] = _mm512_dpbf16_ps(acc[r][o], xv, wv[o]);
        }
    }
    for (int r = 0; r < NR; r++)
        for (int o = 0; o < NO; o++) c[(m0 + r) * 32 + oc + o] = _mm512_reduce_add_ps(acc[r][o]);
}

/* tail rows 0 .. R of xt against weight rows o0 .. o0 + 8 (4 x rows and 4 weight rows at a time) */
static void tail_rows(const uint16_t *w, int64_t ldw, const uint16_t *xt, int64_t R, int64_t K, int64_t o0,
                      float *c, int oc, int m0) {
    for (int o = 0; o < 8; o += 4) {
        int64_t r = 0;
        for (; r + 4 <= R; r += 4) tail_block<4, 4>(w, ldw, xt + r * K, K, o0 + o, c, oc + o, m0 + r);
        for (; r + 2 <= R; r += 2) tail_block<4, 2>(w, ldw, xt + r * K, K, o0 + o, c, oc + o, m0 + r);
        if (r < R) tail_block<4, 1>(w, ldw, xt + r * K, K, o0 + o, c, oc + o, m0 + r);
    }
}

int64_t set_tile_rows(int64_t rows) {
    if (rows >= 0) dp_rows = rows; /* rows < 0: only read it */
    return dp_rows;
}

int64_t expert_tile_rows(void) { return dp_rows; }  /* not measured lower on this build */

int linear_tiles_min(const float *x, int64_t ldx, const Weight *w, float *y, int64_t ldy, int64_t M, int64_t K,
                     int64_t O, int64_t min_rows) {
    int64_t Mp;
    uint32_t *xp = packed_x_for(w, M, K, O, min_rows, &Mp);
    if (!xp) return 0;
    /* A last block of at most TAIL_ROWS rows goes along K (tail_rows), not as a block of 16 mostly zero lanes */
    int64_t R = M % 16;
    if (R > TAIL_ROWS || M < 16) R = 0;
    if (R) Mp = M - R;  /* the scratch has room for 16 more packed rows: the tail's R rows of bf16 fit there */
    uint16_t *xt = (uint16_t *)(xp + (K / 2) * Mp);  /* the tail's x rows in bf16, [R][K] */
    const uint16_t *wd = (const uint16_t *)w->data;
    int64_t ldw = w->ld, blocks = (O + 31) / 32;
    int threads = blocks > 1 && O * K >= PARALLEL_MIN_WEIGHTS ? threads_for_region() : 1;
    pack_x(x, ldx, M - R, Mp, K, xp, threads);
    for (int64_t r = 0; r < R; r++)
        for (int64_t k = 0; k < K; k += 32) {
            const float *xr = x + (Mp + r) * ldx + k;
            _mm512_storeu_si512(xt + r * K + k, (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(xr + 16), _mm512_loadu_ps(xr)));
        }
    parallel_for(blocks, threads, [&](int64_t b, int) {
        int64_t ob = 32 * b, width = O - ob < 32 ? O - ob : 32;
        alignas(64) float c[(48 + TAIL_ROWS) * 32]; /* the block's y for 48 x rows and the tail, copied out a row at a time */
        for (int64_t m0 = 0; m0 < Mp; m0 += 48) { /* 48 x rows stay in cache for the block's weight rows */
            int64_t left = (Mp - m0) / 16;
            if (left == 1) /* 16 x rows: 16 weight rows a step, so 16 sums are in flight */
                for (int oc = 0; oc < width; oc += 16) rows_block<16, 1>(wd, ldw, xp, K, m0, ob + oc, c, oc);
            else
                for (int oc = 0; oc < width; oc += 8) {
                    if (left >= 3)
                        rows_block<8, 3>(wd, ldw, xp, K, m0, ob + oc, c, oc);
                    else
                        rows_block<8, 2>(wd, ldw, xp, K, m0, ob + oc, c, oc);
                }
            int64_t end = m0 + 48 < Mp ? m0 + 48 : Mp;
            if (end == Mp && R) { /* the tail, after the last block of 16 (its weight rows are in cache) */
                for (int oc = 0; oc < width; oc += 8) tail_rows(wd, ldw, xt, R, K, ob + oc, c, oc, (int)(end - m0));
                end += R;
            }
            for (int64_t m = m0; m < end && m < M; m++)
                memcpy(y + m * ldy + ob, c + (m - m0) * 32, (size_t)width * sizeof(float));
        }
    });
    return 1;
}

#endif
