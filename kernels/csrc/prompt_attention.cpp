/* The float32 steps of a prompt chunk's attention between its two bf16 products (kernels/cpu_attention.py,
 * whose `reference` is their oracle too): the causal softmax of the scores, and the values laid out as the
 * second product takes them. In torch these were a masked_fill, a softmax over every key, and a strided
 * copy: ~12% of a 256-token prompt step.
 */
#include <math.h>

#include "bf16w.h"

/* In place, on s [R, P] float32 (row stride lds): row r sees its first min(P, seen0 + r % per) keys (a block of
 * `per` queries of one head, the first seeing seen0 keys: causal); those become their softmax, the others 0. */
void causal_softmax_f32(float *s, int64_t lds, int64_t R, int64_t P, int64_t per, int64_t seen0) {
    parallel_rows(R, R * P >= (1 << 15) ? threads_for_region() : 1, [&](int64_t r1, int64_t r2) {
        for (int64_t r = r1; r < r2; r++) {
            float *row = s + r * lds;
            int64_t n = seen0 + r % per < P ? seen0 + r % per : P, l = 0;
            __m256 vmx = _mm256_set1_ps(-INFINITY);
            for (; l + 8 <= n; l += 8) vmx = _mm256_max_ps(vmx, _mm256_loadu_ps(row + l));
            float mx = -INFINITY;
            for (int i = 0; i < 8; i++) mx = vmx[i] > mx ? vmx[i] : mx;
            for (; l < n; l++) mx = row[l] > mx ? row[l] : mx;
            __m256 sum8 = _mm256_setzero_ps();
            vmx = _mm256_set1_ps(mx);
            for (l = 0; l + 8 <= n; l += 8) {
                __m256 e = exp_neg(_mm256_sub_ps(_mm256_loadu_ps(row + l), vmx));
                _mm256_storeu_ps(row + l, e);
                sum8 = _mm256_add_ps(sum8, e);
            }
            float sum = hsum8(sum8);
            if (l < n) {  /* the tail through one padded vector: -100 below the max gives 0 */
                alignas(32) float tail[8];
                for (int i = 0; i < 8; i++) tail[i] = l + i < n ? row[l + i] - mx : -100.0f;
                _mm256_store_ps(tail, exp_neg(_mm256_load_ps(tail)));
                for (int i = 0; l + i < n; i++) { row[l + i] = tail[i]; sum += tail[i]; }
            }
            __m256 inv = _mm256_set1_ps(1.0f / sum);
            for (l = 0; l + 8 <= n; l += 8) _mm256_storeu_ps(row + l, _mm256_mul_ps(_mm256_loadu_ps(row + l), inv));
            for (; l < n; l++) row[l] *= 1.0f / sum;
            for (; l < P; l++) row[l] = 0.0f;
        }
    });
}

/* r[j] <- lane j of r[0..8): an 8 x 8 transpose */
static inline void transpose8(__m256 *r) {
    __m256 t[8], u[8];
    for (int i = 0; i < 8; i += 2) {
        t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
    }
    for (int i = 0; i < 8; i += 4) {
        u[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);
        u[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xee);
        u[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
        u[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xee);
    }
    for (int i = 0; i < 4; i++) {
        r[i] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x20);
        r[i + 4] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x31);
    }
}

/* 8 float32 to bf16, to nearest, ties to even (finite values, as f32_to_bf16) */
static inline __m128i bf16x8(__m256 x) {
    __m256i u = _mm256_castps_si256(x);
    __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    u = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7fff))), 16);
    u = _mm256_permute4x64_epi64(_mm256_packus_epi32(u, u), 0x08);  /* lanes 0-3 of each half, side by side */
    return _mm256_castsi256_si128(u);
}

/* out[n, c, l] = bf16(v[n, l, c]) for c < V, l < L, zeros up to Vp and Lp (a multiple of 8): v [N, L, V]
 * float32 (strides ldv_n, ldv_l, unit in c), out [N, Vp, Lp] bf16 contiguous. Blocks of 8 keys by 8 dims are
 * transposed in registers. */
void values_t_bf16(const float *v, int64_t ldv_n, int64_t ldv_l, int64_t N, int64_t L, int64_t V, uint16_t *out,
                   int64_t Vp, int64_t Lp) {
    parallel_for(N, N * L * V >= (1 << 15) ? threads_for_region() : 1, [&](int64_t n, int) {
        uint16_t *o = out + n * Vp * Lp;
        for (int64_t c = V; c < Vp; c++) memset(o + c * Lp, 0, (size_t)Lp * sizeof(uint16_t));
        for (int64_t l0 = 0; l0 < Lp; l0 += 32) {  /* 32 keys: a whole cache line of each output row */
            int64_t m = L - l0 < 32 ? (L - l0 > 0 ? L - l0 : 0) : 32, keys = Lp - l0 < 32 ? Lp - l0 : 32, c = 0;
            const float *rows = v + n * ldv_n + l0 * ldv_l;
            for (; c + 8 <= V; c += 8)
                for (int64_t k0 = 0; k0 < keys; k0 += 8) {
                    __m256 r[8];
                    for (int64_t i = 0; i < 8; i++)
                        r[i] = k0 + i < m ? _mm256_loadu_ps(rows + (k0 + i) * ldv_l + c) : _mm256_setzero_ps();
                    transpose8(r);
                    for (int64_t j = 0; j < 8; j++)
                        _mm_storeu_si128((__m128i *)(o + (c + j) * Lp + l0 + k0), bf16x8(r[j]));
                }
            for (; c < V; c++)
                for (int64_t i = 0; i < keys; i++) o[c * Lp + l0 + i] = i < m ? f32_to_bf16(rows[i * ldv_l + c]) : 0;
        }
    });
}
