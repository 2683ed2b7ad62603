/* The FMA wall of this CPU: single-precision fused multiply-adds per second on
 * 1 and 2 threads, at 512 bits (AVX-512F) and at 256 bits (AVX2+FMA).  Ten
 * independent chains per thread hide the FMA latency, so the loop runs at the
 * issue rate of the FMA units.  The matrix products of an mnist-fc epoch are
 * compared against it in bench/README.md.
 *
 *   gcc -O2 -mavx512f -mfma bench/fma_peak.c -o /tmp/fma_peak -lpthread && /tmp/fma_peak
 */
#include <immintrin.h>
#include <pthread.h>
#include <stdio.h>
#include <time.h>

#define ITERS 20000000L
#define CHAINS 10

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

/* CHAINS accumulators a_k = a_k * m + c, summed at the end so that none is dead */
#define FMA_CHAINS(T, SET1, FMA, ADD)                                                      \
    T m = SET1(0.9999f), c = SET1(1e-4f), a[CHAINS];                                       \
    for (int k = 0; k < CHAINS; ++k) a[k] = SET1(k * 1e-3f);                               \
    for (long i = 0; i < ITERS; ++i) {                                                     \
        a[0] = FMA(a[0], m, c); a[1] = FMA(a[1], m, c); a[2] = FMA(a[2], m, c);            \
        a[3] = FMA(a[3], m, c); a[4] = FMA(a[4], m, c); a[5] = FMA(a[5], m, c);            \
        a[6] = FMA(a[6], m, c); a[7] = FMA(a[7], m, c); a[8] = FMA(a[8], m, c);            \
        a[9] = FMA(a[9], m, c);                                                            \
    }                                                                                      \
    T s = a[0];                                                                            \
    for (int k = 1; k < CHAINS; ++k) s = ADD(s, a[k]);

static void *chains512(void *out) {
    FMA_CHAINS(__m512, _mm512_set1_ps, _mm512_fmadd_ps, _mm512_add_ps)
    *(__m512 *)out = s;
    return NULL;
}

static void *chains256(void *out) {
    FMA_CHAINS(__m256, _mm256_set1_ps, _mm256_fmadd_ps, _mm256_add_ps)
    *(__m256 *)out = s;
    return NULL;
}

int main(void) {
    static __m512 sink[2];
    const struct { const char *name; void *(*fn)(void *); int lanes; } widths[] = {
        {"512-bit", chains512, 16}, {"256-bit", chains256, 8}};
    for (int w = 0; w < 2; ++w) {
        for (int nthreads = 1; nthreads <= 2; ++nthreads) {
            pthread_t threads[2];
            const double t0 = now();
            for (int i = 0; i < nthreads; ++i)
                pthread_create(&threads[i], NULL, widths[w].fn, &sink[i]);
            for (int i = 0; i < nthreads; ++i) pthread_join(threads[i], NULL);
            const double seconds = now() - t0;
            printf("%s, %d thread(s): %.1f G FMA/s\n", widths[w].name, nthreads,
                   nthreads * ITERS * (double)CHAINS * widths[w].lanes / seconds / 1e9);
        }
    }
    return 0;
}
