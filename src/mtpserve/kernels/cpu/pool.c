/*
 * One thread pool per process for every kernel call, built to survive a busy machine.
 *
 * A call splits its items into chunks that the calling thread and the pool's workers claim from one
 * atomic counter, so whoever is running does the work: a worker the scheduler has set aside holds back
 * at most the one chunk it claimed, never the whole call (OpenMP's static split and its barriers wait
 * for every thread, which on a shared core means waiting a scheduler time slice per call).
 *
 * Between calls a worker spins for the poll budget (llama-server's --poll, 0-100: 0 sleeps at once,
 * 50 by default spins about 0.5 ms, 100 about 1 ms), then sleeps on a futex until the next call wakes
 * it; the caller, once no chunk is left to claim, waits the same way for chunks still running. Results
 * never depend on which thread ran a chunk: every item writes its own outputs.
 *
 * Calls from several threads at once take turns on one pool (a mutex), never a second team of threads.
 * Threads are pinned only when asked (mtp_pool_configure's pin: worker i on the i-th allowed CPU + 1).
 */

#define _GNU_SOURCE
#include "common.h"

#include <linux/futex.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#define MAX_WORKERS 255
#define GEN_SHIFT 40 /* claim word: generation in the top 24 bits, next item index in the low 40 */
#define INDEX_MASK ((1ull << GEN_SHIFT) - 1)

typedef struct {
    pthread_mutex_t submit;          /* one call at a time */
    _Atomic uint32_t gen;            /* futex word the workers sleep on: bumped once per call */
    _Atomic int sleepers;            /* workers asleep (or about to be) on gen */
    _Atomic uint64_t claim;          /* (generation << 40) | next item */
    _Atomic int64_t done;            /* items finished in the current call */
    _Atomic uint32_t finished;       /* futex word the caller sleeps on: 1 once done == n */
    mtp_task_fn fn;                  /* fn and ctx are read only after a successful claim */
    void *ctx;
    _Atomic int64_t n, grain;
    _Atomic int n_active;            /* workers taking part in this call (the caller is extra) */
    int n_workers;                   /* workers started */
    int poll;                        /* 0-100 */
    int pin;
    pthread_t threads[MAX_WORKERS];
} pool_t;

static pool_t pool = {.submit = PTHREAD_MUTEX_INITIALIZER, .poll = 50};

static inline void futex_wait(_Atomic uint32_t *addr, uint32_t expected) {
    syscall(SYS_futex, (uint32_t *)addr, FUTEX_WAIT_PRIVATE, expected, NULL, NULL, 0);
}
static inline void futex_wake(_Atomic uint32_t *addr, int n) {
    syscall(SYS_futex, (uint32_t *)addr, FUTEX_WAKE_PRIVATE, n, NULL, NULL, 0);
}

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ volatile("yield");
#endif
}

static inline int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

/* How long a thread spins before it sleeps: poll * 10 us (0.5 ms at llama-server's default of 50). */
static inline int64_t spin_budget_ns(void) { return (int64_t)pool.poll * 10000; }

/* Spin until *word != value or the budget runs out; returns 1 if it changed. */
static int spin_while_equal(_Atomic uint32_t *word, uint32_t value) {
    const int64_t budget = spin_budget_ns();
    if (budget <= 0) return atomic_load(word) != value;
    const int64_t deadline = now_ns() + budget;
    for (int i = 0;; i++) {
        if (atomic_load_explicit(word, memory_order_acquire) != value) return 1;
        if (i < 256) {
            cpu_relax();
        } else { /* after a few microseconds: hand the core to any thread that wants it (a neighbour, our caller) */
            sched_yield();
            if (now_ns() >= deadline) return 0;
        }
    }
}

/* Claim and run chunks of the call of generation `g` until none is left; 0 when the call had moved on. */
static void run_chunks(uint64_t g) {
    for (;;) {
        uint64_t c = atomic_load_explicit(&pool.claim, memory_order_acquire);
        if ((c >> GEN_SHIFT) != g) return;
        const int64_t begin = (int64_t)(c & INDEX_MASK), n = pool.n, grain = pool.grain;
        if (begin >= n) return;
        const int64_t end = begin + grain < n ? begin + grain : n;
        if (!atomic_compare_exchange_weak(&pool.claim, &c, (g << GEN_SHIFT) | (uint64_t)end)) continue;
        /* the claim succeeded in generation g, so fn/ctx are g's until `done` counts this chunk */
        pool.fn(pool.ctx, begin, end);
        if (atomic_fetch_add(&pool.done, end - begin) + (end - begin) == n) {
            atomic_store(&pool.finished, 1);
            futex_wake(&pool.finished, 1);
        }
    }
}

