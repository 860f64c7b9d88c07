/* Shared by the CPU kernels of kernels/csrc (C, compiled as C++ together with torch_ops.cpp, the torch-op
 * shim, into one library by kernels/cpu_build.py): AVX2 helpers for bf16 values (the top half of a float32)
 * and FP8 e4m3fn values, the weight descriptor and the linear they all call. */
#ifndef MOE_BF16W_H
#define MOE_BF16W_H

#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

/* The kernels' parallel loops (pool.cpp): pool_run calls fn(ctx, i, slot) for every i < n on up to `threads`
 * threads, the caller's among them, and returns when all are done. slot < threads tells a thread's items apart
 * (per-thread areas of the caller's buffers); it is 0 where the items run on the caller alone: with one
 * thread, one item, or inside another loop's item. */
typedef void (*pool_fn)(void *ctx, int64_t i, int slot);
void pool_run(pool_fn fn, void *ctx, int64_t n, int threads);
extern __thread int pool_in_item;

/* Threads for a parallel loop: 1 inside a loop's item; else set_kernel_threads' count where set, else the OpenMP
 * runtime's setting (torch.set_num_threads), 1 where built without OpenMP. While torch's own ops run on one
 * thread (kernels/cpu_build.py kernel_threads), the kernels keep the cores to themselves: two teams of spinning
 * threads on the same cores would take turns on them. */
extern int pool_threads_set;
int64_t set_kernel_threads(int64_t threads);  /* threads < 0: only read it; returns the former setting */

static inline int threads_for_region(void) {
    if (pool_in_item) return 1;
    if (pool_threads_set > 0) return pool_threads_set;
#ifdef _OPENMP
    return omp_get_max_threads();
#else
    return 1;
#endif
}

/* f(i, slot) for i < n on up to `threads` threads */
template <class F>
static inline void parallel_for(int64_t n, int threads, F &&f) {
    if (threads <= 1 || n <= 1) {
        for (int64_t i = 0; i < n; i++) f(i, 0);
        return;
    }
    pool_run([](void *ctx, int64_t i, int slot) { (*(F *)ctx)(i, slot); }, (void *)&f, n, threads);
}

/* f(t0, t1) over rows [0, T) in runs of consecutive rows, several runs a thread, so that a thread that is
 * preempted holds the others up by one run, not by its whole share */
template <class F>
static inline void parallel_rows(int64_t T, int threads, F &&f) {
    int64_t runs = threads > 1 ? (T < 4 * (int64_t)threads ? T : 4 * (int64_t)threads) : 1;
    if (runs <= 1) {
        if (T > 0) f((int64_t)0, T);
        return;
    }
    parallel_for(runs, threads, [&](int64_t r, int) { f(T * r / runs, T * (r + 1) / runs); });
}

#define PARALLEL_MIN_WEIGHTS (1 << 16)  /* smaller weights take one thread: a fork costs about a microsecond */
#define PARALLEL_MIN_VALUES (1 << 15)   /* row-wise ops (norms, rotary, adds) over fewer values take one thread */

/* Per-thread scratch memory of at least `bytes`, kept between calls (one buffer per file, thread and `which` < 2:
 * thread_scratch_at(1, ...) for a second buffer that a caller needs while it holds the first). */
static __thread void *scratch_ptr[2];
static __thread size_t scratch_size[2];

static inline void *thread_scratch_at(int which, size_t bytes) {  /* NULL when out of memory */
    if (bytes > scratch_size[which]) {
        free(scratch_ptr[which]);
        scratch_ptr[which] = aligned_alloc(64, (bytes + 63) / 64 * 64);
        scratch_size[which] = scratch_ptr[which] ? bytes : 0;
    }
    return scratch_ptr[which];
}

static inline void *thread_scratch(size_t bytes) { return thread_scratch_at(0, bytes); }

