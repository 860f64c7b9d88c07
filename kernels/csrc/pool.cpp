/* The kernels' threads: a parallel loop whose caller never waits for a thread that has no work left.
 *
 * An OpenMP region ends at a barrier that every thread of the team must reach. On a machine whose cores are
 * shared with the server's front end and its clients, one of the team is often preempted; the others then wait
 * at the barrier for as long as it is off its core, even when they could have done its share (a parallel loop
 * with a dynamic schedule) and it has nothing left to do. Here the thread that calls a loop takes items itself
 * and returns as soon as every item is done, whoever did it: a worker that comes back late finds no item left
 * (or a newer loop) and costs nothing. What a preempted worker still holds up is the one item it is in.
 *
 * One loop runs at a time (the caller holds `busy`; a second caller, or a loop inside an item, runs its items
 * itself). A loop is published as a generation number in the high 32 bits of `ticket` and the next item in
 * its low 32 bits; a thread takes item i by moving the ticket from (g, i) to (g, i + 1), so a worker still
 * holding an older generation can never take an item of a newer loop. A loop's description lives in one of
 * SLOTS entries by generation: the entry a worker read is valid as long as its ticket's generation is.
 * Idle workers spin for SPIN_US (the gaps between a step's loops are microseconds), then sleep on a futex.
 */
#include <errno.h>
#include <linux/futex.h>
#include <pthread.h>
#include <sched.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <atomic>
#include <climits>

#include "bf16w.h"

__thread int pool_in_item;  /* 1 while this thread runs a loop's item */
int pool_threads_set;       /* set_kernel_threads: 0 follows the OpenMP runtime's setting */

