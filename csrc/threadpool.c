#define _GNU_SOURCE /* sysconf, pthread_atfork */
#include "threadpool.h"

#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <unistd.h>

#define GO_POOL_MAX_THREADS 64
/* ~20-50 microseconds of polling before a worker sleeps */
#define GO_POOL_SPIN 4096

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define go_cpu_relax() _mm_pause()
#elif defined(__aarch64__)
#define go_cpu_relax() __asm__ __volatile__("yield")
#else
#define go_cpu_relax() ((void)0)
#endif

static struct {
    pthread_mutex_t run_mu; /* one caller at a time */
    pthread_mutex_t mu;     /* guards sleeping and waking */
    pthread_cond_t cv;
    pthread_t threads[GO_POOL_MAX_THREADS];
    uint64_t start_generation[GO_POOL_MAX_THREADS + 1]; /* per worker id, set before it starts */
    int nworkers;   /* started workers */
    int nthreads;   /* wanted: workers + caller */
    int sleepers;
    int shutdown;
    _Atomic uint64_t generation;
    _Atomic int pending;
    go_pool_task task;
    void *ctx;
    int nparts;
} pool = {.run_mu = PTHREAD_MUTEX_INITIALIZER, .mu = PTHREAD_MUTEX_INITIALIZER, .cv = PTHREAD_COND_INITIALIZER};

static pthread_once_t pool_once = PTHREAD_ONCE_INIT;

static void *worker_main(void *arg) {
    const int id = (int)(intptr_t)arg;
    /* the generation current when this worker was created: a task published
     * before the thread got to run is still seen as new */
    uint64_t seen = pool.start_generation[id];
    for (;;) {
        uint64_t gen;
        int spins = 0;
        while ((gen = atomic_load_explicit(&pool.generation, memory_order_acquire)) == seen &&
               spins++ < GO_POOL_SPIN) {
            go_cpu_relax();
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
        if (id < pool.nparts) pool.task(pool.ctx, id, pool.nparts);
        atomic_fetch_sub_explicit(&pool.pending, 1, memory_order_acq_rel);
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
}

static void pool_init(void) {
    long ncpu = sysconf(_SC_NPROCESSORS_ONLN);
    const char *env = getenv("GGMLOPT_NUM_THREADS");
    if (env && atoi(env) > 0) ncpu = atoi(env);
    if (ncpu < 1) ncpu = 1;
    if (ncpu > GO_POOL_MAX_THREADS) ncpu = GO_POOL_MAX_THREADS;
    pool.nthreads = (int)ncpu;
    pthread_atfork(NULL, NULL, after_fork_child);
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

void go_pool_run(go_pool_task task, void *ctx, int nparts) {
    pthread_once(&pool_once, pool_init);
    if (nparts > 1 && pthread_mutex_trylock(&pool.run_mu) == 0) {
        ensure_workers();
        if (nparts > pool.nworkers + 1) nparts = pool.nworkers + 1;
        if (nparts > 1) {
            pool.task = task;
            pool.ctx = ctx;
            pool.nparts = nparts;
            atomic_store_explicit(&pool.pending, pool.nworkers, memory_order_release);
            pthread_mutex_lock(&pool.mu);
            atomic_fetch_add_explicit(&pool.generation, 1, memory_order_acq_rel);
            if (pool.sleepers) pthread_cond_broadcast(&pool.cv);
            pthread_mutex_unlock(&pool.mu);
            task(ctx, 0, nparts);
            int spins = 0;
            while (atomic_load_explicit(&pool.pending, memory_order_acquire) > 0) {
                if (++spins > GO_POOL_SPIN) sched_yield(); else go_cpu_relax();
            }
            pthread_mutex_unlock(&pool.run_mu);
            return;
        }
        pthread_mutex_unlock(&pool.run_mu);
    }
    for (int p = 0; p < nparts; ++p) task(ctx, p, nparts);
}
