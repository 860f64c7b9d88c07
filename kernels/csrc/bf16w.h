/* Shared by the CPU kernels of kernels/csrc (built together into one library by kernels/cpu_build.py):
 * AVX2 helpers for bf16 values (the top half of a float32) and the bf16-weight linear they all call. */
#ifndef MOE_BF16W_H
#define MOE_BF16W_H

#include <immintrin.h>
#include <stdint.h>

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

/* y[m, o] = sum_k x[m, k] w[o, k]: x float32 [M, K] (row stride ldx), w bf16 [O, K] (row stride ldw),
 * y float32 [M, O] (row stride ldy). linear_bf16w.c. */
void linear_bf16w(const float *x, int64_t ldx, const uint16_t *w, int64_t ldw, float *y, int64_t ldy,
                  int64_t M, int64_t K, int64_t O);

#endif
