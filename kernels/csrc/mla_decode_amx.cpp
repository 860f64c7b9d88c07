/* One sequence of MLA's absorbed decode attention on AMX tiles (the AMX build only): the same arithmetic as
 * the AVX512-BF16 dot products of mla_decode_bf16.cpp (q rounded to bf16 for the scores, the softmax in
 * float32, the probabilities rounded to bf16 for the values, float32 sums; reference:
 * kernels/cpu_mla.py `reference(bf16_products=True)`), 16 heads a pass. A tile multiply does 16 x 16 x 32
 * multiply-adds where vdpbf16ps does 16 x 2, so the pass is bound by reading the cache, not by arithmetic.
 *
 * Scores, per 16 cached rows: C[16 rows, 16 heads] += A[16 rows, 32 dims] B[32 dims, 16 heads], where A is
 * the cache rows as they lie in their block (so the block size must be a multiple of 16) and B is q packed in
 * (bf16, bf16) pairs along the dims (qp, transposed once per pass).
 * Values, per 32 latent columns: C[16 heads, 32 columns] += A[16 heads, 32 rows] B[32 rows, 32 columns], A
 * the probabilities (pairs of rows, transposed once per pass), B the cache rows of two consecutive positions
 * interleaved (unpacklo / unpackhi by 16 bits: columns in the order mla_decode_bf16.cpp's value loop leaves
 * them, put back in place on the way out).
 *
 * Two queries of one context (the rows of one prompt chunk) share a pass where there are at most 8 heads, half
 * a tile's columns: the second query's heads in columns 8..16 of q's tile and rows 8..16 of the probabilities',
 * each half with its own context length (its softmax over its rows, its probabilities 0 past them). Every
 * product and sum is the one the query would get alone.
 *
 * Returns 1 when it ran, 0 where it does not apply (not the AMX build, tiles off, block size not a multiple of
 * 16, D or C not a multiple of 32), -1 when scratch memory could not be had.
 */
#include "bf16w.h"
#include "pack_bf16.h"

#if HAVE_AMX_BF16

#define TILE_HEADS 16

/* tile k-step `ks` of the scores' B operand: qp + ks * 256, [16 pairs of dims][16 heads] uint32; the heads of
 * qb in columns 0..nh, those of a second query qb2 (when not NULL: nh <= 8) in columns 8..8 + nh */
static void pack_q(const float *qb, const float *qb2, int64_t ldq_n, int64_t nh, int64_t D, uint32_t *qp) {
    __m512i rows[16], cols[16];
    for (int64_t d = 0; d < D; d += 32) {
        for (int n = 0; n < 16; n++) {
            const float *r = qb2 && n >= 8 ? qb2 + (n - 8) * ldq_n + d : qb + n * ldq_n + d;
            rows[n] = (qb2 ? n % 8 : n) < nh
                          ? (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(r + 16), _mm512_loadu_ps(r))
                          : _mm512_setzero_si512();
        }
        transpose16(rows, cols);  /* cols[j][n] = (q[n, d + 2j], q[n, d + 2j + 1]) */
        for (int j = 0; j < 16; j++) _mm512_storeu_si512(qp + (d / 32) * 256 + j * 16, cols[j]);
    }
}

/* 16 heads' probabilities of one row (exponentials times their 1 / sum) in bf16, 0 in the lanes not in `live`
 * (a row past the context of the query in those lanes) */
static inline __m256i probs_bf16(const float *row, __m512 vinv, __mmask16 live) {
    return (__m256i)_mm512_cvtneps_pbh(_mm512_maskz_mul_ps(live, _mm512_loadu_ps(row), vinv));
}

