/* Decode attention of MLA in the absorbed form over a paged bf16 latent cache, float32 queries and
 * arithmetic, on AVX2 + FMA (kernels/cpu_mla.py holds its torch reference).
 *
 * For each decode sequence b with context length L = lens[b] and each local head n:
 *   s[l]        = scale * q[b, n, :] . kv[l, :]            (all D = C + R cached dims, l < L)
 *   out[b, n, :] = sum_l softmax(s)[l] * kv[l, :C]          (the latent part of each cached row)
 * where kv[l] is row l % bs of cache block tables[b, l / bs]. Each cached row is read once for the scores
 * (against all N heads at a time) and once for the values, straight from the cache: no gather, no float32
 * copy of the context.
 *
 * Shapes: q [B, N, D] (strides ldq_b, ldq_n; unit stride within a row), cache [num_blocks, bs, D] bf16
 * contiguous, tables [B, >= ceil(L / bs)] int64 (row stride ld_t), lens [B] int64, out [B, N, C] (strides
 * ldo_b, ldo_n). With `qrows` (may be NULL), sequence b reads q row qrows[b] and writes out row qrows[b]
 * instead of row b: the decode rows of a step's token array, in place. Sequences are split over the
 * threads. Returns 0, or -1 when scratch memory could not be had.
 *
 * Where the bf16 products are on (the AVX512-BF16 or AMX build, set_tile_rows > 0) and D and C are multiples
 * of 32 (bs even), both products run on AVX512-BF16 dot products instead, as attention runs on a GPU: the
 * query rounded to bf16 (to nearest even) for the scores, the softmax in float32, the probabilities rounded to
 * bf16 for the values, sums in float32 (kernels/cpu_mla.py `reference(bf16_products=True)`). Twice the
 * multiply-adds an instruction, and no widening of the cached rows. In the AMX build, with a block size that
 * is a multiple of 16, the same products run on the tiles (mla_decode_amx.cpp), 16 heads a pass.
 */
#include "bf16w.h"
#include "pack_bf16.h"

/* s[0..L) <- exp(s - max) / sum, in place. */
static void softmax_inplace(float *s, int64_t L) {
    float mx = s[0];
    for (int64_t l = 1; l < L; l++) mx = s[l] > mx ? s[l] : mx;
    __m256 vmx = _mm256_set1_ps(mx), vsum = _mm256_setzero_ps();
    int64_t l = 0;
    for (; l + 8 <= L; l += 8) {
        __m256 e = exp_neg(_mm256_sub_ps(_mm256_loadu_ps(s + l), vmx));
        _mm256_storeu_ps(s + l, e);
        vsum = _mm256_add_ps(vsum, e);
    }
    float sum = hsum8(vsum);
    if (l < L) {
        float tail[8] = {0};
        for (int64_t i = l; i < L; i++) tail[i - l] = s[i] - mx;
        for (int64_t i = L - l; i < 8; i++) tail[i] = -100.0f;  /* exp gives 0 */
        _mm256_storeu_ps(tail, exp_neg(_mm256_loadu_ps(tail)));
        for (int64_t i = l; i < L; i++) { s[i] = tail[i - l]; sum += tail[i - l]; }
    }
    float inv = 1.0f / sum;
    for (int64_t i = 0; i < L; i++) s[i] *= inv;
}

/* How many heads' sums fit in the registers (wvec, bf16w.h): 8 in the AVX-512 build (32 registers), 4 with
 * AVX2 (16 registers). */
#ifdef __AVX512F__
#define WHEADS 8
#else
#define WHEADS 4
#endif

/* o[n, c0 .. c0 + WLANES NC) += sum over the rows r of p[n, r] * row_r[c0 ..), n < NH: the NH x NC sums stay in
 * registers over all the rows, so each o vector is loaded and stored once per cache block and a row's chunk
 * is widened once for NH heads */
