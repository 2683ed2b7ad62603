#define _GNU_SOURCE /* sysconf, pthread_atfork, sched_getaffinity */
#include "threadpool.h"

#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>

#define GO_POOL_MAX_THREADS 64
/* polls (a pause instruction each, 10 ns on a Sapphire Rapids Xeon) before a
 * worker starts yielding */
#define GO_POOL_SPIN 1024
/* then, while a linger is set (go_pool_set_linger_ns), it polls between
 * sched_yield() calls, which hand the core to any other runnable thread (a
 * BLAS's workers), for that long before it sleeps: decoding calls the pool
 * every few tens of microseconds with Python in between, and a sleeping
 * worker's wake-up took 20-30 us of a 30-50 us product in a VM; in training
 * the same yielding cost the BLAS's threads 5% of a step, so it is off there */
static _Atomic int64_t linger_ns = 0;

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define go_cpu_relax() _mm_pause()
#elif defined(__aarch64__)
#define go_cpu_relax() __asm__ __volatile__("yield")
#else
#define go_cpu_relax() ((void)0)
#endif

typedef struct {
    go_pool_block_fn fn;
    void *ctx;
    int nblocks;
    _Atomic int next; /* next unclaimed block */
    _Atomic int done; /* finished blocks */
} go_job;

static struct {
    pthread_mutex_t run_mu; /* one job at a time */
    pthread_mutex_t mu;     /* guards sleeping and waking */
    pthread_cond_t cv;
    pthread_t threads[GO_POOL_MAX_THREADS];
    uint64_t start_generation[GO_POOL_MAX_THREADS + 1]; /* per worker id, set before it starts */
    int nworkers; /* started workers */
    _Atomic int nthreads; /* wanted: workers + caller (read without the lock) */
    int sleepers;
    int shutdown;
    _Atomic uint64_t generation; /* bumped for every job */
    _Atomic(go_job *) job;       /* the running job, NULL between jobs */
    _Atomic int active;          /* workers that may be touching *job */
} pool = {.run_mu = PTHREAD_MUTEX_INITIALIZER,
          .mu = PTHREAD_MUTEX_INITIALIZER,
          .cv = PTHREAD_COND_INITIALIZER};

static pthread_once_t pool_once = PTHREAD_ONCE_INIT;

static int64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

static void run_claims(go_job *job) {
    int b;
    while ((b = atomic_fetch_add_explicit(&job->next, 1, memory_order_relaxed)) < job->nblocks) {
        job->fn(job->ctx, b);
        atomic_fetch_add_explicit(&job->done, 1, memory_order_release);
    }
}

static void *worker_main(void *arg) {
    const int id = (int)(intptr_t)arg;
    /* the generation current when this worker was created: a job published
     * before the thread got to run is still seen as new */
    uint64_t seen = pool.start_generation[id];
    for (;;) {
        uint64_t gen;
        int spins = 0;
        while ((gen = atomic_load_explicit(&pool.generation, memory_order_acquire)) == seen &&
               spins++ < GO_POOL_SPIN) {
            go_cpu_relax();
        }
        const int64_t linger = atomic_load_explicit(&linger_ns, memory_order_relaxed);
        if (gen == seen && linger > 0) {
            const int64_t until = now_ns() + linger;
            while ((gen = atomic_load_explicit(&pool.generation, memory_order_acquire)) == seen &&
                   now_ns() < until) {
                sched_yield();
            }
        }
        if (gen == seen) {
            pthread_mutex_lock(&pool.mu);
            pool.sleepers++;
            while ((gen = atomic_load_explicit(&pool.generation, memory_order_acquire)) == seen &&
                   !pool.shutdown) {
                pthread_cond_wait(&pool.cv, &pool.mu);
            }
            pool.sleepers--;
            const int stop = pool.shutdown;
            pthread_mutex_unlock(&pool.mu);
            if (stop) return NULL;
        }
        seen = gen;
        /* Announce first, then look for the job (both sequentially consistent):
         * the caller clears the job, then waits for active == 0, so either it
         * sees this worker as active or this worker sees no job. */
        atomic_fetch_add(&pool.active, 1);
        go_job *job = atomic_load(&pool.job);
        if (job) run_claims(job);
        atomic_fetch_sub(&pool.active, 1);
    }
}

