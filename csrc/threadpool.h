/* A small persistent pool: the calling thread plus (nthreads - 1) workers run
 * one task split into parts.  Workers spin briefly after a task (back-to-back
 * kernel calls then start without a wake-up) and sleep on a condition variable
 * after that, so they cost nothing while BLAS or Python runs. */
#ifndef GGMLOPT_THREADPOOL_H
#define GGMLOPT_THREADPOOL_H

typedef void (*go_pool_task)(void *ctx, int part, int nparts);

/* Runs task(ctx, p, nparts) for p in [0, nparts), nparts <= go_pool_threads().
 * Falls back to running every part on the caller when another thread is using
 * the pool or threads cannot be started. */
void go_pool_run(go_pool_task task, void *ctx, int nparts);
int go_pool_threads(void);
void go_pool_set_threads(int n);

#endif