int mla_seq_tiles(const float *qb, const float *qb2, int64_t ldq_n, const uint16_t *cache, int64_t bs, int64_t D,
                  const int64_t *table, int64_t L1, int64_t L2, float *ob, float *ob2, int64_t ldo_n, int64_t N,
                  int64_t C, float scale) {
    if (set_tile_rows(-1) <= 0 || bs % 16 || D % 32 || C % 32 || L1 <= 0 || (qb2 && (N > 8 || L2 <= 0))) return 0;
    if (!qb2) L2 = L1;  /* lanes 8..16 hold heads 8.. of the one query */
    const int64_t L = L1 > L2 ? L1 : L2;  /* the rows a pass reads */
    int64_t L16 = (L + 15) & ~(int64_t)15, L32 = (L + 31) & ~(int64_t)31;
    size_t bytes = (size_t)(D / 32) * 256 * 4       /* qp */
                   + (size_t)L16 * TILE_HEADS * 4  /* s: scores [L16, 16 heads] */
                   + (size_t)(L32 / 2) * 16 * 4    /* pp: [pairs of rows, 16 heads] */
                   + (size_t)(L32 / 32) * 256 * 4  /* pa: per 32 rows, [16 heads, 16 pairs] */
                   + 2 * 256 * 4 + 2 * 256 * 4 + 64;  /* two B tiles of values, two C tiles out */
    char *buf = (char *)thread_scratch(bytes);
    if (!buf) return -1;
    uint32_t *qp = (uint32_t *)(((uintptr_t)buf + 63) & ~(uintptr_t)63);
    float *s = (float *)(qp + (D / 32) * 256);
    uint32_t *pp = (uint32_t *)(s + L16 * TILE_HEADS), *pa = pp + (L32 / 2) * 16;
    uint32_t *vb = pa + (L32 / 32) * 256;  /* [2][16 pairs of rows][16 columns] */
    float *cb = (float *)(vb + 2 * 256);   /* [2][16 heads][16 columns] */

    tiles_on();
    const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
    const __m512i second = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
    const __m512i zero = _mm512_setzero_si512();
    for (int64_t n0 = 0; n0 < N; n0 += TILE_HEADS) {
        int64_t nh = N - n0 < TILE_HEADS ? N - n0 : TILE_HEADS;
        pack_q(qb + n0 * ldq_n, qb2, ldq_n, nh, D, qp);
        /* scores: 32 cached rows at a time, as two groups of 16 (each within one block) into two C tiles, so that
         * two chains of tile multiplies overlap and q's tile is loaded once for both; rows past L give sums
         * never read. The next 32 rows are prefetched as the two runs of memory they are. */
        for (int64_t l0 = 0; l0 < L; l0 += 32) {
            const uint16_t *rows0 = cache + (table[l0 / bs] * bs + l0 % bs) * D;
            const uint16_t *rows1 = l0 + 16 < L ? cache + (table[(l0 + 16) / bs] * bs + (l0 + 16) % bs) * D : NULL;
            const char *next0 = l0 + 32 < L ? (const char *)(cache + (table[(l0 + 32) / bs] * bs + (l0 + 32) % bs) * D)
                                            : NULL;
            const char *next1 = l0 + 48 < L ? (const char *)(cache + (table[(l0 + 48) / bs] * bs + (l0 + 48) % bs) * D)
                                            : NULL;
            _tile_zero(0);
            _tile_zero(3);
            for (int64_t d = 0; d < D; d += 32) {
                /* 16 rows of D bf16 are 16 D / 32 lines: D / 32 steps of 16 lines each */
                if (next0)
                    for (int i = 0; i < 16; i++) _mm_prefetch(next0 + (d / 2 + i) * 64, _MM_HINT_T0);
                if (next1)
                    for (int i = 0; i < 16; i++) _mm_prefetch(next1 + (d / 2 + i) * 64, _MM_HINT_T0);
                _tile_loadd(2, qp + (d / 32) * 256, 64);
                _tile_loadd(1, rows0 + d, D * 2);
                _tile_dpbf16ps(0, 1, 2);
                if (rows1) {
                    _tile_loadd(4, rows1 + d, D * 2);
                    _tile_dpbf16ps(3, 4, 2);
                }
            }
            _tile_stored(0, s + l0 * TILE_HEADS, TILE_HEADS * 4);
            if (rows1) _tile_stored(3, s + (l0 + 16) * TILE_HEADS, TILE_HEADS * 4);
        }
        /* softmax over the context per head (8 heads in the lanes at a time), then (p[l], p[l + 1]) pairs in bf16 */
        alignas(64) float inv16[TILE_HEADS];
        for (int h = 0; h < 2; h++)
            _mm256_store_ps(inv16 + 8 * h, softmax_lanes8(s + 8 * h, TILE_HEADS, h ? L2 : L1, scale));
        const __m512 vinv = _mm512_load_ps(inv16);
        for (int64_t l = 0; l < L32; l += 2) {
            __mmask16 live0 = (l < L1 ? 0x00ff : 0) | (l < L2 ? 0xff00 : 0);
            __mmask16 live1 = (l + 1 < L1 ? 0x00ff : 0) | (l + 1 < L2 ? 0xff00 : 0);
            __m256i p0 = live0 ? probs_bf16(s + l * TILE_HEADS, vinv, live0) : _mm256_setzero_si256();
            __m256i p1 = live1 ? probs_bf16(s + (l + 1) * TILE_HEADS, vinv, live1) : _mm256_setzero_si256();
            /* (row l, row l + 1) pairs of heads 0-3 and 8-11 in lo, 4-7 and 12-15 in hi */
            __m256i lo = _mm256_unpacklo_epi16(p0, p1), hi = _mm256_unpackhi_epi16(p0, p1);
            _mm256_storeu_si256((__m256i *)(pp + (l / 2) * 16), _mm256_permute2x128_si256(lo, hi, 0x20));
            _mm256_storeu_si256((__m256i *)(pp + (l / 2) * 16 + 8), _mm256_permute2x128_si256(lo, hi, 0x31));
        }
        for (int64_t g = 0; g < L32 / 32; g++) {  /* the values' A operand: [16 heads][16 pairs of rows] */
            __m512i rows[16], cols[16];
            for (int j = 0; j < 16; j++) rows[j] = _mm512_loadu_si512(pp + (g * 16 + j) * 16);
            transpose16(rows, cols);
            for (int n = 0; n < 16; n++) _mm512_storeu_si512(pa + g * 256 + n * 16, cols[n]);
        }
        /* values: 32 latent columns at a time over the whole context */
        for (int64_t c0 = 0; c0 < C; c0 += 32) {
            _tile_zero(0);
            _tile_zero(1);
            for (int64_t l0 = 0; l0 < L; l0 += 32) {
                for (int j = 0; j < 16; j++) {  /* rows l0 + 2j and l0 + 2j + 1 (one block: bs is even) */
                    int64_t l = l0 + 2 * j;
                    __m512i a = zero, b = zero;
                    if (l < L) {
                        const uint16_t *r = cache + (table[l / bs] * bs + l % bs) * D + c0;
                        a = _mm512_loadu_si512(r);
                        if (l + 1 < L) b = _mm512_loadu_si512(r + D);
                    }
                    _mm512_store_si512(vb + j * 16, _mm512_unpacklo_epi16(a, b));
                    _mm512_store_si512(vb + 256 + j * 16, _mm512_unpackhi_epi16(a, b));
                }
                _tile_loadd(2, pa + (l0 / 32) * 256, 64);
                _tile_loadd(3, vb, 64);
                _tile_loadd(4, vb + 256, 64);
                _tile_dpbf16ps(0, 2, 3);
                _tile_dpbf16ps(1, 2, 4);
            }
            _tile_stored(0, cb, 64);
            _tile_stored(1, cb + 256, 64);
            for (int64_t n = 0; n < (qb2 ? 8 + nh : nh); n++) {
                if (qb2 && n % 8 >= nh) continue;
                __m512 lo = _mm512_load_ps(cb + n * 16), hi = _mm512_load_ps(cb + 256 + n * 16);
                float *o = (qb2 && n >= 8 ? ob2 + (n - 8) * ldo_n : ob + (n0 + n) * ldo_n) + c0;
                _mm512_storeu_ps(o, _mm512_permutex2var_ps(lo, first, hi));
                _mm512_storeu_ps(o + 16, _mm512_permutex2var_ps(lo, second, hi));
            }
        }
    }
    _tile_release();
    return 1;
}

#else

int mla_seq_tiles(const float *qb, const float *qb2, int64_t ldq_n, const uint16_t *cache, int64_t bs, int64_t D,
                  const int64_t *table, int64_t L1, int64_t L2, float *ob, float *ob2, int64_t ldo_n, int64_t N,
                  int64_t C, float scale) {
    (void)qb, (void)qb2, (void)ldq_n, (void)cache, (void)bs, (void)D, (void)table, (void)L1, (void)L2, (void)ob;
    (void)ob2, (void)ldo_n, (void)N, (void)C, (void)scale;
    return 0;
}

#endif
