/* y = x w^T for float32 x and a bf16 w on AMX tiles (Intel's Advanced Matrix Extensions, Sapphire Rapids and
 * later): the x rows are rounded to bf16 (to nearest even, as torch's .bfloat16()), products of bf16 pairs are
 * summed in float32, y is float32. Only in the AMX build (kernels/cpu_build.py builds it where the CPU has
 * amx_tile, amx_bf16 and avx512_bf16) and only for products of at least `tile_rows` rows (set_tile_rows): the
 * prompt-sized GEMMs, where the float32 kernels of linear_bf16w.cpp are bound by arithmetic and a tile
 * multiply does 16 x 16 x 32 multiply-adds in one instruction. The reference is
 * F.linear(x.bfloat16().float(), w.float()) (kernels/cpu_bf16w.py), which this equals up to the order of
 * float32 sums.
 *
 * The weight stays as loaded ([O, K], unit stride in K): a tile of 16 of its rows and 32 of its columns is the A
 * operand as it lies in memory. x is the B operand, which the instruction takes in pairs along K: packed once per
 * call, by all the threads, into blocks of 16 x rows of 32-bit (bf16, bf16) pairs (pack_x, pack_bf16.h: one B tile a
 * contiguous KiB), M rounded up to 16 (rows of zeros). A tile of C then holds y transposed (16 weight rows by 16 x
 * rows), transposed the same way into y. The x rows go in passes whose packed pairs stay in L2; in each, a thread
 * takes 32 weight rows at a time against all the pass's rows (two A tiles, two B tiles, four C tiles). With at
 * most STREAM_ROWS x rows (decode batches, an expert's rows) each weight byte is used once, read from memory:
 * a thread takes a run of weight rows and fetches the next 32 rows into L2 while it multiplies these, which the
 * hardware prefetcher does not do for 32 short strided runs (decode at 32 running 5-8% faster,
 * docs/benchmarks.md); with its run done it takes rows from the others' runs. Shapes the tiles do not cover (O
 * not a multiple of 16, K not one of 32, FP8 weights) return 0 and the float32 kernel runs.
 */
#include <string.h>

#include <atomic>

#include "bf16w.h"
#include "pack_bf16.h"

#if HAVE_AMX_BF16
#include <sys/syscall.h>
#include <unistd.h>

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

static int64_t tile_rows;  /* 0: off */
/* An expert's products take the tiles from this many rows (fewer than tile_rows where that is higher): on one
 * core, as the routed experts run, a product of 8-15 rows by a 512 x 512 or 512 x 256 weight is 1.2-1.7x faster
 * on the tiles (docs/benchmarks.md). Which rows an expert gets depends on the batch in any case. */
#define EXPERT_TILE_ROWS 8
/* Products of at most this many x rows (decode batches) stream their weight (see linear_tiles_min) */
#define STREAM_ROWS 64
#define MAX_STREAM_RUNS 64  /* runs of blocks at most (one a thread) */

/* c [16 weight rows][16 x rows] (a C tile) into y rows m0.. (< M), columns o0..o0 + 16 */
static inline void store_transposed(const float *c, float *y, int64_t ldy, int64_t m0, int64_t M, int64_t o0) {
    __m512i rows[16], cols[16];
    for (int i = 0; i < 16; i++) rows[i] = _mm512_load_si512(c + 16 * i);
    transpose16(rows, cols);
    for (int64_t j = 0; j < 16 && m0 + j < M; j++) _mm512_storeu_si512(y + (m0 + j) * ldy + o0, cols[j]);
}

/* weight rows o0 .. o0 + 16 * NA (NA = 1 or 2) against rows m1 .. m2 of xp (pack_x), into y. next (may be NULL):
 * the first of 32 weight rows this thread takes next, fetched into L2 alongside, column for column. */
template <int NA>
static void weight_rows(const uint16_t *w, int64_t ldw, const uint32_t *xp, int64_t m1, int64_t m2, int64_t M,
                        int64_t K, int64_t o0, float *y, int64_t ldy, const uint16_t *next) {
    alignas(64) float c[16 * 16];
    for (int64_t m0 = m1; m0 < m2; m0 += 32) {
        int two = m2 - m0 >= 32;
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t k = 0; k < K; k += 32) {
            if (next && m0 == m1)
                for (int i = 0; i < 32; i++) _mm_prefetch((const char *)(next + i * ldw + k), _MM_HINT_T1);
            _tile_loadd(4, w + o0 * ldw + k, ldw * 2);
            _tile_loadd(6, xp + m0 * (K / 2) + (k / 2) * 16, 64);
            _tile_dpbf16ps(0, 4, 6);
            if (two) {
                _tile_loadd(7, xp + (m0 + 16) * (K / 2) + (k / 2) * 16, 64);
                _tile_dpbf16ps(1, 4, 7);
            }
            if (NA == 2) {
                _tile_loadd(5, w + (o0 + 16) * ldw + k, ldw * 2);
                _tile_dpbf16ps(2, 5, 6);
                if (two) _tile_dpbf16ps(3, 5, 7);
            }
        }
        _tile_stored(0, c, 64);
        store_transposed(c, y, ldy, m0, M, o0);
        if (two) {
            _tile_stored(1, c, 64);
            store_transposed(c, y, ldy, m0 + 16, M, o0);
        }
        if (NA == 2) {
            _tile_stored(2, c, 64);
            store_transposed(c, y, ldy, m0, M, o0 + 16);
            if (two) {
                _tile_stored(3, c, 64);
                store_transposed(c, y, ldy, m0 + 16, M, o0 + 16);
            }
        }
    }
}

