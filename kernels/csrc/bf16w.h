/* Shared by the CPU kernels of kernels/csrc (built together into one library by kernels/cpu_build.py):
 * AVX2 helpers for bf16 values (the top half of a float32) and the bf16-weight linear they all call. */
#ifndef MOE_BF16W_H
#define MOE_BF16W_H

#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#ifdef _OPENMP
#include <omp.h>
#endif

/* Threads for a parallel region: the OpenMP runtime's setting (torch.set_num_threads sets it; the library
 * shares torch's libgomp, so both use one pool), 1 inside a region or where built without OpenMP. */
static inline int threads_for_region(void) {
#ifdef _OPENMP
    return omp_in_parallel() ? 1 : omp_get_max_threads();
#else
    return 1;
#endif
}

static inline int thread_index(void) {
#ifdef _OPENMP
    return omp_get_thread_num();
#else
    return 0;
#endif
}

/* Per-thread scratch memory of at least `bytes`, kept between calls (one buffer per file and thread). */
static __thread void *scratch_ptr;
static __thread size_t scratch_size;

static inline void *thread_scratch(size_t bytes) {
    if (bytes > scratch_size) {
        free(scratch_ptr);
        scratch_ptr = aligned_alloc(64, (bytes + 63) / 64 * 64);
        scratch_size = scratch_ptr ? bytes : 0;
    }
    return scratch_ptr;
}

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

/* y[m, o] = sum_k x[m, k] w[o, k]: x float32 [M, K] (row stride ldx), w bf16 [O, K] (row stride ldw),
 * y float32 [M, O] (row stride ldy). linear_bf16w.c; large weights are split over the threads. */
void linear_bf16w(const float *x, int64_t ldx, const uint16_t *w, int64_t ldw, float *y, int64_t ldy,
                  int64_t M, int64_t K, int64_t O);

/* The other kernels, each documented where it is defined (cpu_ops.c, linear_bf16w.c, mla_decode_bf16.c,
 * moe_bf16w.c); declared here so that decode_layer.c calls them and the compiler checks every definition. */
void rms_norm_f32(const float *x, int64_t ldx, const float *w, float *y, int64_t ldy, int64_t T, int64_t D, float eps);
void rope_f32(const float *x, int64_t ldx_t, int64_t ldx_n, const float *cos_, const float *sin_, float *y,
              int64_t ldy_t, int64_t ldy_n, int64_t T, int64_t N, int64_t R, int64_t interleaved);
void route_noaux_tc_f32(const float *x, int64_t ldx, const float *gate, int64_t H, const float *bias, int64_t T,
                        int64_t E, int64_t G, int64_t topk_group, int64_t K, int64_t norm, float scale, int64_t *ids,
                        float *wts);
void mla_cache_write_bf16(const float *kv, int64_t ldkv, const float *norm_w, float eps, const float *cos_,
                          const float *sin_, int64_t interleaved, uint16_t *cache, const int64_t *slots, int64_t T,
                          int64_t C, int64_t R);
void linear_bf16w_batched(const float *x, int64_t ldx, int64_t bsx, const uint16_t *w, int64_t ldw, int64_t bsw,
                          float *y, int64_t ldy, int64_t bsy, int64_t M, int64_t K, int64_t O, int64_t batch);
int64_t mla_decode_bf16(const float *q, int64_t ldq_b, int64_t ldq_n, const uint16_t *cache, int64_t bs, int64_t D,
                        const int64_t *tables, int64_t ld_t, const int64_t *lens, float *out, int64_t ldo_b,
                        int64_t ldo_n, int64_t B, int64_t N, int64_t C, float scale, const int64_t *qrows);
int64_t moe_bf16w(const float *x, int64_t ldx, int64_t T, int64_t H, const uint16_t *w13, const uint16_t *w2,
                  int64_t E, int64_t I, const int64_t *ids, const float *wts, int64_t K, float *out,
                  const uint16_t *sw13, int64_t Is, const uint16_t *sw2);

#endif
