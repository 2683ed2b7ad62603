/* Counting, random numbers, buffers and the longer references of harness.h. */
#define _POSIX_C_SOURCE 200809L /* alarm */
#include "harness.h"

#include <signal.h>
#include <stdarg.h>
#include <unistd.h>

int th_passed, th_failed;

void th_check(int ok, const char *fmt, ...) {
    if (ok) {
        th_passed++;
        return;
    }
    th_failed++;
    va_list ap;
    va_start(ap, fmt);
    fputs("FAIL ", stdout);
    vprintf(fmt, ap);
    fputc('\n', stdout);
    va_end(ap);
}

void th_report(const th_miss *m, const char *ctx) {
    th_check(m->index < 0, "%s: %s[%lld] = %.9g, want %.9g (tol %.3g)", ctx, m->what,
             (long long)m->index, m->got, m->want, m->tol);
}

/* ---- watchdog ----------------------------------------------------------------- */

static char stage[256] = "start";

void th_set_stage(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(stage, sizeof stage, fmt, ap);
    va_end(ap);
}

static void put(const char *s) {
    ssize_t r = write(STDOUT_FILENO, s, strlen(s));
    (void)r;
}

static void put_int(int v) {
    char buf[16];
    int i = (int)sizeof buf;
    buf[--i] = '\0';
    do {
        buf[--i] = (char)('0' + v % 10);
        v /= 10;
    } while (v > 0 && i > 0);
    put(buf + i);
}

static unsigned watchdog_seconds;

/* Only async-signal-safe calls: stdout is flushed by hand first. */
static void on_alarm(int sig) {
    (void)sig;
    put("\nFAIL watchdog: no progress after ");
    put_int((int)watchdog_seconds);
    put(" s (a hang?) during: ");
    put(stage);
    put("\n");
    put_int(th_passed);
    put(" passed, ");
    put_int(th_failed + 1);
    put(" failed\n");
    _exit(1);
}

void th_start_watchdog(unsigned seconds) {
    watchdog_seconds = seconds;
    setvbuf(stdout, NULL, _IONBF, 0); /* so the handler's lines come after every other */
    signal(SIGALRM, on_alarm);
    alarm(seconds);
}

/* ---- random numbers ------------------------------------------------------ */

static uint64_t rng_state = 1;

void th_seed(uint64_t seed) { rng_state = seed; }

uint64_t th_next(void) {
    uint64_t z = (rng_state += 0x9e3779b97f4a7c15ULL);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
}

float th_uniform(float lo, float hi) {
    const double u = (double)(th_next() >> 40) * (1.0 / 16777216.0);
    return (float)(lo + (hi - lo) * u);
}

int64_t th_randint(int64_t lo, int64_t hi) {
    return lo + (int64_t)(th_next() % (uint64_t)(hi - lo));
}

/* ---- buffers --------------------------------------------------------------- */

#define TH_MAX_BLOCKS 512
static void *blocks[TH_MAX_BLOCKS];
static int nblocks;

void *th_alloc(size_t elem_size, int64_t n, int off) {
    if (nblocks == TH_MAX_BLOCKS) {
        fprintf(stderr, "harness: too many live buffers\n");
        abort();
    }
    const size_t bytes = elem_size * (size_t)(n + off);
    /* malloc(0) gives a unique pointer on glibc; kernels must not touch it */
    void *p = malloc(bytes);
    if (!p && bytes) {
        fprintf(stderr, "harness: out of memory (%zu bytes)\n", bytes);
        abort();
    }
    blocks[nblocks++] = p;
    return (char *)p + elem_size * (size_t)off;
}

void *th_dup(const void *src, size_t elem_size, int64_t n) {
    void *p = th_alloc(elem_size, n, 0);
    if (n > 0) memcpy(p, src, elem_size * (size_t)n);
    return p;
}

void th_release_all(void) {
    for (int i = 0; i < nblocks; ++i) free(blocks[i]);
    nblocks = 0;
}

float *th_rand_f32(int64_t n, int off, float lo, float hi) {
    float *p = (float *)th_alloc(sizeof(float), n, off);
    for (int64_t i = 0; i < n; ++i) p[i] = th_uniform(lo, hi);
    return p;
}

/* ---- references ------------------------------------------------------------ */

void th_adamw_params(float p[GGMLOPT_ADAMW_NPARAMS], float alpha, float beta1, float beta2, float eps,
                     float wd, int t) {
    p[GGMLOPT_ADAMW_ALPHA] = alpha;
    p[GGMLOPT_ADAMW_BETA1] = beta1;
    p[GGMLOPT_ADAMW_BETA2] = beta2;
    p[GGMLOPT_ADAMW_EPS] = eps;
    p[GGMLOPT_ADAMW_WD] = wd;
    p[GGMLOPT_ADAMW_BETA1H] = (float)(1.0 / (1.0 - pow(beta1, t)));
    p[GGMLOPT_ADAMW_BETA2H] = (float)(1.0 / (1.0 - pow(beta2, t)));
}

double th_cross_entropy_row_ref(int64_t n, const float *x, const float *l, double grad_scale,
                                double *loss_scale, double *grad, double *grad_scale_out) {
    double mx = -INFINITY;
    for (int64_t i = 0; i < n; ++i)
        if (x[i] > mx) mx = x[i];
    double sum_exp = 0.0;
    for (int64_t i = 0; i < n; ++i) sum_exp += exp((double)x[i] - mx);
    const double lse = n > 0 ? log(sum_exp) : 0.0;
    double loss = 0.0, scale = 0.0;
    for (int64_t i = 0; i < n; ++i) {
        if (l[i] == 0.0f) continue;
        const double t = (double)x[i] - mx;
        loss -= (double)l[i] * (t - lse);
        scale += fabs((double)l[i]) * (fabs(t) + fabs(lse));
    }
    *loss_scale = scale;
    if (grad) {
        for (int64_t i = 0; i < n; ++i) {
            const double p = exp((double)x[i] - mx) / sum_exp;
            grad[i] = (p - (double)l[i]) * grad_scale;
            grad_scale_out[i] = (p + fabs((double)l[i])) * fabs(grad_scale);
        }
    }
    return loss;
}

float th_sentinel(void) {
    const uint32_t u = 0x7f7fdeadu;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

float *th_sentinels(int64_t n) {
    float *p = th_alloc(4, n, 0);
    for (int64_t i = 0; i < n; ++i) p[i] = th_sentinel();
    return p;
}