template <int NH, int NC>
static void weighted_chunk(const float *p, int64_t ldp, const uint16_t *kv, int64_t D, int64_t rows, float *o,
                           int64_t ldo, int64_t c0) {
    wvec acc[NH][NC];
    for (int n = 0; n < NH; n++)
        for (int i = 0; i < NC; i++) acc[n][i] = WLOAD(o + n * ldo + c0 + WLANES * i);
    for (int64_t r = 0; r < rows; r++) {
        wvec w[NC];
        for (int i = 0; i < NC; i++) w[i] = WLOADW(kv + r * D + c0 + WLANES * i);
        for (int n = 0; n < NH; n++) {
            wvec pn = WSET1(p[n * ldp + r]);
            for (int i = 0; i < NC; i++) acc[n][i] = WFMA(pn, w[i], acc[n][i]);
        }
    }
    for (int n = 0; n < NH; n++)
        for (int i = 0; i < NC; i++) WSTORE(o + n * ldo + c0 + WLANES * i, acc[n][i]);
}

template <int NH>
static void weighted_heads(const float *p, int64_t ldp, const uint16_t *kv, int64_t D, int64_t rows, float *o,
                           int64_t ldo, int64_t C) {
    int64_t c = 0;
    for (; c + 3 * WLANES <= C; c += 3 * WLANES) weighted_chunk<NH, 3>(p, ldp, kv, D, rows, o, ldo, c);
    for (; c + WLANES <= C; c += WLANES) weighted_chunk<NH, 1>(p, ldp, kv, D, rows, o, ldo, c);
    for (; c < C; c++)
        for (int64_t n = 0; n < NH; n++)
            for (int64_t r = 0; r < rows; r++) o[n * ldo + c] += p[n * ldp + r] * bf16_to_f32(kv[r * D + c]);
}

typedef void (*heads_fn)(const float *, int64_t, const uint16_t *, int64_t, int64_t, float *, int64_t, int64_t);
#ifdef __AVX512F__
static const heads_fn HEADS[WHEADS + 1] = {0, weighted_heads<1>, weighted_heads<2>, weighted_heads<3>,
                                           weighted_heads<4>, weighted_heads<5>, weighted_heads<6>,
                                           weighted_heads<7>, weighted_heads<8>};
#else
static const heads_fn HEADS[WHEADS + 1] = {0, weighted_heads<1>, weighted_heads<2>, weighted_heads<3>,
                                           weighted_heads<4>};
#endif

/* o[n, 0..C) += sum over the rows r of p[n, r] * row_r[0..C), for `rows` consecutive cached rows (stride D)
 * and N heads; p has row stride ldp, o row stride ldo. WHEADS heads at a time. */
static void weighted_rows(const float *p, int64_t ldp, const uint16_t *kv, int64_t D, int64_t rows,
                          float *o, int64_t ldo, int64_t N, int64_t C) {
    for (int64_t n0 = 0; n0 < N; n0 += WHEADS)
        HEADS[N - n0 < WHEADS ? N - n0 : WHEADS](p + n0 * ldp, ldp, kv, D, rows, o + n0 * ldo, ldo, C);
}

#ifdef __AVX512BF16__
#define DP_HEADS 8  /* heads a pass over the context serves: 16 score sums, or 16 x 16 value columns, in registers */

/* One sequence on the bf16 products, heads n0 .. n0 + nh (nh <= DP_HEADS). qh [DP_HEADS, D] bf16 (rows past nh
 * zero), s [Lp, DP_HEADS] and pp [Lp / 2, DP_HEADS] scratch (Lp = L rounded up to even), acc [DP_HEADS, C]. */
