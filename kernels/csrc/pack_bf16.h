/* bf16 pairs of x for the bf16 products (linear_amx.cpp on AMX tiles, linear_dpbf16.cpp on AVX512-BF16 dot
 * products): both take x packed along K in (bf16, bf16) pairs, one 32-bit value per x row. */
#ifndef MOE_PACK_BF16_H
#define MOE_PACK_BF16_H

#include "bf16w.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define HAVE_AMX_BF16 1  /* the AMX build */
#else
#define HAVE_AMX_BF16 0
#endif

#if HAVE_AMX_BF16
/* Every tile 16 rows of 64 bytes (A and B operands of 16 x 32 bf16, C of 16 x 16 float32), in this thread's
 * tile state (a core's): before the first tile instruction of a kernel; _tile_release() after its last. */
static inline void tiles_on(void) {
    struct {
        uint8_t palette, start_row, reserved[14];
        uint16_t colsb[16];
        uint8_t rows[16];
    } c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 8; t++) { c.rows[t] = 16; c.colsb[t] = 64; }
    _tile_loadconfig(&c);
}
#endif

#ifdef __AVX512BF16__
/* out[j][i] = in[i][j] for 16 x 16 32-bit values: pairs of rows interleaved by 32 then 64 bits (within each
 * 128-bit lane), then the 4 x 4 lanes transposed */
static inline void transpose16(const __m512i *in, __m512i *out) {
    __m512i t[16], u[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_epi32(in[i], in[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(in[i], in[i + 1]);
    }
    for (int g = 0; g < 16; g += 4) {  /* u[g + c], lane L: rows g..g + 3 of column 4L + c */
        u[g] = _mm512_unpacklo_epi64(t[g], t[g + 2]);
        u[g + 1] = _mm512_unpackhi_epi64(t[g], t[g + 2]);
        u[g + 2] = _mm512_unpacklo_epi64(t[g + 1], t[g + 3]);
        u[g + 3] = _mm512_unpackhi_epi64(t[g + 1], t[g + 3]);
    }
    for (int c = 0; c < 4; c++) {
        __m512i v0 = _mm512_shuffle_i32x4(u[c], u[4 + c], 0x44), v1 = _mm512_shuffle_i32x4(u[c], u[4 + c], 0xee);
        __m512i v2 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0x44);
        __m512i v3 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0xee);
        out[c] = _mm512_shuffle_i32x4(v0, v2, 0x88);
        out[4 + c] = _mm512_shuffle_i32x4(v0, v2, 0xdd);
        out[8 + c] = _mm512_shuffle_i32x4(v1, v3, 0x88);
        out[12 + c] = _mm512_shuffle_i32x4(v1, v3, 0xdd);
    }
}

/* out[kp * 16 + i] = (bf16(x[m0 + i, 2kp]), bf16(x[m0 + i, 2kp + 1])) for i < 16 (zeros where m0 + i >= M): 16
 * rows by 32 columns of x at a time, converted (16 pairs a row) and transposed. */
static inline void pack_x_rows(const float *x, int64_t ldx, int64_t M, int64_t K, int64_t m0, uint32_t *out) {
    __m512i rows[16], cols[16];
    for (int64_t k = 0; k < K; k += 32) {
        for (int i = 0; i < 16; i++) {
            const float *r = x + (m0 + i) * ldx + k;
            rows[i] = m0 + i < M ? (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(r + 16), _mm512_loadu_ps(r))
                                 : _mm512_setzero_si512();
        }
        transpose16(rows, cols);
        for (int c = 0; c < 16; c++) _mm512_storeu_si512(out + (k / 2 + c) * 16, cols[c]);
    }
}

/* The shared start of a bf16 product: NULL where the bf16 kernels do not take it (off, fewer than min_rows
 * rows, an FP8 weight unless fp8 is set, K not a multiple of 32, O not one of 16) or memory ran out; else room in
 * this thread's scratch for x packed by pack_x (K / 2 x Mp pairs), with *Mp = M rounded up to 16. */
static inline uint32_t *packed_x_for(const Weight *w, int64_t M, int64_t K, int64_t O, int64_t min_rows, int64_t *Mp,
                                     int fp8) {
    if (!min_rows || M < min_rows || (w->scale && !fp8) || K % 32 || O % 16) return NULL;
    *Mp = (M + 15) & ~(int64_t)15;
    return (uint32_t *)thread_scratch((size_t)(K / 2) * (size_t)*Mp * 4);
}

/* x packed into xp in blocks of 16 rows, each [K / 2, 16] pairs (block m0 / 16 at xp + m0 K / 2), so that the
 * 16 rows' pairs at one k are one vector and a block's vectors follow one another (one [K / 2, Mp] array put
 * the vectors of successive k Mp x 4 bytes apart: at Mp = 2048, all in one L1 set). The blocks are split over
 * up to `threads` threads where there are enough values to pay for it. */
static inline void pack_x(const float *x, int64_t ldx, int64_t M, int64_t Mp, int64_t K, uint32_t *xp, int threads) {
    parallel_for(Mp / 16, Mp * K >= PARALLEL_MIN_VALUES ? threads : 1,
                 [&](int64_t i, int) { pack_x_rows(x, ldx, M, K, 16 * i, xp + 16 * i * (K / 2)); });
}
#endif
#endif