namespace {

constexpr int SLOTS = 4;
constexpr int MAX_WORKERS = 255;
constexpr int64_t SPIN_US = 200;

struct Loop {
    std::atomic<pool_fn> fn;
    std::atomic<void *> ctx;
    std::atomic<int64_t> n;
    std::atomic<int> threads;
    alignas(64) std::atomic<int64_t> done;
};

Loop loops[SLOTS];
alignas(64) std::atomic<uint64_t> ticket{0};  /* generation << 32 | next item */
alignas(64) std::atomic<uint32_t> wake_word{0};  /* the generation's low 32 bits, for the futex */
alignas(64) std::atomic<int> sleepers{0};
std::atomic<int> workers{0};
std::atomic<int> busy{0};
pthread_mutex_t grow_lock = PTHREAD_MUTEX_INITIALIZER;
uint64_t generation = 0;  /* the caller's (under busy) */

int64_t now_us(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000 + ts.tv_nsec / 1000;
}

/* Takes and runs items of generation g while there are any (a newer generation ends it too) */
void take_items(uint32_t g, Loop &loop, pool_fn fn, void *ctx, int64_t n, int slot) {
    uint64_t cur = ticket.load(std::memory_order_acquire);
    pool_in_item = 1;
    while ((uint32_t)(cur >> 32) == g && (int64_t)(cur & 0xffffffffu) < n) {
        if (!ticket.compare_exchange_weak(cur, cur + 1, std::memory_order_acq_rel, std::memory_order_acquire))
            continue;
        fn(ctx, (int64_t)(cur & 0xffffffffu), slot);
        loop.done.fetch_add(1, std::memory_order_release);
        cur = ticket.load(std::memory_order_acquire);
    }
    pool_in_item = 0;
}

void *worker_main(void *arg) {
    int slot = (int)(intptr_t)arg;
    uint32_t seen = (uint32_t)(ticket.load(std::memory_order_acquire) >> 32);
    for (;;) {
        uint64_t cur = ticket.load(std::memory_order_acquire);
        if ((uint32_t)(cur >> 32) == seen) {
            int64_t until = now_us() + SPIN_US;
            for (int k = 1;; k++) {
                _mm_pause();
                cur = ticket.load(std::memory_order_acquire);
                if ((uint32_t)(cur >> 32) != seen) break;
                if ((k & 63) == 0) {  /* a thread that has work on this core (torch's, another process's) goes first */
                    if (now_us() > until) break;
                    sched_yield();
                }
            }
            if ((uint32_t)(cur >> 32) == seen) {  /* sleep until a new loop is published */
                sleepers.fetch_add(1);
                for (;;) {
                    uint32_t word = wake_word.load();
                    cur = ticket.load();
                    if ((uint32_t)(cur >> 32) != seen) break;
                    syscall(SYS_futex, (uint32_t *)&wake_word, FUTEX_WAIT_PRIVATE, word, NULL, NULL, 0);
                }
                sleepers.fetch_sub(1);
            }
        }
        uint32_t g = (uint32_t)(cur >> 32);
        seen = g;
        Loop &loop = loops[g % SLOTS];
        pool_fn fn = loop.fn.load(std::memory_order_relaxed);
        void *ctx = loop.ctx.load(std::memory_order_relaxed);
        int64_t n = loop.n.load(std::memory_order_relaxed);
        if (slot < loop.threads.load(std::memory_order_relaxed)) take_items(g, loop, fn, ctx, n, slot);
    }
    return NULL;
}

/* At least `count` workers (fewer where threads cannot be had: the caller then does more items itself) */
void ensure_workers(int count) {
    if (count > MAX_WORKERS) count = MAX_WORKERS;
    if (workers.load(std::memory_order_acquire) >= count) return;
    pthread_mutex_lock(&grow_lock);
    for (int w = workers.load(); w < count; w++) {
        pthread_t th;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        int failed = pthread_create(&th, &attr, worker_main, (void *)(intptr_t)(w + 1));
        pthread_attr_destroy(&attr);
        if (failed) break;
        workers.store(w + 1, std::memory_order_release);
    }
    pthread_mutex_unlock(&grow_lock);
}

void after_fork_in_child(void) {  /* the child has only the forking thread */
    workers.store(0);
    sleepers.store(0);
    busy.store(0);
    pthread_mutex_init(&grow_lock, NULL);
}

struct ForkHandler {
    ForkHandler() { pthread_atfork(NULL, NULL, after_fork_in_child); }
} fork_handler;

}  // namespace

int64_t set_kernel_threads(int64_t threads) {
    int64_t before = pool_threads_set;
    if (threads >= 0) pool_threads_set = threads > MAX_WORKERS + 1 ? MAX_WORKERS + 1 : (int)threads;
    return before;
}

void pool_run(pool_fn fn, void *ctx, int64_t n, int threads) {
    int expected = 0;
    if (threads <= 1 || n <= 1 || pool_in_item || n > 0xffffffffLL ||
        !busy.compare_exchange_strong(expected, 1, std::memory_order_acquire)) {
        for (int64_t i = 0; i < n; i++) fn(ctx, i, 0);  /* the caller's own buffers: area 0 */
        return;
    }
    ensure_workers(threads - 1);
    uint32_t g = (uint32_t)++generation;
    Loop &loop = loops[g % SLOTS];
    loop.fn.store(fn, std::memory_order_relaxed);
    loop.ctx.store(ctx, std::memory_order_relaxed);
    loop.n.store(n, std::memory_order_relaxed);
    loop.threads.store(threads, std::memory_order_relaxed);
    loop.done.store(0, std::memory_order_relaxed);
    ticket.store((uint64_t)g << 32);  /* seq_cst: publishes the entry */
    wake_word.store(g);
    if (sleepers.load() > 0) syscall(SYS_futex, (uint32_t *)&wake_word, FUTEX_WAKE_PRIVATE, INT_MAX, NULL, NULL, 0);
    take_items(g, loop, fn, ctx, n, 0);
    while (loop.done.load(std::memory_order_acquire) < n) _mm_pause();
    busy.store(0, std::memory_order_release);
}
