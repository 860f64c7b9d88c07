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
 * block of 16 lanes would be mostly zeros: on a Zen 5 VM, alternating the two call by call in one process, products
 * of 17-24 rows took 12-25% less time, and a step of 4 decodes and a 16-token slice 3% less.
 *
 * FP8 weights (block scales, bf16w.h's Weight) in blocks of a multiple of 16 rows take the same path where
 * set_fp8_tiles turned it on (a model served in bf16): each thread
 * widens its 32 weight rows to bf16 once (widen_fp8: exactly, an e4m3 value having 4 significant bits), and
 * rows_block sums each block of bk inputs apart, adding it times the block's scale. The reference is then
 * F.linear(x.bfloat16().float(), the dequantised weight): x is rounded as for a bf16 weight, the weight is not.
 * On a Zen 5 VM a product of 16-256 rows by a 1536 x 512 FP8 weight took 2.1-3.5x less time than the float32
 * FP8 kernel (linear_fp8w.cpp, which widens each weight once per 8 x rows), 0.6-0.8x the bf16 weight's speed.
 * Products of few rows (decode: see FP8_LANE_ROWS) go along K instead, where K and the blocks' columns are multiples of
 * 32 (fp8_decode_dp, which linear_fp8w.cpp's fp8w_block calls for each 8 rows): 32 weights widened in registers
 * (fp8x32_to_bf16, as widen_fp8 does) and dotted with each x row, each block of bk summed apart and scaled, 16
 * outputs' lanes reduced at once. On the Zen 5 VM (1536 x 512, 2 threads, alternating with the float32 FP8 kernel
 * in one process) 1.1-1.2x faster at 1-2 rows, 1.4-1.5x at 4-24, and faster than a bf16 weight's float32 kernel at
 * every row count up to 8.
 *
 * Shapes that this does not cover (O not a multiple of 16, K not one of 32, FP8 blocks of other row counts) return
 * 0 and the float32 kernels run.
 */
#include <string.h>

#include "bf16w.h"
#include "pack_bf16.h"

#if defined(__AVX512BF16__) && !HAVE_AMX_BF16

static int64_t dp_rows; /* 0: off */

/* FP8 products of up to 8 x rows go along K (fp8_decode_dp, one pass over the weight); of up to FP8_LANE_ROWS where K
 * is at most FP8_LANE_K too (a pass per 8 rows, the weight's rows in cache for the later ones). On the Zen 5 VM at
 * 16 / 24 rows: 1536 x 512, along K 1.3x / 1.1x faster than widening blocks of 32 weight rows (below); 2048 x 7168,
 * 0.84x / 0.61x. */
#define FP8_LANE_ROWS 24
#define FP8_LANE_K 1024
#define TAIL_ROWS 8 /* a last block of this many x rows or fewer goes along K (tail_rows) */

/* weight rows o0 .. o0 + NO against x rows m0 .. m0 + 16 * NM (zeros past M in xp), into columns oc .. oc + NO
 * of c [16 * NM][32]. SCALED (an FP8 weight widened to bf16 times 2^-8, widen_fp8): each block of bk inputs is summed
 * apart and added times its scale sk[kb * ldsk] (one for the NO rows) times 2^8. */
template <int NO, int NM, bool SCALED>
static void rows_block(const uint16_t *w, int64_t ldw, const uint32_t *xp, int64_t K, int64_t m0,
                       int64_t o0, float *c, int oc, const float *sk, int64_t ldsk, int64_t bk) {
    __m512 acc[NO][NM], tot[NO][NM];
    const int32_t *wr[NO];
    for (int o = 0; o < NO; o++) {
        wr[o] = (const int32_t *)(w + (o0 + o) * ldw);
        for (int i = 0; i < NM; i++) tot[o][i] = _mm512_setzero_ps();
    }
    const int64_t step = SCALED ? bk / 2 : K / 2;  /* pairs a block of inputs */
    for (int64_t kp0 = 0; kp0 < K / 2; kp0 += step) {
        const int64_t kp1 = kp0 + step < K / 2 ? kp0 + step : K / 2;
        for (int o = 0; o < NO; o++)
            for (int i = 0; i < NM; i++) acc[o][i] = _mm512_setzero_ps();
        const uint32_t *xr = xp + m0 * (K / 2) + kp0 * 16;  /* 16 x rows a block, [K / 2, 16] each */
        for (int64_t kp = kp0; kp < kp1; kp++, xr += 16) {
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
        if (!SCALED) { /* one pass over K */
            for (int o = 0; o < NO; o++)
                for (int i = 0; i < NM; i++) tot[o][i] = acc[o][i];
            break;
        }
        __m512 sv = _mm512_set1_ps(sk[kp0 * 2 / bk * ldsk] * 256.0f);
        for (int o = 0; o < NO; o++)
            for (int i = 0; i < NM; i++) tot[o][i] = _mm512_fmadd_ps(acc[o][i], sv, tot[o][i]);
    }
    alignas(64) float lanes[16];
    for (int i = 0; i < NM; i++)
        for (int o = 0; o < NO; o++) {
            _mm512_store_ps(lanes, tot[o][i]);
            for (int j = 0; j < 16; j++) c[(16 * i + j) * 32 + oc + o] = lanes[j];
        }
}

/* rows_block for `left` blocks of 16 x rows from m0: 16 weight rows a step against the last 16 (so 16 sums are in
 * flight), else 8 against 32 or 48 */
template <bool SCALED>
static inline void rows_blocks(int64_t left, const uint16_t *w, int64_t ldw, const uint32_t *xp, int64_t K, int64_t m0,
                               int64_t o0, float *c, int oc, const float *sk, int64_t ldsk, int64_t bk) {
    if (left == 1)
        rows_block<16, 1, SCALED>(w, ldw, xp, K, m0, o0, c, oc, sk, ldsk, bk);
    else if (left >= 3)
        rows_block<8, 3, SCALED>(w, ldw, xp, K, m0, o0, c, oc, sk, ldsk, bk);
    else
        rows_block<8, 2, SCALED>(w, ldw, xp, K, m0, o0, c, oc, sk, ldsk, bk);
}

/* 32 FP8 e4m3fn values as bf16 bits, exactly, times 2^-8 (as load_fp8x16 widens them to float32): a normal value's
 * bits moved up by 4 (the sign, sign-extended, lands in bit 15; exponent and mantissa in bits 10..4) with the
 * exponent's bias raised by 112 (7 -> 127 less 8); a subnormal one (m 2^-9, m < 8: exponent bits 0) from a table
 * of m 2^-17. The NaN bytes give +-480 2^-8, as load_fp8x16. */
static inline __m512i fp8x32_to_bf16(const uint8_t *p) {
    const __m512i b = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)p)); /* the sign in bits 15..7 */
    __m512i v = _mm512_add_epi16(_mm512_and_si512(_mm512_slli_epi16(b, 4), _mm512_set1_epi16((short)0x87f0)),
                                 _mm512_set1_epi16(112 << 7)); /* (no carry into the sign: at most 0x3ff0) */
    __mmask32 sub = _mm512_testn_epi16_mask(b, _mm512_set1_epi16(0x78));
    if (sub) { /* rare in weights: zeros and values below 2^-6 of the block's scale */
        const __m512i table = _mm512_set_epi16(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
                                               0x3860, 0x3840, 0x3820, 0x3800, 0x37c0, 0x3780, 0x3700, 0);
        const __m512i m = _mm512_permutexvar_epi16(b, table); /* index: the low 5 bits, m */
        v = _mm512_mask_mov_epi16(v, sub, _mm512_ternarylogic_epi32(m, b, _mm512_set1_epi16((short)0x8000), 0xf8));
    }
    return v;
}

