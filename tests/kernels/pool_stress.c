/* Many quick mtp_parallel_for calls of varying sizes, grains and thread counts, each item counted: prints "ok"
 * when every item ran exactly once. Built and run by test_cpu_pool.py (a deadlock shows as its timeout). */
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

typedef void (*mtp_task_fn)(void *ctx, int64_t begin, int64_t end);
void mtp_parallel_for(int64_t n, int64_t grain, int n_threads, mtp_task_fn fn, void *ctx);
int mtp_pool_configure(int poll, int pin);

static _Atomic long count;
static void work(void *ctx, int64_t begin, int64_t end) { (void)ctx; atomic_fetch_add(&count, end - begin); }

int main(int argc, char **argv) {
    const long calls = argc > 1 ? atol(argv[1]) : 1000000;
    mtp_pool_configure(1, 0); /* 10 us of spinning: workers fall asleep and wake all the time */
    long expected = 0;
    for (long i = 0; i < calls; i++) {
        const int64_t n = 1 + (i * 7919) % 37;
        mtp_parallel_for(n, 1 + i % 3, 2 + i % 3, work, NULL);
        expected += n;
    }
    printf("%s %ld %ld\n", count == expected ? "ok" : "mismatch", (long)count, expected);
    return count != expected;
}