static void heads_dpbf16(const uint16_t *qh, const uint16_t *cache, int64_t bs, int64_t D, const int64_t *table,
                         int64_t L, float *s, uint32_t *pp, float *acc, int64_t C, float scale, float *ob,
                         int64_t ldo_n, int64_t nh) {
    const __m512 vscale = _mm512_set1_ps(scale);
    for (int64_t l = 0; l < L; l += 2) {  /* scores: two cached rows against the heads, 16 sums at a time */
        const uint16_t *k0 = cache + (table[l / bs] * bs + l % bs) * D;
        const uint16_t *k1 = l + 1 < L ? k0 + D : k0;  /* past the end: row l again, its sums unused */
        if (l + 2 * bs < L) {  /* the same rows two blocks on: blocks lie anywhere in the cache, where the
                                  hardware prefetcher does not follow, and a step reads the cache from memory */
            const char *n0 = (const char *)(cache + (table[l / bs + 2] * bs + l % bs) * D);
            for (int64_t i = 0; i < 2 * D * 2; i += 64) _mm_prefetch(n0 + i, _MM_HINT_T0);
        }
        __m512 sum[2 * DP_HEADS];
        for (int i = 0; i < 2 * DP_HEADS; i++) sum[i] = _mm512_setzero_ps();
        for (int64_t d = 0; d < D; d += 32) {
            __m512bh a = (__m512bh)_mm512_loadu_si512(k0 + d), b = (__m512bh)_mm512_loadu_si512(k1 + d);
            for (int n = 0; n < DP_HEADS; n++) {
                __m512bh qv = (__m512bh)_mm512_loadu_si512(qh + n * D + d);
                sum[n] = _mm512_dpbf16_ps(sum[n], a, qv);
                sum[DP_HEADS + n] = _mm512_dpbf16_ps(sum[DP_HEADS + n], b, qv);
            }
        }
        _mm512_storeu_ps(s + l * DP_HEADS, _mm512_mul_ps(sum16x16(sum), vscale));  /* rows l, l + 1 */
    }
    __m256 inv = softmax_lanes8(s, DP_HEADS, L, 1.0f);  /* over the context (the scores are scaled already) */
    for (int64_t l = 0; l < L; l += 2) {  /* (p[l], p[l + 1]) as bf16 pairs, per head */
        __m128i p0 = (__m128i)_mm256_cvtneps_pbh(_mm256_mul_ps(_mm256_loadu_ps(s + l * DP_HEADS), inv));
        __m128i p1 = _mm_setzero_si128();
        if (l + 1 < L) p1 = (__m128i)_mm256_cvtneps_pbh(_mm256_mul_ps(_mm256_loadu_ps(s + (l + 1) * DP_HEADS), inv));
        _mm_storeu_si128((__m128i *)(pp + (l / 2) * DP_HEADS), _mm_unpacklo_epi16(p0, p1));
        _mm_storeu_si128((__m128i *)(pp + (l / 2) * DP_HEADS + 4), _mm_unpackhi_epi16(p0, p1));
    }
    /* values: 32 latent columns at a time, rows in pairs (row l's and row l + 1's column c side by side, as
     * unpacklo / unpackhi leave them: lane 4q + j of lo holds column 8q + j, of hi 8q + 4 + j) */
    for (int64_t i = 0; i < DP_HEADS * C; i += 16) _mm512_storeu_ps(acc + i, _mm512_setzero_ps());
    const __m512i zero = _mm512_setzero_si512();
    for (int64_t l0 = 0; l0 < L; l0 += bs) {
        int64_t rows = L - l0 < bs ? L - l0 : bs;
        const uint16_t *blk = cache + table[l0 / bs] * bs * D;
        const uint32_t *pb = pp + (l0 / 2) * DP_HEADS;
        for (int64_t c0 = 0; c0 < C; c0 += 32) {
            __m512 lo[DP_HEADS], hi[DP_HEADS];
            for (int n = 0; n < DP_HEADS; n++) {
                lo[n] = _mm512_loadu_ps(acc + n * C + c0);
                hi[n] = _mm512_loadu_ps(acc + n * C + c0 + 16);
            }
            for (int64_t r = 0; r < rows; r += 2) {
                __m512i a = _mm512_loadu_si512(blk + r * D + c0);
                __m512i b = r + 1 < rows ? _mm512_loadu_si512(blk + (r + 1) * D + c0) : zero;
                __m512bh vlo = (__m512bh)_mm512_unpacklo_epi16(a, b), vhi = (__m512bh)_mm512_unpackhi_epi16(a, b);
                for (int n = 0; n < DP_HEADS; n++) {
                    __m512bh pn = (__m512bh)_mm512_set1_epi32((int)pb[(r / 2) * DP_HEADS + n]);
                    lo[n] = _mm512_dpbf16_ps(lo[n], vlo, pn);
                    hi[n] = _mm512_dpbf16_ps(hi[n], vhi, pn);
                }
            }
            for (int n = 0; n < DP_HEADS; n++) {
                _mm512_storeu_ps(acc + n * C + c0, lo[n]);
                _mm512_storeu_ps(acc + n * C + c0 + 16, hi[n]);
            }
        }
    }
    const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
    const __m512i second = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
    for (int64_t n = 0; n < nh; n++)
        for (int64_t c0 = 0; c0 < C; c0 += 32) {
            __m512 lo = _mm512_loadu_ps(acc + n * C + c0), hi = _mm512_loadu_ps(acc + n * C + c0 + 16);
            _mm512_storeu_ps(ob + n * ldo_n + c0, _mm512_permutex2var_ps(lo, first, hi));
            _mm512_storeu_ps(ob + n * ldo_n + c0 + 16, _mm512_permutex2var_ps(lo, second, hi));
        }
}