int64_t set_tile_rows(int64_t rows) {
    static int permitted = -1;  /* the kernel lets a process use the tiles' 8 KiB of state once it asks */
    if (permitted < 0) permitted = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
    if (rows >= 0) tile_rows = permitted && rows > 0 ? rows : 0;  /* rows < 0: only read it */
    return tile_rows;
}

int64_t expert_tile_rows(void) { return tile_rows > EXPERT_TILE_ROWS ? EXPERT_TILE_ROWS : tile_rows; }

int linear_tiles_min(const float *x, int64_t ldx, const Weight *w, float *y, int64_t ldy, int64_t M, int64_t K,
                     int64_t O, int64_t min_rows) {
    int64_t Mp;
    uint32_t *xp = packed_x_for(w, M, K, O, min_rows, &Mp, 0);
    if (!xp) return 0;
    const uint16_t *wd = (const uint16_t *)w->data;
    int64_t ldw = w->ld, blocks = (O + 31) / 32;
    /* x rows a pass over the weight takes: their packed pairs (2 K bytes a row) about 512 KiB, so that they stay
     * in L2 while every block of weight rows goes by (x of 2048 rows by 512 columns is 2 MiB packed) */
    int64_t pass = ((256 << 10) / K) & ~(int64_t)31;
    if (pass < 32) pass = 32;
    int nt = threads_for_region();
    int threads = O * K >= PARALLEL_MIN_WEIGHTS ? nt : 1;
    pack_x(x, ldx, M, Mp, K, xp, threads);
    if (Mp <= STREAM_ROWS) {
        /* few x rows: each weight row is used once and read from memory. Thread r starts on run r of the blocks
         * (contiguous runs, one a thread) and fetches the next block's rows while this one's multiply; with its
         * run done it takes blocks from the others' (one whose thread is preempted is finished by the rest). */
        int64_t runs = threads < blocks ? threads : blocks;
        if (runs > MAX_STREAM_RUNS) runs = MAX_STREAM_RUNS;
        std::atomic<int64_t> next[MAX_STREAM_RUNS];
        for (int64_t r = 0; r < runs; r++) next[r].store(blocks * r / runs, std::memory_order_relaxed);
        parallel_for(runs, threads, [&](int64_t r0, int) {
            tiles_on();
            for (int64_t k = 0; k < runs; k++) {
                int64_t r = (r0 + k) % runs, end = blocks * (r + 1) / runs;
                for (int64_t b; (b = next[r].fetch_add(1, std::memory_order_relaxed)) < end;) {
                    const uint16_t *next_w = b + 1 < end && O - 32 * (b + 1) >= 32 ? wd + 32 * (b + 1) * ldw : NULL;
                    if (O - 32 * b >= 32)
                        weight_rows<2>(wd, ldw, xp, 0, Mp, M, K, 32 * b, y, ldy, next_w);
                    else
                        weight_rows<1>(wd, ldw, xp, 0, Mp, M, K, 32 * b, y, ldy, NULL);
                }
            }
            _tile_release();
        });
    } else {
        /* an item is one block of weight rows against one pass's x rows, passes in order */
        int64_t passes = (Mp + pass - 1) / pass;
        parallel_for(passes * blocks, threads, [&](int64_t i, int) {
            int64_t b = i % blocks, m1 = i / blocks * pass, m2 = Mp - m1 < pass ? Mp : m1 + pass;
            tiles_on();
            if (O - 32 * b >= 32)
                weight_rows<2>(wd, ldw, xp, m1, m2, M, K, 32 * b, y, ldy, NULL);
            else
                weight_rows<1>(wd, ldw, xp, m1, m2, M, K, 32 * b, y, ldy, NULL);
            _tile_release();
        });
    }
    return 1;
}

#elif !defined(__AVX512BF16__)  /* the AVX512-BF16 build has them in linear_dpbf16.cpp */

int64_t set_tile_rows(int64_t rows) {
    (void)rows;
    return 0;
}

int64_t expert_tile_rows(void) { return 0; }

int linear_tiles_min(const float *x, int64_t ldx, const Weight *w, float *y, int64_t ldy, int64_t M, int64_t K,
                     int64_t O, int64_t min_rows) {
    (void)x, (void)ldx, (void)w, (void)y, (void)ldy, (void)M, (void)K, (void)O, (void)min_rows;
    return 0;
}

#endif

#if HAVE_AMX_BF16 || !defined(__AVX512BF16__) /* the AVX512-BF16 build has it in linear_dpbf16.cpp */
int64_t set_fp8_tiles(int64_t on) { /* FP8 weights stay on the float32 kernel: never on */
    (void)on;
    return 0;
}

int fp8_decode_dp(int64_t MB, const float *x, int64_t ldx, const Weight *w, int64_t o0, float *y, int64_t ldy,
                  int64_t K, int64_t O) {
    (void)MB, (void)x, (void)ldx, (void)w, (void)o0, (void)y, (void)ldy, (void)K, (void)O;
    return 0;
}
#endif