static void *worker_main(void *arg) {
    const int index = (int)(intptr_t)arg;
    uint32_t seen = atomic_load(&pool.gen);
    for (;;) {
        if (!spin_while_equal(&pool.gen, seen)) {
            atomic_fetch_add(&pool.sleepers, 1);
            while (atomic_load(&pool.gen) == seen) futex_wait(&pool.gen, seen);
            atomic_fetch_sub(&pool.sleepers, 1);
        }
        seen = atomic_load(&pool.gen);
        if (index < pool.n_active) run_chunks(seen & 0xffffff);
    }
    return NULL;
}

/* The CPUs the process may use, read when pinning is switched on (by a thread not yet pinned): a pinned thread's
 * own mask is its one CPU, so it cannot be read again later. */
static cpu_set_t allowed;

static void pin_to_allowed_cpu(pthread_t thread, int i) {
    cpu_set_t one;
    const int n = CPU_COUNT(&allowed);
    if (n == 0) return;
    for (int cpu = 0, seen = 0; cpu < CPU_SETSIZE; cpu++)
        if (CPU_ISSET(cpu, &allowed) && seen++ == i % n) {
            CPU_ZERO(&one);
            CPU_SET(cpu, &one);
            pthread_setaffinity_np(thread, sizeof(one), &one);
            return;
        }
}

/* Start workers until there are `want` of them (the pool only grows). Called with `submit` held. */
static void grow(int want) {
    if (want > MAX_WORKERS) want = MAX_WORKERS;
    while (pool.n_workers < want) {
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setstacksize(&attr, 1 << 20);
        const int ok = pthread_create(&pool.threads[pool.n_workers], &attr, worker_main, (void *)(intptr_t)pool.n_workers) == 0;
        pthread_attr_destroy(&attr);
        if (!ok) break;
        if (pool.pin) pin_to_allowed_cpu(pool.threads[pool.n_workers], pool.n_workers + 1);
        pool.n_workers++;
    }
}

/* poll: 0-100 as llama-server's --poll; pin: 1 pins every thread that calls the kernels (at its first call: the
 * engine's thread, not whichever thread configured the pool) to the first allowed CPU and worker i to the (i+1)-th
 * (wrapping); 0 leaves placement to the scheduler. Takes effect for the following calls. */
int mtp_pool_configure(int poll, int pin) {
    if (poll < 0 || poll > 100) return 1;
    pthread_mutex_lock(&pool.submit);
    pool.poll = poll;
    if (pin && !pool.pin) {
        if (sched_getaffinity(0, sizeof(allowed), &allowed)) CPU_ZERO(&allowed); /* unreadable: pin nothing */
        pool.pin = 1;
        for (int i = 0; i < pool.n_workers; i++) pin_to_allowed_cpu(pool.threads[i], i + 1);
    }
    pthread_mutex_unlock(&pool.submit);
    return 0;
}

int mtp_pool_workers(void) { return pool.n_workers; }

void mtp_parallel_for(int64_t n, int64_t grain, int n_threads, mtp_task_fn fn, void *ctx) {
    if (n <= 0) return;
    if (grain < 1) grain = 1;
    if (n_threads <= 1 || n <= grain) {
        fn(ctx, 0, n);
        return;
    }
    static __thread int caller_pinned;
    pthread_mutex_lock(&pool.submit);
    if (pool.pin && !caller_pinned) {
        pin_to_allowed_cpu(pthread_self(), 0);
        caller_pinned = 1;
    }
    grow(n_threads - 1);
    const uint32_t g = atomic_load(&pool.gen) + 1;
    const uint64_t tag = ((uint64_t)(g & 0xffffff)) << GEN_SHIFT;
    /* Close the claim word first: a worker still holding the last call's word (it read it, then stalled) must
     * fail its compare-and-swap rather than claim items of this call against the old generation. */
    atomic_store(&pool.claim, tag | INDEX_MASK);
    pool.fn = fn;
    pool.ctx = ctx;
    pool.n = n;
    pool.grain = grain;
    pool.n_active = n_threads - 1;
    atomic_store(&pool.done, 0);
    atomic_store(&pool.finished, 0);
    atomic_store(&pool.claim, tag); /* opens the items, after the fields they need */
    atomic_store(&pool.gen, g);     /* wakes the workers */
    if (atomic_load(&pool.sleepers) > 0) futex_wake(&pool.gen, INT32_MAX);
    run_chunks(g & 0xffffff);
    if (!spin_while_equal(&pool.finished, 0))
        while (atomic_load(&pool.finished) == 0) futex_wait(&pool.finished, 0);
    pthread_mutex_unlock(&pool.submit);
}