/* One sequence on the bf16 products (the shapes checked by the caller): q row qb, output row ob (L > 0).
 * Returns 0, or -1 when scratch memory could not be had. */
static int seq_dpbf16(const float *qb, int64_t ldq_n, const uint16_t *cache, int64_t bs, int64_t D,
                      const int64_t *table, int64_t L, float *ob, int64_t ldo_n, int64_t N, int64_t C, float scale) {
    int64_t Lp = L + (L & 1);
    size_t bytes = (size_t)DP_HEADS * (size_t)D * 2 + (size_t)Lp * DP_HEADS * 4 + (size_t)(Lp / 2) * DP_HEADS * 4
                   + (size_t)DP_HEADS * (size_t)C * 4;
    uint16_t *qh = (uint16_t *)thread_scratch(bytes);
    if (!qh) return -1;
    float *s = (float *)(qh + DP_HEADS * D), *acc = s + Lp * DP_HEADS;
    uint32_t *pp = (uint32_t *)(acc + DP_HEADS * C);
    for (int64_t n0 = 0; n0 < N; n0 += DP_HEADS) {
        int64_t nh = N - n0 < DP_HEADS ? N - n0 : DP_HEADS;
        for (int64_t n = 0; n < DP_HEADS; n++)
            for (int64_t d = 0; d < D; d += 16)
                _mm256_storeu_si256((__m256i *)(qh + n * D + d),
                                    n < nh ? (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(qb + (n0 + n) * ldq_n + d))
                                           : _mm256_setzero_si256());
        heads_dpbf16(qh, cache, bs, D, table, L, s, pp, acc, C, scale, ob + n0 * ldo_n, ldo_n, nh);
    }
    return 0;
}
#endif

/* One sequence in float32 (widened cached rows, multiply-adds): q row qb, output row ob (L > 0). Returns 0,
 * or -1 when scratch memory could not be had. */
static int seq_f32(const float *qb, int64_t ldq_n, const uint16_t *cache, int64_t bs, int64_t D,
                   const int64_t *table, int64_t L, float *ob, int64_t ldo_n, int64_t N, int64_t C, float scale) {
    float *scratch = (float *)thread_scratch((size_t)(N * L) * sizeof(float));
    if (!scratch) return -1;
    for (int64_t n = 0; n < N; n++)
        for (int64_t c = 0; c < C; c++) ob[n * ldo_n + c] = 0.0f;
    for (int64_t l0 = 0; l0 < L; l0 += bs) {  /* scores, one cache block at a time */
        int64_t rows = L - l0 < bs ? L - l0 : bs;
        linear_bf16w(qb, ldq_n, cache + table[l0 / bs] * bs * D, D, scratch + l0, L, N, D, rows);
    }
    for (int64_t n = 0; n < N; n++) {
        float *s = scratch + n * L;
        for (int64_t l = 0; l < L; l++) s[l] *= scale;
        softmax_inplace(s, L);
    }
    for (int64_t l0 = 0; l0 < L; l0 += bs) {  /* probabilities times the latent rows */
        int64_t rows = L - l0 < bs ? L - l0 : bs;
        weighted_rows(scratch + l0, L, cache + table[l0 / bs] * bs * D, D, rows, ob, ldo_n, N, C);
    }
    return 0;
}

/* Whether sequences b and c read the same cached rows over the shorter of their contexts (the query rows of one
 * prompt chunk: one block table, contexts one apart), so that one pass of the AMX tiles can take both. */
static int same_context(const int64_t *tables, int64_t ld_t, const int64_t *lens, int64_t bs, int64_t b, int64_t c) {
    int64_t L = lens[b] < lens[c] ? lens[b] : lens[c];
    return L > 0 && !memcmp(tables + b * ld_t, tables + c * ld_t, (size_t)((L + bs - 1) / bs) * sizeof(int64_t));
}