/* Rows o0 .. o0 + n of an FP8 weight widened into wb [n][K] (bf16 bits): each value exactly, times 2^-8 (an e4m3
 * value has 4 significant bits, bf16 holds 8); K a multiple of 32 */
static void widen_fp8(const Weight *w, int64_t o0, int64_t n, int64_t K, uint16_t *wb) {
    for (int64_t o = 0; o < n; o++) {
        const uint8_t *src = (const uint8_t *)w->data + (o0 + o) * w->ld;
        for (int64_t k = 0; k < K; k += 32) _mm512_storeu_si512(wb + o * K + k, fp8x32_to_bf16(src + k));
    }
}

/* R x rows (row stride ldx) rounded to bf16 into xb [R][K], row after row; K a multiple of 32 */
static void rows_to_bf16(const float *x, int64_t ldx, int64_t R, int64_t K, uint16_t *xb) {
    for (int64_t r = 0; r < R; r++)
        for (int64_t k = 0; k < K; k += 32) {
            const float *xr = x + r * ldx + k;
            _mm512_storeu_si512(xb + r * K + k,
                                (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(xr + 16), _mm512_loadu_ps(xr)));
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

static int64_t fp8_on; /* FP8 weights too (set_fp8_tiles) */

int64_t set_fp8_tiles(int64_t on) {
    if (on >= 0) fp8_on = on != 0;
    return fp8_on;
}

/* NR (<= 8) x rows in bf16 (xb [NR][K]) against FP8 weight rows o0 .. o0 + n (n <= 16) into y[:, 0..n), along K:
 * each block of bk inputs summed apart and added times its scale (times 2^8), each output's 16 lanes reduced at the
 * end (16 at once by store_sums) */
template <int NR>
static void fp8_lanes(const uint16_t *xb, int64_t K, const Weight *w, int64_t o0, int n, float *y, int64_t ldy) {
    alignas(64) __m512 tot[NR][16];
    const int64_t bk = w->bk;
    for (int o = 0; o < n; o++) {
        const uint8_t *wr = (const uint8_t *)w->data + (o0 + o) * w->ld;
        const float *sr = w->scale + (o0 + o) / w->bo * w->lds;
        __m512 t[NR];
        for (int r = 0; r < NR; r++) t[r] = _mm512_setzero_ps();
        for (int64_t k0 = 0; k0 < K; k0 += bk) {
            const int64_t end = k0 + bk < K ? k0 + bk : K; /* a last block cut short by K (still 32s) */
            __m512 a[NR][2];
            for (int r = 0; r < NR; r++) a[r][0] = a[r][1] = _mm512_setzero_ps();
            int64_t k = k0;
            for (; k + 64 <= end; k += 64) {
                _mm_prefetch((const char *)(wr + k) + 2048, _MM_HINT_T0);
                __m512bh w0 = (__m512bh)fp8x32_to_bf16(wr + k), w1 = (__m512bh)fp8x32_to_bf16(wr + k + 32);
                for (int r = 0; r < NR; r++) {
                    a[r][0] = _mm512_dpbf16_ps(a[r][0], (__m512bh)_mm512_loadu_si512(xb + r * K + k), w0);
                    a[r][1] = _mm512_dpbf16_ps(a[r][1], (__m512bh)_mm512_loadu_si512(xb + r * K + k + 32), w1);
                }
            }
            if (k < end) { /* 32 left */
                __m512bh w0 = (__m512bh)fp8x32_to_bf16(wr + k);
                for (int r = 0; r < NR; r++)
                    a[r][0] = _mm512_dpbf16_ps(a[r][0], (__m512bh)_mm512_loadu_si512(xb + r * K + k), w0);
            }
            __m512 sv = _mm512_set1_ps(sr[k0 / bk * w->ldsk] * 256.0f);
            for (int r = 0; r < NR; r++) t[r] = _mm512_fmadd_ps(_mm512_add_ps(a[r][0], a[r][1]), sv, t[r]);
        }
        for (int r = 0; r < NR; r++) tot[r][o] = t[r];
    }
    for (int r = 0; r < NR; r++) store_sums(y + r * ldy, tot[r], n);
}

/* Whether FP8 products by w can go along K at all (fp8_decode_dp): the setting on, K and the blocks' columns in 32s */
static inline int fp8_along_k(const Weight *w, int64_t K) {
    return fp8_on && dp_rows && K % 32 == 0 && w->bk % 32 == 0;
}

int fp8_decode_dp(int64_t MB, const float *x, int64_t ldx, const Weight *w, int64_t o0, float *y, int64_t ldy,
                  int64_t K, int64_t O) {
    if (!fp8_along_k(w, K) || MB < 1 || MB > 8) return 0;
    uint16_t *xb = (uint16_t *)thread_scratch((size_t)MB * K * 2);
    if (!xb) return 0;
    rows_to_bf16(x, ldx, MB, K, xb);
    for (int64_t o = 0; o < O; o += 16) {
        int n = O - o < 16 ? (int)(O - o) : 16;
        float *yo = y + o;
        switch (MB) {
        case 1: fp8_lanes<1>(xb, K, w, o0 + o, n, yo, ldy); break;
        case 2: fp8_lanes<2>(xb, K, w, o0 + o, n, yo, ldy); break;
        case 3: fp8_lanes<3>(xb, K, w, o0 + o, n, yo, ldy); break;
        case 4: fp8_lanes<4>(xb, K, w, o0 + o, n, yo, ldy); break;
        case 5: fp8_lanes<5>(xb, K, w, o0 + o, n, yo, ldy); break;
        case 6: fp8_lanes<6>(xb, K, w, o0 + o, n, yo, ldy); break;
        case 7: fp8_lanes<7>(xb, K, w, o0 + o, n, yo, ldy); break;
        default: fp8_lanes<8>(xb, K, w, o0 + o, n, yo, ldy); break;
        }
    }
    return 1;
}

int linear_tiles_min(const float *x, int64_t ldx, const Weight *w, float *y, int64_t ldy, int64_t M, int64_t K,
                     int64_t O, int64_t min_rows) {
    int64_t Mp;
    /* FP8 weights in blocks of a multiple of 16 rows (the scale is one for the 8 or 16 rows that rows_block takes) */
    const int fp8 = w->scale != NULL;
    if (fp8 && (M <= 8 || (M <= FP8_LANE_ROWS && K <= FP8_LANE_K)) && fp8_along_k(w, K))
        return 0; /* along K: linear_fp8w.cpp's fp8w_block calls fp8_decode_dp */
    uint32_t *xp = packed_x_for(w, M, K, O, min_rows, &Mp, fp8 && fp8_on && w->bo % 16 == 0 && w->bk % 2 == 0);
    if (!xp) return 0;
    const uint16_t *wd = (const uint16_t *)w->data;
    int64_t ldw = w->ld, blocks = (O + 31) / 32;
    int threads = blocks > 1 && O * K >= PARALLEL_MIN_WEIGHTS ? threads_for_region() : 1;
    uint16_t *wide = NULL; /* FP8: each thread's 32 weight rows of the block it runs, widened to bf16 */
    if (fp8 && !(wide = (uint16_t *)thread_scratch_at(1, (size_t)threads * 32 * (size_t)K * 2))) return 0;
    /* A last block of at most TAIL_ROWS rows goes along K (tail_rows), not as a block of 16 mostly zero lanes */
    int64_t R = M % 16;
    if (R > TAIL_ROWS || M < 16 || fp8) R = 0;
    if (R) Mp = M - R;  /* the scratch has room for 16 more packed rows: the tail's R rows of bf16 fit there */
    uint16_t *xt = (uint16_t *)(xp + (K / 2) * Mp);  /* the tail's x rows in bf16, [R][K] */
    pack_x(x, ldx, M - R, Mp, K, xp, threads);
    rows_to_bf16(x + Mp * ldx, ldx, R, K, xt);
    parallel_for(blocks, threads, [&](int64_t b, int slot) {
        int64_t ob = 32 * b, width = O - ob < 32 ? O - ob : 32;
        const uint16_t *wb = wd; /* the block's weight rows, from row wo */
        int64_t wo = ob, ldb = ldw;
        if (fp8) {
            uint16_t *room = wide + (size_t)slot * 32 * (size_t)K;
            widen_fp8(w, ob, width, K, room);
            wb = room, wo = 0, ldb = K;
        }
        alignas(64) float c[(48 + TAIL_ROWS) * 32]; /* the block's y for 48 x rows and the tail, copied out a row at a time */
        for (int64_t m0 = 0; m0 < Mp; m0 += 48) { /* 48 x rows stay in cache for the block's weight rows */
            int64_t left = (Mp - m0) / 16;
            for (int oc = 0; oc < width; oc += left == 1 ? 16 : 8) {
                const float *sk = fp8 ? w->scale + (ob + oc) / w->bo * w->lds : NULL; /* FP8: the rows' scales */
                if (fp8)
                    rows_blocks<true>(left, wb, ldb, xp, K, m0, wo + oc, c, oc, sk, w->ldsk, w->bk);
                else
                    rows_blocks<false>(left, wb, ldb, xp, K, m0, wo + oc, c, oc, sk, w->ldsk, w->bk);
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