static inline __m256 load_bf16x8(const uint16_t *p) {
    __m128i h = _mm_loadu_si128((const __m128i *)p);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

#ifdef __AVX512F__
/* 16 bf16 values widened to float32 (the AVX-512 build: kernels/cpu_build.py builds it where the CPU has
 * AVX-512 F/BW/VL) */
static inline __m512 load_bf16x16(const uint16_t *p) {
    __m256i h = _mm256_loadu_si256((const __m256i *)p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* 16 FP8 e4m3fn values widened to float32, times 2^-8 (load_fp8x8's conversion, below, 16 lanes wide);
 * load_fp8x8_of16: 8 values in lanes 0-7, zeros in 8-15 */
static inline __m512 fp8_bits_to_ps16(__m256i b) {  /* b: 16 bytes sign-extended to 16 bits */
    return _mm512_cvtph_ps(_mm256_and_si256(_mm256_slli_epi16(b, 7), _mm256_set1_epi16((short)0xbfff)));
}

static inline __m512 load_fp8x16(const uint8_t *p) {
    return fp8_bits_to_ps16(_mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)p)));
}

static inline __m512 load_fp8x8_of16(const uint8_t *p) {
    return fp8_bits_to_ps16(_mm256_cvtepi8_epi16(_mm_loadl_epi64((const __m128i *)p)));
}

/* lane i = the sum of v[i]'s 16 lanes: pairs of vectors folded by 256, 128, 64 and 32 bits, then the 4 x 4
 * order of the result transposed */
static inline __m512 sum16x16(const __m512 *v) {
    __m512 w[8], u[4], s[2];
    for (int i = 0; i < 8; i++)  /* quarters 0-1: v[2i]'s, 2-3: v[2i+1]'s */
        w[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44),
                             _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xee));
    for (int i = 0; i < 4; i++)  /* quarter k: v[4i + k]'s */
        u[i] = _mm512_add_ps(_mm512_shuffle_f32x4(w[2 * i], w[2 * i + 1], 0x88),
                             _mm512_shuffle_f32x4(w[2 * i], w[2 * i + 1], 0xdd));
    for (int i = 0; i < 2; i++)  /* quarter k, lanes 0-1: v[8i + k]'s, lanes 2-3: v[8i + 4 + k]'s */
        s[i] = _mm512_add_ps(_mm512_shuffle_ps(u[2 * i], u[2 * i + 1], 0x44),
                             _mm512_shuffle_ps(u[2 * i], u[2 * i + 1], 0xee));
    __m512 r = _mm512_add_ps(_mm512_shuffle_ps(s[0], s[1], 0x88), _mm512_shuffle_ps(s[0], s[1], 0xdd));
    /* lane 4k + j of r is v[4j + k]'s sum */
    return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), r);
}
#endif

/* One vector of float32 lanes, the widest the build has: 16 in the AVX-512 build, 8 with AVX2. */
#ifdef __AVX512F__
#define WLANES 16
typedef __m512 wvec;
#define WLOAD _mm512_loadu_ps
#define WSTORE _mm512_storeu_ps
#define WLOADW load_bf16x16
#define WSET1 _mm512_set1_ps
#define WZERO _mm512_setzero_ps
#define WFMA _mm512_fmadd_ps
#else
#define WLANES 8
typedef __m256 wvec;
#define WLOAD _mm256_loadu_ps
#define WSTORE _mm256_storeu_ps
#define WLOADW load_bf16x8
#define WSET1 _mm256_set1_ps
#define WZERO _mm256_setzero_ps
#define WFMA _mm256_fmadd_ps
#endif

static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* lane i = the sum of v[i]'s 8 lanes: pairs added within each half (hadd), then the halves of 4 vectors each */
static inline __m256 sum8x8(const __m256 *v) {
    __m256 s0 = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
    __m256 s1 = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
    /* s0: v[0..3]'s sums of lanes 0-3, then of lanes 4-7; s1 the same for v[4..7] */
    return _mm256_add_ps(_mm256_permute2f128_ps(s0, s1, 0x20), _mm256_permute2f128_ps(s0, s1, 0x31));
}

/* y[j] <- the sum of v[j]'s lanes for j < n (n <= WLANES): all WLANES at once, in one transposed sum, where n is that
 * many (the decode products' outputs, linear_bf16w.cpp and linear_fp8w.cpp) */