/* Sequence b alone: 0, or -1 when scratch memory could not be had */
static int one_seq(const float *q, int64_t ldq_b, int64_t ldq_n, const uint16_t *cache, int64_t bs, int64_t D,
                   const int64_t *tables, int64_t ld_t, const int64_t *lens, float *out, int64_t ldo_b, int64_t ldo_n,
                   int64_t b, int64_t N, int64_t C, float scale, const int64_t *qrows, bool dp) {
    int64_t row = qrows ? qrows[b] : b, L = lens[b];
    const float *qb = q + row * ldq_b;
    float *ob = out + row * ldo_b;
    const int64_t *table = tables + b * ld_t;
    if (L <= 0) {
        for (int64_t n = 0; n < N; n++)
            for (int64_t c = 0; c < C; c++) ob[n * ldo_n + c] = 0.0f;
        return 0;
    }
#ifdef __AVX512BF16__
    if (dp) {  /* on AMX tiles where they take it, else on the dot products */
        int tiles = mla_seq_tiles(qb, NULL, ldq_n, cache, bs, D, table, L, 0, ob, NULL, ldo_n, N, C, scale);
        if (tiles == 0) return seq_dpbf16(qb, ldq_n, cache, bs, D, table, L, ob, ldo_n, N, C, scale);
        return tiles < 0 ? -1 : 0;
    }
#else
    (void)dp;
#endif
    return seq_f32(qb, ldq_n, cache, bs, D, table, L, ob, ldo_n, N, C, scale);
}

int64_t mla_decode_bf16(const float *q, int64_t ldq_b, int64_t ldq_n, const uint16_t *cache, int64_t bs, int64_t D,
                     const int64_t *tables, int64_t ld_t, const int64_t *lens, float *out, int64_t ldo_b,
                     int64_t ldo_n, int64_t B, int64_t N, int64_t C, float scale, const int64_t *qrows) {
#ifdef __AVX512BF16__
    const bool dp = D % 32 == 0 && C % 32 == 0 && bs % 2 == 0 && set_tile_rows(-1) > 0;
#else
    const bool dp = false;
#endif
    /* Work units: a sequence, or, where the AMX tiles run with at most 8 heads (half a tile's columns), two
     * sequences of one context in one pass (unit = 2 b + 1; else 2 b) */
    const bool pairs = HAVE_AMX_BF16 && dp && N <= 8 && bs % 16 == 0 && B > 1;
    int64_t *units = pairs ? (int64_t *)malloc((size_t)B * sizeof(int64_t)) : NULL;
    int64_t U = 0;
    if (units)
        for (int64_t b = 0; b < B; b++) {
            int two = b + 1 < B && same_context(tables, ld_t, lens, bs, b, b + 1);
            units[U++] = 2 * b + two;
            b += two;
        }
    else
        U = B;
    int64_t failed = 0;
    parallel_for(U, threads_for_region(), [&](int64_t u, int) {
        int64_t b = units ? units[u] / 2 : u, c = b + 1;
        if (!units || units[u] % 2 == 0) {
            if (one_seq(q, ldq_b, ldq_n, cache, bs, D, tables, ld_t, lens, out, ldo_b, ldo_n, b, N, C, scale, qrows,
                        dp))
                __atomic_store_n(&failed, 1, __ATOMIC_RELAXED);  /* by any thread */
            return;
        }
        /* the pass reads the longer context's table (the same blocks as the shorter one's, as far as it goes) */
        const int64_t *table = tables + (lens[c] > lens[b] ? c : b) * ld_t;
        int64_t rb = qrows ? qrows[b] : b, rc = qrows ? qrows[c] : c;
        int tiles = mla_seq_tiles(q + rb * ldq_b, q + rc * ldq_b, ldq_n, cache, bs, D, table, lens[b], lens[c],
                                  out + rb * ldo_b, out + rc * ldo_b, ldo_n, N, C, scale);
        if (tiles < 0 || (tiles == 0 && (one_seq(q, ldq_b, ldq_n, cache, bs, D, tables, ld_t, lens, out, ldo_b, ldo_n,
                                                 b, N, C, scale, qrows, dp) ||
                                         one_seq(q, ldq_b, ldq_n, cache, bs, D, tables, ld_t, lens, out, ldo_b, ldo_n,
                                                 c, N, C, scale, qrows, dp))))
            __atomic_store_n(&failed, 1, __ATOMIC_RELAXED);  /* by any thread */
    });
    free(units);
    return failed ? -1 : 0;
}
