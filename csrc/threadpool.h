/* A small persistent pool: the calling thread plus (nthreads - 1) workers share
 * the blocks of one job.  Blocks are claimed from a counter, so the caller
 * never waits for a worker the scheduler has not run yet: on a busy machine it
 * simply does more of the blocks itself.  Workers poll briefly after a job and
 * then sleep on a condition variable, so they cost nothing while BLAS or Python
 * runs; a caller that calls every few microseconds (decoding) sets a linger,
 * during which they poll longer, yielding their cores. */
#ifndef GGMLOPT_THREADPOOL_H
#define GGMLOPT_THREADPOOL_H

#include <stdint.h>

typedef void (*go_pool_block_fn)(void *ctx, int block);

/* Runs fn(ctx, b) exactly once for every b in [0, nblocks), in parallel when
 * threads are available, and returns when all are done.  Falls back to the
 * caller alone when another thread is using the pool or threads cannot start. */
void go_pool_for(int nblocks, go_pool_block_fn fn, void *ctx);
int go_pool_threads(void);
void go_pool_set_threads(int n);
/* how long an idle worker keeps polling (yielding its core) before it sleeps;
 * 0, the default, sleeps after a few microseconds.  Returns the previous. */
int64_t go_pool_set_linger_ns(int64_t ns);

#endif