static void stop_workers(void) {
    pthread_mutex_lock(&pool.mu);
    pool.shutdown = 1;
    pthread_cond_broadcast(&pool.cv);
    pthread_mutex_unlock(&pool.mu);
    for (int i = 0; i < pool.nworkers; ++i) pthread_join(pool.threads[i], NULL);
    pool.nworkers = 0;
    pool.shutdown = 0;
}

/* Workers do not survive fork(): the child starts with none and restarts them. */
static void after_fork_child(void) {
    pthread_mutex_init(&pool.run_mu, NULL);
    pthread_mutex_init(&pool.mu, NULL);
    pthread_cond_init(&pool.cv, NULL);
    pool.nworkers = 0;
    pool.sleepers = 0;
    pool.shutdown = 0;
    atomic_store(&pool.job, NULL);
    atomic_store(&pool.active, 0);
}

/* the CPUs this process may run on: its affinity mask (taskset, a container's
 * cpuset), which the online count ignores; GGMLOPT_NUM_THREADS is read, checked,
 * by the Python layer at import (ggmlopt.kernels), not here */
static long usable_cpus(void) {
#if defined(__linux__) && defined(CPU_COUNT)
    cpu_set_t set;
    if (sched_getaffinity(0, sizeof set, &set) == 0) {
        const int n = CPU_COUNT(&set);
        if (n > 0) return n;
    }
#endif
    return sysconf(_SC_NPROCESSORS_ONLN);
}

static void pool_init(void) {
    long ncpu = usable_cpus();
    if (ncpu < 1) ncpu = 1;
    if (ncpu > GO_POOL_MAX_THREADS) ncpu = GO_POOL_MAX_THREADS;
    pool.nthreads = (int)ncpu;
    pthread_atfork(NULL, NULL, after_fork_child);
}

int64_t go_pool_set_linger_ns(int64_t ns) {
    return atomic_exchange(&linger_ns, ns > 0 ? ns : 0);
}

int go_pool_threads(void) {
    pthread_once(&pool_once, pool_init);
    return pool.nthreads;
}

void go_pool_set_threads(int n) {
    pthread_once(&pool_once, pool_init);
    if (n < 1) n = 1;
    if (n > GO_POOL_MAX_THREADS) n = GO_POOL_MAX_THREADS;
    pthread_mutex_lock(&pool.run_mu);
    if (pool.nworkers > n - 1) stop_workers();
    pool.nthreads = n;
    pthread_mutex_unlock(&pool.run_mu);
}

/* Called with run_mu held. */
static void ensure_workers(void) {
    while (pool.nworkers < pool.nthreads - 1) {
        const int id = pool.nworkers + 1;
        pool.start_generation[id] = atomic_load_explicit(&pool.generation, memory_order_acquire);
        if (pthread_create(&pool.threads[pool.nworkers], NULL, worker_main, (void *)(intptr_t)id) != 0)
            break;
        pool.nworkers++;
    }
}

void go_pool_for(int nblocks, go_pool_block_fn fn, void *ctx) {
    pthread_once(&pool_once, pool_init);
    if (nblocks > 1 && pool.nthreads > 1 && pthread_mutex_trylock(&pool.run_mu) == 0) {
        ensure_workers();
        if (pool.nworkers > 0) {
            go_job job = {fn, ctx, nblocks, 0, 0};
            atomic_store(&pool.job, &job);
            pthread_mutex_lock(&pool.mu);
            atomic_fetch_add_explicit(&pool.generation, 1, memory_order_acq_rel);
            if (pool.sleepers) pthread_cond_broadcast(&pool.cv);
            pthread_mutex_unlock(&pool.mu);

            run_claims(&job);
            int spins = 0;
            while (atomic_load_explicit(&job.done, memory_order_acquire) < nblocks) {
                if (++spins > GO_POOL_SPIN) sched_yield(); else go_cpu_relax();
            }
            atomic_store(&pool.job, NULL);
            while (atomic_load(&pool.active) > 0) go_cpu_relax();
            pthread_mutex_unlock(&pool.run_mu);
            return;
        }
        pthread_mutex_unlock(&pool.run_mu);
    }
    for (int b = 0; b < nblocks; ++b) fn(ctx, b);
}
