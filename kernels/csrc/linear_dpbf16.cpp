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
 * where y rows are long). Shapes that this does not cover (O not a multiple of 16, K not one of 32, FP8 weights)
 * return 0 and the float32 kernel runs.
 */
#include <string.h>

#include "bf16w.h"
#include "pack_bf16.h"

#if defined(__AVX512BF16__) && !HAVE_AMX_BF16

static int64_t dp_rows; /* 0: off */

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
    const uint16_t *wd = (const uint16_t *)w->data;
    int64_t ldw = w->ld, blocks = (O + 31) / 32;
    int threads = blocks > 1 && O * K >= PARALLEL_MIN_WEIGHTS ? threads_for_region() : 1;
    pack_x(x, ldx, M, Mp, K, xp, threads);
    parallel_for(blocks, threads, [&](int64_t b, int) {
        int64_t ob = 32 * b, width = O - ob < 32 ? O - ob : 32;
        alignas(64) float c[48 * 32]; /* the block's y for 48 x rows, copied out a row at a time */
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
            for (int64_t m = m0; m < M && m < m0 + 48; m++)
                memcpy(y + m * ldy + ob, c + (m - m0) * 32, (size_t)width * sizeof(float));
        }
    });
    return 1;
}

#endif