static inline void store_sums(float *y, const wvec *v, int n) {
#ifdef __AVX512F__
    if (n == WLANES)
        _mm512_storeu_ps(y, sum16x16(v));
    else
        for (int j = 0; j < n; j++) y[j] = _mm512_reduce_add_ps(v[j]);
#else
    if (n == WLANES)
        _mm256_storeu_ps(y, sum8x8(v));
    else
        for (int j = 0; j < n; j++) y[j] = hsum8(v[j]);
#endif
}

static inline uint16_t f32_to_bf16(float f) {  /* nearest, ties to even: what torch's .to(torch.bfloat16) gives */
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    uint16_t upper = (uint16_t)(bits >> 16);
    uint32_t dropped = bits & 0xffffu;
    if ((upper & 0x7f80u) == 0x7f80u && (bits & 0x007fffffu)) return upper | 0x0040u;  /* a NaN stays a quiet NaN */
    if (dropped > 0x8000u || (dropped == 0x8000u && (upper & 1u))) upper++;  /* a carry may reach the exponent */
    return upper;
}

static inline float bf16_to_f32(uint16_t h) {
    union { uint32_t u; float f; } v;
    v.u = (uint32_t)h << 16;
    return v.f;
}

/* FP8 e4m3fn (sign, 4 exponent bits of bias 7, 3 mantissa bits) to float32 through the fp16 conversion of
 * F16C: the byte's bits moved into an fp16 (sign to bit 15, exponent and mantissa to bits 13..7) are the
 * same value times 2^-8 (exponent bias 15 instead of 7), subnormals included; exact. The NaN bytes 0x7f and
 * 0xff give +-480 instead (checkpoints hold no NaN weights). load_fp8x8: 8 bytes, values times 2^-8. */
static inline __m256 load_fp8x8(const uint8_t *p) {
    __m128i b = _mm_cvtepi8_epi16(_mm_loadl_epi64((const __m128i *)p));  /* sign copied into bits 15..8 */
    return _mm256_cvtph_ps(_mm_and_si128(_mm_slli_epi16(b, 7), _mm_set1_epi16((short)0xbfff)));
}

static inline float fp8_to_f32(uint8_t b) {
    return _cvtsh_ss((unsigned short)(((b & 0x80) << 8) | ((b & 0x7f) << 7))) * 256.0f;
}

/* A weight [O, K] (or a batch of them: heads, experts) with unit stride in K: bf16 bits, or FP8 e4m3fn bytes
 * with float32 block scales where `scale` is set (DeepSeek-V3's weight_scale_inv: the weight is
 * fp8 * scale[o / bo, k / bk], bo and bk multiples of 8). */
typedef struct {
    const void *data;
    int64_t ld, bsd;         /* elements between rows; between batch entries */
    const float *scale;      /* NULL: bf16 */
    int64_t lds, ldsk, bss;  /* scale strides: between block rows, block columns, batch entries */
    int64_t bo, bk;
} Weight;

static inline Weight weight_at(Weight w, int64_t b) {  /* batch entry b */
    w.data = (const char *)w.data + b * w.bsd * (w.scale ? 1 : 2);
    if (w.scale) w.scale += b * w.bss;
    return w;
}

static inline Weight bf16_weight(const uint16_t *w, int64_t ld, int64_t bsd) {
    Weight r = {w, ld, bsd, NULL, 0, 0, 0, 0, 0};
    return r;
}

/* exp(x) for x <= 0 (softmax after subtracting the max): 2^n * p(r), r = x - n ln2 in [-ln2/2, ln2/2],
 * a degree-6 polynomial; relative error about 2e-7. Values below -87 give 0. */
