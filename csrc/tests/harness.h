/*
 * Shared pieces of the C test harness: pass/fail counting, a seeded random
 * stream, exact-size buffers and the float64 references every test compares
 * against.
 *
 * A reference function returns the exact answer in double and a "scale": the
 * sum of the magnitudes of the terms that went into it.  Float rounding error is
 * bounded by a few ulp of that scale (not of the answer, which may cancel to 0),
 * so tests accept |got - ref| <= rtol * scale.
 */
#ifndef GGMLOPT_TEST_HARNESS_H
#define GGMLOPT_TEST_HARNESS_H

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ggmlopt.h"
#include "kernel_table.h"

/* ---- counting ------------------------------------------------------------ */

extern int th_passed, th_failed;

/* Counts one check; prints "FAIL <message>" on one line when ok is 0. */
void th_check(int ok, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

/* The first element of an array that missed its reference, if any. */
typedef struct {
    int64_t index; /* -1: none */
    const char *what;
    double got, want, tol;
} th_miss;
#define TH_MISS_INIT {-1, "", 0.0, 0.0, 0.0}

/* 1 when got is within tol of want; a NaN want needs a NaN, an infinite want
 * the same infinity, and a NaN got never passes otherwise. */
static inline int th_near(double got, double want, double tol) {
    if (isnan(want)) return isnan(got);
    if (isinf(want)) return got == want;
    return fabs(got - want) <= tol;
}

/* Records element i as a miss (the first one only) unless it is near. */
static inline void th_expect(th_miss *m, const char *what, int64_t i, double got, double want,
                             double tol) {
    if (m->index < 0 && !th_near(got, want, tol)) {
        m->index = i;
        m->what = what;
        m->got = got;
        m->want = want;
        m->tol = tol;
    }
}

/* Bitwise equality of floats, any NaN matching any NaN. */
static inline int th_same_f32(float a, float b) {
    if (isnan(a) && isnan(b)) return 1;
    return memcmp(&a, &b, sizeof a) == 0;
}
static inline void th_expect_bits(th_miss *m, const char *what, int64_t i, float got, float want) {
    if (m->index < 0 && !th_same_f32(got, want)) {
        m->index = i;
        m->what = what;
        m->got = got;
        m->want = want;
        m->tol = 0.0;
    }
}

/* One check for a whole array: passes when nothing missed. */
void th_report(const th_miss *m, const char *ctx);

/* What runs now, for the watchdog's message when a call never returns. */
void th_set_stage(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
/* After seconds, prints a FAIL line naming the stage and the summary line, and
 * exits with status 1: a hang (a lost wake-up in the thread pool, say) then
 * fails the run instead of stalling it. */
void th_start_watchdog(unsigned seconds);

/* ---- random numbers: splitmix64, the same stream on every platform ---------- */

void th_seed(uint64_t seed);
uint64_t th_next(void);
float th_uniform(float lo, float hi);
int64_t th_randint(int64_t lo, int64_t hi); /* [lo, hi) */

/* ---- buffers --------------------------------------------------------------- */

/* n elements of elem_size bytes, placed off elements into a block of exactly
 * n + off elements: the array ends where the allocation ends, so a read or
 * write past it is caught by AddressSanitizer or valgrind.  Freed together by
 * th_release_all. */
void *th_alloc(size_t elem_size, int64_t n, int off);
void *th_dup(const void *src, size_t elem_size, int64_t n);
void th_release_all(void);

float *th_rand_f32(int64_t n, int off, float lo, float hi);
/* a float no kernel computes (a NaN-free pattern near FLT_MAX), and n of them
 * in a buffer: what an output's padding must still hold after a call */
float th_sentinel(void);
float *th_sentinels(int64_t n);

/* ---- float64 references ---------------------------------------------------- */

static inline double th_f16_to_double(uint16_t h) {
    const int sign = h >> 15, exp = (h >> 10) & 31, mant = h & 1023;
    double v;
    if (exp == 31) {
        v = mant ? NAN : INFINITY;
    } else if (exp == 0) {
        v = ldexp((double)mant, -24);
    } else {
        v = ldexp((double)(1024 + mant), exp - 25);
    }
    return sign ? -v : v;
}

/* The adamw hyper-parameters for step t, as the caller of the kernel builds them. */
void th_adamw_params(float p[GGMLOPT_ADAMW_NPARAMS], float alpha, float beta1, float beta2, float eps,
                     float wd, int t);

/* One element of an AdamW step: out = {w, m, v}, with their scales. */
static inline void th_adamw_ref(const float *p, float w, float g, float m, float v, double out[3],
                                double scale[3]) {
    const double alpha = p[GGMLOPT_ADAMW_ALPHA], beta1 = p[GGMLOPT_ADAMW_BETA1];
    const double beta2 = p[GGMLOPT_ADAMW_BETA2], eps = p[GGMLOPT_ADAMW_EPS];
    const double wd = p[GGMLOPT_ADAMW_WD], beta1h = p[GGMLOPT_ADAMW_BETA1H];
    const double beta2h = p[GGMLOPT_ADAMW_BETA2H];
    const double mr = (double)m * beta1 + (double)g * (1.0 - beta1);
    const double vr = (double)v * beta2 + (double)g * g * (1.0 - beta2);
    const double update = alpha * (mr * beta1h) / (sqrt(vr * beta2h) + eps);
    const double keep = 1.0 - alpha * wd;
    out[0] = (double)w * keep - update;
    out[1] = mr;
    out[2] = vr;
    /* the update goes through five roundings (mul, mul, sqrt, add, div) */
    scale[0] = fabs(w * keep) + fabs(out[0]) + 5.0 * fabs(update);
    scale[1] = fabs(m * beta1) + fabs(g * (1.0 - beta1)) + fabs(mr);
    scale[2] = fabs(v * beta2) + fabs((double)g * g * (1.0 - beta2)) + fabs(vr);
}

/* Index of the last maximum of a row, NaN entries skipped; 0 when nothing is
 * comparable (empty or all-NaN row).  ggml's argmax keeps the last maximum. */
static inline int32_t th_argmax_ref(int64_t n, const float *x) {
    int32_t idx = 0;
    int found = 0;
    float mx = 0.0f;
    for (int64_t i = 0; i < n; ++i) {
        if (isnan(x[i])) continue;
        if (!found || x[i] >= mx) {
            mx = x[i];
            idx = (int32_t)i;
            found = 1;
        }
    }
    return idx;
}

/* Cross-entropy of one row against probability labels: returns
 * -sum(l * log_softmax(x)) (terms with l == 0 left out, as the header says) and
 * its scale; when grad is not NULL, grad[i] = (softmax_i - l_i) * grad_scale and
 * grad_scale_out[i] its scale. */
double th_cross_entropy_row_ref(int64_t n, const float *x, const float *l, double grad_scale,
                                double *loss_scale, double *grad, double *grad_scale_out);

#endif
