/* The memory wall of AdamW: the same seven streams (read w, g, m, v; write w,
 * m, v) with one addition each instead of AdamW's arithmetic, so its time is
 * what moving those bytes costs on this machine.  Built and loaded by
 * bench/test_bench_kernels_adamw.py (gcc -O3 -march=native -fopenmp). */
#include <stdint.h>

void stream_same_bytes(int64_t n, float *w, const float *g, float *m, float *v, int nthreads) {
/* blocks of 16384 taken in turn, as ggmlopt's pool does: a thread that waits
 * for a core on a shared machine does not hold up a fixed half */
#pragma omp parallel for num_threads(nthreads) schedule(dynamic, 16384)
    for (int64_t i = 0; i < n; ++i) {
        const float gi = g[i];
        w[i] += gi;
        m[i] += gi;
        v[i] += gi;
    }
}