static inline __m256 exp_neg(__m256 x) {
    const __m256 lo = _mm256_set1_ps(-87.0f);
    __m256 under = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
    x = _mm256_max_ps(x, lo);
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(_mm256_mul_ps(p, r), r, _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_andnot_ps(under, _mm256_mul_ps(p, _mm256_castsi256_ps(e)));
}

/* A softmax down the rows of 8 columns (attention heads in the lanes): the scores s[l * lds + j], l < L, j < 8,
 * times `scale` (multiplied here, then the column's max taken off, as torch rounds `(s * scale).softmax()`)
 * become their exponentials; returns 1 / the column sums. */
static inline __m256 softmax_lanes8(float *s, int64_t lds, int64_t L, float scale) {
    const __m256 vscale = _mm256_set1_ps(scale);
    __m256 mx = _mm256_loadu_ps(s);
    for (int64_t l = 1; l < L; l++) mx = _mm256_max_ps(mx, _mm256_loadu_ps(s + l * lds));
    mx = _mm256_mul_ps(mx, vscale);
    __m256 total = _mm256_setzero_ps();
    for (int64_t l = 0; l < L; l++) {
        __m256 e = exp_neg(_mm256_sub_ps(_mm256_mul_ps(_mm256_loadu_ps(s + l * lds), vscale), mx));
        _mm256_storeu_ps(s + l * lds, e);
        total = _mm256_add_ps(total, e);
    }
    return _mm256_div_ps(_mm256_set1_ps(1.0f), total);
}

/* y[m, o] = sum_k x[m, k] w[o, k]: x float32 [M, K] (row stride ldx), w [O, K], y float32 [M, O] (row stride
 * ldy). linear_bf16w.cpp; large weights are split over the threads. linear_bf16w: the same for a bf16 w
 * (row stride ldw). */
void linear_w(const float *x, int64_t ldx, const Weight *w, float *y, int64_t ldy, int64_t M, int64_t K, int64_t O);
void linear_bf16w(const float *x, int64_t ldx, const uint16_t *w, int64_t ldw, float *y, int64_t ldy,
                  int64_t M, int64_t K, int64_t O);
/* linear_w on AMX tiles (linear_amx.cpp) for a bf16 w of at least set_tile_rows(n) rows (0: off, and always off
 * outside the AMX build); returns 0, computing nothing, where it does not apply. set_tile_rows returns the rows
 * now in effect (0 where the build or the OS gives no tiles); rows < 0 only reads them. */
int linear_tiles(const float *x, int64_t ldx, const Weight *w, float *y, int64_t ldy, int64_t M, int64_t K, int64_t O);
int64_t set_tile_rows(int64_t rows);
/* linear_tiles from min_rows rows (0: never; linear_tiles is it with set_tile_rows'; linear_amx.cpp or
 * linear_dpbf16.cpp); expert_tile_rows: the rows from which a routed expert's products take the tiles (at most
 * set_tile_rows', 0 where the tiles are off) */
int linear_tiles_min(const float *x, int64_t ldx, const Weight *w, float *y, int64_t ldy, int64_t M, int64_t K,
                     int64_t O, int64_t min_rows);
int64_t expert_tile_rows(void);
/* Whether products by FP8 weights take the bf16 dot products as well (from the same rows; only the AVX512-BF16
 * build can: linear_dpbf16.cpp), after setting it where on >= 0; off until set. The CPU backend sets it for a
 * model served in bf16 (kernels/backend_cpu.py), not for one served in float32, whose FP8 products stay float32. */
int64_t set_fp8_tiles(int64_t on);
/* Rows o0 .. o0 + O of an FP8 weight against MB <= 8 rows of x, into y[:, 0..O) (linear_fp8w.cpp). */
void fp8w_block(int64_t MB, const float *x, int64_t ldx, const Weight *w, int64_t o0, float *y, int64_t ldy,
                int64_t K, int64_t O);
/* fp8w_block on the bf16 dot products where set_fp8_tiles is on (x rounded to bf16; K and bk multiples of 32);
 * returns 0, computing nothing, where it does not apply (linear_dpbf16.cpp; elsewhere never) */
int fp8_decode_dp(int64_t MB, const float *x, int64_t ldx, const Weight *w, int64_t o0, float *y, int64_t ldy,
                  int64_t K, int64_t O);

/* The other kernels, each documented where it is defined (cpu_ops.cpp, linear_bf16w.cpp, mla_decode_bf16.cpp,
 * moe_bf16w.cpp, prompt_attention.cpp, decode_layer.cpp); declared here so that decode_layer.cpp and
 * torch_ops.cpp call them and the
 * compiler checks every definition. */
void rms_norm_f32(const float *x, int64_t ldx, const float *w, float *y, int64_t ldy, int64_t T, int64_t D, float eps);
void rope_f32(const float *x, int64_t ldx_t, int64_t ldx_n, const float *cos_, const float *sin_, float *y,
              int64_t ldy_t, int64_t ldy_n, int64_t T, int64_t N, int64_t R, int64_t interleaved);
void route_noaux_tc_f32(const float *x, int64_t ldx, const float *gate, int64_t H, const float *bias, int64_t T,
                        int64_t E, int64_t G, int64_t topk_group, int64_t K, int64_t norm, float scale, int64_t *ids,
                        float *wts);
void mla_cache_write_bf16(const float *kv, int64_t ldkv, const float *norm_w, float eps, const float *cos_,
                          const float *sin_, int64_t interleaved, uint16_t *cache, const int64_t *slots, int64_t T,
                          int64_t C, int64_t R);
void causal_softmax_f32(float *s, int64_t lds, int64_t R, int64_t P, int64_t per, int64_t seen0);
void values_t_bf16(const float *v, int64_t ldv_n, int64_t ldv_l, int64_t N, int64_t L, int64_t V, uint16_t *out,
                   int64_t Vp, int64_t Lp);
void linear_w_batched(const float *x, int64_t ldx, int64_t bsx, const Weight *w, float *y, int64_t ldy, int64_t bsy,
                      int64_t M, int64_t K, int64_t O, int64_t batch);
int64_t mla_decode_bf16(const float *q, int64_t ldq_b, int64_t ldq_n, const uint16_t *cache, int64_t bs, int64_t D,
                        const int64_t *tables, int64_t ld_t, const int64_t *lens, float *out, int64_t ldo_b,
                        int64_t ldo_n, int64_t B, int64_t N, int64_t C, float scale, const int64_t *qrows);
/* One sequence of mla_decode_bf16 on AMX tiles (mla_decode_amx.cpp), or two queries of one context in one pass
 * (qb2 not NULL, N <= 8; table covers the longer of L1, L2): 1 when it ran, 0 where it does not apply, -1 when out
 * of scratch memory. */
int mla_seq_tiles(const float *qb, const float *qb2, int64_t ldq_n, const uint16_t *cache, int64_t bs, int64_t D,
                  const int64_t *table, int64_t L1, int64_t L2, float *ob, float *ob2, int64_t ldo_n, int64_t N,
                  int64_t C, float scale);
int64_t moe_w(const float *x, int64_t ldx, int64_t T, int64_t H, const Weight *w13, const Weight *w2, int64_t E,
              int64_t I, const int64_t *ids, const float *wts, int64_t K, float *out, const Weight *sw13, int64_t Is,
              const Weight *sw2);

/* One decoder layer's weights for decode_layer_f32 (decode_layer.cpp, which documents the sizes). Linears
 * [out, in], bf16 or FP8 with scales; norms and the router's gate float32. */
typedef struct {
    int64_t H, Qr, N, Dn, R, Dv, C, interleaved;
    float eps_in, eps_q, eps_kv, eps_post, softmax_scale, routed_scale;
    const float *in_norm, *q_a_norm, *kv_a_norm, *post_norm;
    Weight q_a, q_b;   /* q_a [Qr, H], q_b [N (Dn + R), Qr]; with Qr = 0, q_b is q_proj [N (Dn + R), H] */
    Weight kv_a;       /* [C + R, H] */
    Weight w_uk;       /* [N, C, Dn] */
    Weight w_uv;       /* [N, Dv, C] */
    Weight o;          /* [H, N Dv] */
    int64_t E, G, topk_group, K, norm_topk;
    const float *router, *router_bias; /* [E, H], [E] (may be NULL) */
    int64_t Ie, Is;
    Weight w13, w2;    /* [E, 2 Ie, H], [E, H, Ie] */
    Weight sw13, sw2;  /* [2 Is, H], [H, Is]; data NULL: none (E > 0) */
} DecodeLayer;

int64_t decode_layer_f32(const DecodeLayer *w, float *x, int64_t T, const float *cos_, const float *sin_,
                         uint16_t *cache, int64_t bs, const int64_t *slots, const int64_t *rows, const int64_t *tables,
                         int64_t ld_t, const int64_t *lens, int64_t *ids);

#endif
