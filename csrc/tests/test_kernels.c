/*
 * The C test harness: every kernel of every dispatch table this build holds
 * (scalar always, avx2 and avx512 when the CPU runs them, neon on aarch64) against float64
 * references, on sizes around each vector width, with arrays that end exactly
 * at the end of their allocation; every non-scalar path against the scalar
 * path; then the public, dispatched API of ggmlopt.h (test_public_api.c).
 *
 * Prints one line per failed check and ends with "N passed, M failed"; exits
 * non-zero on any failure.  Usage: test_kernels [--big N] [--timeout S]
 * (N: the large size of the dispatched-API tests, default 300001; S: seconds
 * before the watchdog fails the run as hung, default 300).
 */
#include "harness.h"

void test_public_api(int64_t big);
void test_conv_kernels(const ggmlopt_kernel_table *k);
void test_conv_public_api(void);
void test_conv_direct_kernels(const ggmlopt_kernel_table *k);
void test_conv_direct_public_api(void);
/* test_activation.c */
void test_activations(const ggmlopt_kernel_table *k, const ggmlopt_kernel_table *scalar,
                      int64_t n, int off);
void test_activations_sweep(const ggmlopt_kernel_table *k);
void test_activations_public(int64_t big);
/* test_lm_layers.c */
void test_lm_layers(const ggmlopt_kernel_table *k, const ggmlopt_kernel_table *scalar);
void test_lm_layers_public(void);
/* test_attention.c */
void test_attention_kernels(const ggmlopt_kernel_table *k, const ggmlopt_kernel_table *scalar);
void test_attention_public(void);
void test_attention_public_waves(void);
/* test_quant.c */
void test_quant_kernels(const ggmlopt_kernel_table *k);
void test_quant_public(void);
void test_decode_block_public(void);
void test_gemm_kernels(const ggmlopt_kernel_table *k);
void test_gemm_thin_bits(const ggmlopt_kernel_table *k);
void test_gemm_public(void);
void test_gemm_bf16_kernels(const ggmlopt_kernel_table *k);
void test_gemm_bf16_public(void);
void test_matmul_columns_public(void);
void test_quantize_k(void);

static const ggmlopt_kernel_table *const SCALAR = &ggmlopt_kernels_scalar;

static const int64_t SIZES[] = {0, 1, 2, 3, 7, 8, 9, 15, 16, 17, 31, 33, 64, 1000, 4097};
#define NSIZES ((int)(sizeof(SIZES) / sizeof(SIZES[0])))
#define MAX_OFF 3

/* a few float roundings, relative to the scale of the terms */
#define RTOL_ROUND 5e-7
/* exp approximation (2 ulp) and float row sums in the softmax */
#define RTOL_EXP 1e-5
/* sums accumulated in double */
#define RTOL_SUM 1e-12
/* one SIMD path against the scalar one */
#define RTOL_PATHS 1e-5

#define CTX(buf, kernel, k, n, off, extra)                                                  \
    snprintf(buf, sizeof(buf), "%s[%s] n=%lld off=%d%s", kernel, (k)->name, (long long)(n), \
             (off), (extra))

/* Reports the reference check, and the scalar comparison on other paths. */
static void report(const ggmlopt_kernel_table *k, const th_miss *ref, const th_miss *cross,
                   const char *ctx) {
    th_report(ref, ctx);
    if (k != SCALAR) th_report(cross, ctx);
}

/* ---- optimizer steps ---------------------------------------------------- */

static void test_adamw(const ggmlopt_kernel_table *k, int64_t n, int off, const float *params,
                       const char *tag) {
    char ctx[160];
    CTX(ctx, "adamw_step_f32", k, n, off, tag);
    float *w = th_rand_f32(n, off, -1.0f, 1.0f), *g = th_rand_f32(n, off, -1.0f, 1.0f);
    float *m = th_rand_f32(n, off, -0.1f, 0.1f), *v = th_rand_f32(n, off, 0.0f, 0.01f);
    const float *w0 = th_dup(w, 4, n), *g0 = th_dup(g, 4, n), *m0 = th_dup(m, 4, n);
    const float *v0 = th_dup(v, 4, n);
    float *ws = th_dup(w, 4, n), *ms = th_dup(m, 4, n), *vs = th_dup(v, 4, n);

    k->adamw_step_f32(n, w, g, m, v, params);
    if (k != SCALAR) SCALAR->adamw_step_f32(n, ws, g0, ms, vs, params);

    th_miss ref = TH_MISS_INIT, cross = TH_MISS_INIT;
    for (int64_t i = 0; i < n; ++i) {
        double want[3], scale[3];
        th_adamw_ref(params, w0[i], g0[i], m0[i], v0[i], want, scale);
        th_expect(&ref, "w", i, w[i], want[0], RTOL_ROUND * scale[0]);
        th_expect(&ref, "m", i, m[i], want[1], RTOL_ROUND * scale[1]);
        th_expect(&ref, "v", i, v[i], want[2], RTOL_ROUND * scale[2]);
        th_expect_bits(&ref, "g (an input, changed)", i, g[i], g0[i]);
        th_expect(&cross, "w vs scalar", i, w[i], ws[i], RTOL_PATHS * scale[0]);
        th_expect(&cross, "m vs scalar", i, m[i], ms[i], RTOL_PATHS * scale[1]);
        th_expect(&cross, "v vs scalar", i, v[i], vs[i], RTOL_PATHS * scale[2]);
    }
    report(k, &ref, &cross, ctx);
}

static void test_sgd(const ggmlopt_kernel_table *k, int64_t n, int off) {
    char ctx[160];
    CTX(ctx, "sgd_step_f32", k, n, off, "");
    const float alpha = 0.03f, wd = 0.1f;
    float *w = th_rand_f32(n, off, -1.0f, 1.0f), *g = th_rand_f32(n, off, -1.0f, 1.0f);
    const float *w0 = th_dup(w, 4, n), *g0 = th_dup(g, 4, n);
    float *ws = th_dup(w, 4, n);

    k->sgd_step_f32(n, w, g, alpha, wd);
    if (k != SCALAR) SCALAR->sgd_step_f32(n, ws, g0, alpha, wd);

    th_miss ref = TH_MISS_INIT, cross = TH_MISS_INIT;
    const double keep = 1.0 - (double)alpha * wd;
    for (int64_t i = 0; i < n; ++i) {
        const double want = w0[i] * keep - (double)alpha * g0[i];
        const double scale = fabs(w0[i] * keep) + fabs((double)alpha * g0[i]) + fabs(want);
        th_expect(&ref, "w", i, w[i], want, RTOL_ROUND * scale);
        th_expect_bits(&ref, "g (an input, changed)", i, g[i], g0[i]);
        th_expect(&cross, "w vs scalar", i, w[i], ws[i], RTOL_PATHS * scale);
    }
    report(k, &ref, &cross, ctx);
}

/* ---- elementwise ---------------------------------------------------------- */

static void test_axpy(const ggmlopt_kernel_table *k, int64_t n, int off) {
    char ctx[160];
    CTX(ctx, "axpy_f32", k, n, off, "");
    const float a = -0.37f;
    float *x = th_rand_f32(n, off, -1.0f, 1.0f), *y = th_rand_f32(n, off, -1.0f, 1.0f);
    const float *x0 = th_dup(x, 4, n), *y0 = th_dup(y, 4, n);
    float *ys = th_dup(y, 4, n);

    k->axpy_f32(n, a, x, y);
    if (k != SCALAR) SCALAR->axpy_f32(n, a, x0, ys);

    th_miss ref = TH_MISS_INIT, cross = TH_MISS_INIT;
    for (int64_t i = 0; i < n; ++i) {
        const double want = y0[i] + (double)a * x0[i];
        const double scale = fabs(y0[i]) + fabs((double)a * x0[i]) + fabs(want);
        th_expect(&ref, "y", i, y[i], want, RTOL_ROUND * scale);
        th_expect_bits(&ref, "x (an input, changed)", i, x[i], x0[i]);
        th_expect(&cross, "y vs scalar", i, y[i], ys[i], RTOL_PATHS * scale);
    }
    report(k, &ref, &cross, ctx);
}

/* x*a and fills are exact: a float product is correctly rounded on every path. */
static void test_scale_fill(const ggmlopt_kernel_table *k, int64_t n, int off) {
    char ctx[160];
    CTX(ctx, "scale_f32/fill_f32", k, n, off, "");
    const float a = -3.25f;
    float *x = th_rand_f32(n, off, -1e3f, 1e3f);
    const float *x0 = th_dup(x, 4, n);
    float *f1 = th_rand_f32(n, off, -1.0f, 1.0f), *f2 = th_rand_f32(n, off, -1.0f, 1.0f);

    k->scale_f32(n, a, x);
    k->fill_f32(n, 1.5f, f1);
    k->fill_f32(n, -0.0f, f2);

    th_miss ref = TH_MISS_INIT;
    for (int64_t i = 0; i < n; ++i) {
        th_expect_bits(&ref, "scaled x", i, x[i], (float)((double)x0[i] * a));
        th_expect_bits(&ref, "fill 1.5", i, f1[i], 1.5f);
        th_expect_bits(&ref, "fill -0.0", i, f2[i], -0.0f);
    }
    th_report(&ref, ctx);
}

/* ---- layer helpers ---------------------------------------------------------- */

/* bias add, relu and its backward are one float operation or a select per
 * element: the same bits as the float reference on every path. */
static void test_layer_helpers(const ggmlopt_kernel_table *k, int64_t n, int off) {
    char ctx[160];
    CTX(ctx, "add_bias_rows/relu/relu_backward_f32", k, n, off, "");
    const int64_t nrows = 3;
    float *x = th_rand_f32(nrows * n, off, -1.0f, 1.0f), *bias = th_rand_f32(n, off, -1.0f, 1.0f);
    const float *x0 = th_dup(x, 4, nrows * n);
    k->add_bias_rows_f32(nrows, n, x, bias);

    float *r = th_rand_f32(n, off, -1.0f, 1.0f);
    if (n > 0) r[0] = NAN;
    if (n > 1) r[1] = -0.0f;
    if (n > 2) r[2] = 0.0f;
    const float *r0 = th_dup(r, 4, n);
    float *y = th_alloc(4, n, off);
    k->relu_f32(n, r, y);
    float *g = th_rand_f32(n, off, -1.0f, 1.0f), *gi = th_alloc(4, n, off);
    k->relu_backward_f32(n, y, g, gi);

    th_miss ref = TH_MISS_INIT;
    for (int64_t i = 0; i < nrows * n; ++i)
        th_expect_bits(&ref, "x + bias", i, x[i], x0[i] + bias[i % n]);
    for (int64_t i = 0; i < n; ++i) {
        th_expect_bits(&ref, "relu", i, y[i], r0[i] > 0.0f || r0[i] != r0[i] ? r0[i] : 0.0f);
        th_expect_bits(&ref, "relu input (changed)", i, r[i], r0[i]);
        th_expect_bits(&ref, "relu backward", i, gi[i], y[i] != 0.0f ? g[i] : 0.0f);
    }
    th_report(&ref, ctx);
}

/* ---- reductions ----------------------------------------------------------- */

static void test_sums(const ggmlopt_kernel_table *k, int64_t n, int off) {
    char ctx[160];
    CTX(ctx, "sum_f32/sumsq_f32", k, n, off, "");
    /* an offset of 3 keeps the sum far from 0 relative to its terms */
    float *x = th_rand_f32(n, off, -1.0f, 4.0f);
    double want = 0.0, want_sq = 0.0, scale = 0.0;
    for (int64_t i = 0; i < n; ++i) {
        want += x[i];
        want_sq += (double)x[i] * x[i];
        scale += fabs(x[i]);
    }
    const double s = k->sum_f32(n, x), sq = k->sumsq_f32(n, x);
    th_check(th_near(s, want, RTOL_SUM * scale), "%s: sum = %.17g, want %.17g", ctx, s, want);
    th_check(th_near(sq, want_sq, RTOL_SUM * want_sq), "%s: sumsq = %.17g, want %.17g", ctx, sq,
             want_sq);
    if (k != SCALAR) {
        const double ss = SCALAR->sum_f32(n, x), ssq = SCALAR->sumsq_f32(n, x);
        th_check(th_near(s, ss, RTOL_SUM * scale) && th_near(sq, ssq, RTOL_SUM * want_sq),
                 "%s: sum %.17g sumsq %.17g, scalar %.17g %.17g", ctx, s, sq, ss, ssq);
    }
    if (n >= 1) {
        /* the last element lands in the leftovers or the last vector */
        x[n - 1] = INFINITY;
        const double si = k->sum_f32(n, x), sqi = k->sumsq_f32(n, x);
        th_check(si == INFINITY && sqi == INFINITY, "%s: with +inf last: sum %g sumsq %g", ctx, si,
                 sqi);
        x[0] = NAN;
        const double sn = k->sum_f32(n, x), sqn = k->sumsq_f32(n, x);
        th_check(isnan(sn) && isnan(sqn), "%s: with NaN first: sum %g sumsq %g", ctx, sn, sqn);
    }
}

enum {
    ROW_RANDOM,
    ROW_TIES,
    ROW_EQUAL,
    ROW_ALL_NEG_INF,
    ROW_ALL_NAN,
    ROW_MAX_FIRST,
    ROW_TIE_FIRST_MIDDLE,
    ROW_EXTREMES,
    ROW_SOME_NAN,
    ROW_NEG_INF_THEN_NAN,
    ROW_KINDS
};
static const char *const ROW_NAMES[ROW_KINDS] = {
    "random", "ties", "all equal", "all -inf", "all NaN", "unique max first",
    "tie first and middle", "+-1e30 and +inf", "NaN among values",
    "-inf then a run of NaN"};

static void fill_argmax_row(int kind, int64_t n, float *x) {
    for (int64_t i = 0; i < n; ++i) {
        switch (kind) {
        case ROW_RANDOM: x[i] = th_uniform(-1.0f, 1.0f); break;
        case ROW_TIES: x[i] = (float)th_randint(0, 3); break;
        case ROW_EQUAL: x[i] = 0.5f; break;
        case ROW_ALL_NEG_INF: x[i] = -INFINITY; break;
        case ROW_ALL_NAN: x[i] = NAN; break;
        case ROW_MAX_FIRST: x[i] = i == 0 ? 2.0f : th_uniform(-1.0f, 1.0f); break;
        case ROW_TIE_FIRST_MIDDLE: x[i] = i == 0 || i == n / 2 ? 3.0f : th_uniform(-1.0f, 1.0f); break;
        case ROW_EXTREMES:
            x[i] = i == n / 3 ? INFINITY : i % 4 == 3 ? -INFINITY : th_uniform(-1e30f, 1e30f);
            break;
        case ROW_SOME_NAN: x[i] = i % 5 == 4 ? NAN : th_uniform(-1.0f, 1.0f); break;
        default: x[i] = i < 3 ? -INFINITY : NAN; break; /* all-NaN chunks after the maximum */
        }
    }
}

static void test_argmax(const ggmlopt_kernel_table *k, int64_t ncols, int off) {
    const int64_t nrows = ROW_KINDS;
    float *x = (float *)th_alloc(4, nrows * ncols, off);
    int32_t *out = (int32_t *)th_alloc(4, nrows, off);
    int32_t *outs = (int32_t *)th_alloc(4, nrows, 0);
    for (int r = 0; r < ROW_KINDS; ++r) fill_argmax_row(r, ncols, x + r * ncols);
    for (int r = 0; r < ROW_KINDS; ++r) out[r] = outs[r] = -7;

    k->argmax_rows_f32(nrows, ncols, x, out);
    SCALAR->argmax_rows_f32(nrows, ncols, x, outs);
    for (int r = 0; r < ROW_KINDS; ++r) {
        const int32_t want = th_argmax_ref(ncols, x + r * ncols);
        th_check(out[r] == want, "argmax_rows_f32[%s] ncols=%lld off=%d row '%s': %d, want %d",
                 k->name, (long long)ncols, off, ROW_NAMES[r], out[r], want);
        if (k != SCALAR)
            th_check(out[r] == outs[r],
                     "argmax_rows_f32[%s] ncols=%lld off=%d row '%s': %d, scalar path %d", k->name,
                     (long long)ncols, off, ROW_NAMES[r], out[r], outs[r]);
    }
}

static void test_count_equal(const ggmlopt_kernel_table *k, int64_t n, int off) {
    int32_t *a = (int32_t *)th_alloc(4, n, off), *b = (int32_t *)th_alloc(4, n, off);
    int64_t want = 0;
    for (int64_t i = 0; i < n; ++i) {
        a[i] = (int32_t)th_randint(0, 3);
        b[i] = (int32_t)th_randint(0, 3);
        if (i % 7 == 3) a[i] = b[i] = INT32_MIN;
        if (i % 11 == 5) a[i] = INT32_MAX, b[i] = -1;
        want += a[i] == b[i];
    }
    const int64_t got = k->count_equal_i32(n, a, b);
    th_check(got == want, "count_equal_i32[%s] n=%lld off=%d: %lld, want %lld", k->name,
             (long long)n, off, (long long)got, (long long)want);
}

/* ---- losses ------------------------------------------------------------- */

enum { CE_SOFT, CE_ONE_HOT_NEG_INF, CE_EQUAL, CE_LARGE, CE_ROWS };

static void fill_ce_row(int kind, int64_t n, float *x, float *l) {
    const int64_t hot = n > 0 ? th_randint(0, n) : 0;
    double total = 0.0;
    for (int64_t i = 0; i < n; ++i) {
        switch (kind) {
        case CE_SOFT:
            x[i] = th_uniform(-5.0f, 5.0f);
            l[i] = th_uniform(0.0f, 1.0f);
            total += l[i];
            break;
        case CE_ONE_HOT_NEG_INF: /* -inf logits where the label is 0 */
            x[i] = i % 3 == 2 && i != hot ? -INFINITY : th_uniform(-5.0f, 5.0f);
            l[i] = i == hot ? 1.0f : 0.0f;
            break;
        case CE_EQUAL:
            x[i] = 2.5f;
            l[i] = 1.0f / (float)n;
            break;
        default: /* logits of 1e30 next to -1e30 and 0: a naive exp overflows */
            x[i] = i % 3 == 0 ? 1e30f : i % 3 == 1 ? -1e30f : 0.0f;
            l[i] = i == 0 ? 1.0f : 0.0f;
            break;
        }
    }
    if (kind == CE_SOFT)
        for (int64_t i = 0; i < n; ++i) l[i] = (float)(l[i] / total);
}

static void check_cross_entropy(const ggmlopt_kernel_table *k, int64_t nrows, int64_t ncols,
                                const float *x, const float *l, int off, const char *ctx) {
    const float gs = 0.7f;
    const int64_t total = nrows * ncols;
    float *grad = th_rand_f32(total, off, -9.0f, 9.0f);
    float *grads = th_rand_f32(total, 0, -9.0f, 9.0f);
    double *gwant = (double *)th_alloc(8, total, 0), *gscale = (double *)th_alloc(8, total, 0);
    const float *x0 = th_dup(x, 4, total), *l0 = th_dup(l, 4, total);

    const double loss = k->cross_entropy_rows_f32(nrows, ncols, x, l, grad, gs);
    const double loss_nograd = k->cross_entropy_rows_f32(nrows, ncols, x, l, NULL, gs);
    const double loss_s = SCALAR->cross_entropy_rows_f32(nrows, ncols, x, l, grads, gs);

    double want = 0.0, scale = 0.0;
    for (int64_t r = 0; r < nrows; ++r) {
        double s;
        want += th_cross_entropy_row_ref(ncols, x + r * ncols, l + r * ncols, gs, &s,
                                         gwant + r * ncols, gscale + r * ncols);
        scale += s;
    }
    const double tol = RTOL_EXP * scale + 1e-30;
    th_check(th_near(loss, want, tol), "%s: loss = %.9g, want %.9g", ctx, loss, want);
    th_check(th_near(loss_nograd, loss, RTOL_SUM * scale + 1e-30),
             "%s: loss without grad = %.17g, with grad %.17g", ctx, loss_nograd, loss);
    if (k != SCALAR)
        th_check(th_near(loss, loss_s, RTOL_PATHS * scale + 1e-30),
                 "%s: loss = %.9g, scalar path %.9g", ctx, loss, loss_s);

    th_miss ref = TH_MISS_INIT, cross = TH_MISS_INIT;
    for (int64_t i = 0; i < total; ++i) {
        /* 1e-37: exp underflow below -87 (the kernels flush there) */
        th_expect(&ref, "grad", i, grad[i], gwant[i], RTOL_EXP * gscale[i] + 1e-37);
        th_expect_bits(&ref, "logits (an input, changed)", i, x[i], x0[i]);
        th_expect_bits(&ref, "labels (an input, changed)", i, l[i], l0[i]);
        th_expect(&cross, "grad vs scalar", i, grad[i], grads[i], RTOL_PATHS * gscale[i] + 1e-37);
    }
    report(k, &ref, &cross, ctx);
}

static void test_cross_entropy(const ggmlopt_kernel_table *k, int64_t ncols, int off) {
    char ctx[160];
    CTX(ctx, "cross_entropy_rows_f32", k, ncols, off, " (n: ncols; rows soft, one-hot/-inf, equal, 1e30)");
    float *x = (float *)th_alloc(4, CE_ROWS * ncols, off), *l = (float *)th_alloc(4, CE_ROWS * ncols, off);
    for (int r = 0; r < CE_ROWS; ++r) fill_ce_row(r, ncols, x + r * ncols, l + r * ncols);
    check_cross_entropy(k, CE_ROWS, ncols, x, l, off, ctx);
}

/* Many rows of a narrow width: the vector paths take them GO_EPR at a time, the
 * leftover rows one by one. */
static void test_cross_entropy_rows(const ggmlopt_kernel_table *k, int64_t ncols, int off) {
    enum { NROWS = 35 }; /* two blocks of 16 rows and leftovers */
    if (ncols > 33) return;
    char ctx[160];
    CTX(ctx, "cross_entropy_rows_f32", k, ncols, off, " (n: ncols; up to 34 rows of the four kinds)");
    float *x = (float *)th_alloc(4, NROWS * ncols, off), *l = (float *)th_alloc(4, NROWS * ncols, off);
    for (int r = 0; r < NROWS; ++r) fill_ce_row((r * 3) % CE_ROWS, ncols, x + r * ncols, l + r * ncols);
    for (int64_t rows = 1; rows <= NROWS; rows += rows < 9 ? 1 : 5)
        check_cross_entropy(k, rows, ncols, x, l, off, ctx);
}

/* The class-index kernel against the one-hot kernel of the same path (the
 * labels expanded), and against the scalar path: rows of every kind, with the
 * class at random, at the first and at the last column. */
static void test_cross_entropy_index(const ggmlopt_kernel_table *k, int64_t ncols, int off) {
    enum { NROWS = 35 }; /* two blocks of 16 rows and leftovers */
    if (ncols == 0) return;
    char ctx[160];
    CTX(ctx, "cross_entropy_index_rows_f32", k, ncols, off, " (n: ncols; vs one-hot)");
    const float gs = 0.7f;
    const int64_t total = NROWS * ncols;
    float *x = (float *)th_alloc(4, total, off), *l = (float *)th_alloc(4, total, 0);
    int32_t *c = (int32_t *)th_alloc(4, NROWS, off);
    for (int r = 0; r < NROWS; ++r) {
        fill_ce_row(r % CE_ROWS, ncols, x + r * ncols, l + r * ncols);
        c[r] = r % 4 == 1 ? 0 : r % 4 == 2 ? (int32_t)(ncols - 1) : (int32_t)th_randint(0, ncols);
        if (r % CE_ROWS == CE_ONE_HOT_NEG_INF) x[r * ncols + c[r]] = th_uniform(-5.0f, 5.0f);
        if (r % 7 == 3) c[r] = -1; /* a masked row: no loss (as a zero label row), no gradient */
        for (int64_t i = 0; i < ncols; ++i) l[r * ncols + i] = i == c[r] ? 1.0f : 0.0f;
    }
    const float *x0 = th_dup(x, 4, total);
    for (int64_t rows = 1; rows <= NROWS; rows += rows < 9 ? 1 : 5) {
        const int64_t n = rows * ncols;
        float *g = th_rand_f32(n, off, -9.0f, 9.0f), *gh = th_rand_f32(n, 0, -9.0f, 9.0f);
        float *gs_ = th_rand_f32(n, 0, -9.0f, 9.0f);
        const double loss = k->cross_entropy_index_rows_f32(rows, ncols, x, c, g, gs);
        const double loss_nograd = k->cross_entropy_index_rows_f32(rows, ncols, x, c, NULL, gs);
        const double loss_hot = k->cross_entropy_rows_f32(rows, ncols, x, l, gh, gs);
        const double loss_s = SCALAR->cross_entropy_index_rows_f32(rows, ncols, x, c, gs_, gs);
        const double scale = fabs(loss_hot) + (double)rows;
        th_check(th_near(loss, loss_hot, RTOL_EXP * scale), "%s rows=%lld: loss = %.9g, one-hot %.9g",
                 ctx, (long long)rows, loss, loss_hot);
        th_check(th_near(loss_nograd, loss, RTOL_SUM * scale),
                 "%s rows=%lld: loss without grad = %.17g, with grad %.17g", ctx, (long long)rows,
                 loss_nograd, loss);
        if (k != SCALAR)
            th_check(th_near(loss, loss_s, RTOL_PATHS * scale), "%s rows=%lld: loss = %.9g, scalar %.9g",
                     ctx, (long long)rows, loss, loss_s);
        th_miss ref = TH_MISS_INIT, cross = TH_MISS_INIT;
        for (int64_t i = 0; i < n; ++i) {
            if (c[i / ncols] < 0)
                th_expect_bits(&ref, "grad of a masked row", i, g[i], 0.0f);
            else
                th_expect(&ref, "grad vs one-hot", i, g[i], gh[i], RTOL_EXP * gs + 1e-37);
            th_expect_bits(&ref, "logits (an input, changed)", i, x[i], x0[i]);
            th_expect(&cross, "grad vs scalar", i, g[i], gs_[i], RTOL_PATHS * gs + 1e-37);
        }
        /* in place: the gradient written over the logits, the same loss and bits */
        float *xg = th_dup(x, 4, n);
        const double loss_in_place = k->cross_entropy_index_rows_f32(rows, ncols, xg, c, xg, gs);
        th_check(loss_in_place == loss, "%s rows=%lld: loss in place = %.17g, apart %.17g", ctx,
                 (long long)rows, loss_in_place, loss);
        for (int64_t i = 0; i < n; ++i) th_expect_bits(&ref, "grad in place", i, xg[i], g[i]);
        /* the gradient as bf16 bits: the float32 one's values rounded, the same loss */
        uint16_t *g16 = (uint16_t *)th_alloc(2, n, off), *want16 = (uint16_t *)th_alloc(2, n, 0);
        for (int64_t i = 0; i < n; ++i) g16[i] = 0x7fc1;  /* a NaN each cell must replace */
        k->convert_f32_bf16(n, g, want16);
        const double loss16 = k->cross_entropy_index_rows_g16_f32(rows, ncols, x, c, g16, gs,
                                                                  NULL, NULL);
        th_check(loss16 == loss, "%s rows=%lld: loss with a bf16 gradient = %.17g, float32 %.17g",
                 ctx, (long long)rows, loss16, loss);
        for (int64_t i = 0; i < n; ++i) {
            th_expect_bits(&ref, "bf16 grad vs the float32 one rounded", i,
                           (float)g16[i], (float)want16[i]);
            th_expect_bits(&ref, "logits (an input, changed by the bf16 call)", i, x[i], x0[i]);
        }
        /* with each row's argmax known and the exponentials kept in scratch: the
         * same loss and bits */
        int32_t *amax = (int32_t *)th_alloc(4, rows, 0);
        float *keep = (float *)th_alloc(4, ncols, off);
        k->argmax_rows_f32(rows, ncols, x, amax);
        for (int64_t i = 0; i < n; ++i) g16[i] = 0x7fc1;
        const double loss16k = k->cross_entropy_index_rows_g16_f32(rows, ncols, x, c, g16, gs,
                                                                   amax, keep);
        th_check(loss16k == loss, "%s rows=%lld: loss with argmax and kept exps = %.17g, "
                 "float32 %.17g", ctx, (long long)rows, loss16k, loss);
        for (int64_t i = 0; i < n; ++i)
            th_expect_bits(&ref, "bf16 grad (argmax, kept exps) vs the float32 one rounded", i,
                           (float)g16[i], (float)want16[i]);
        report(k, &ref, &cross, ctx);
    }
}

/* One row of a 32000-word vocabulary. */
static void test_cross_entropy_index_wide(const ggmlopt_kernel_table *k) {
    const int64_t ncols = 32000;
    char ctx[160];
    snprintf(ctx, sizeof ctx, "cross_entropy_index_rows_f32[%s] one row of %lld", k->name,
             (long long)ncols);
    float *x = (float *)th_alloc(4, ncols, 0), *l = (float *)th_alloc(4, ncols, 0);
    float *g = (float *)th_alloc(4, ncols, 0), *gh = (float *)th_alloc(4, ncols, 0);
    fill_ce_row(CE_SOFT, ncols, x, l);
    const int32_t c = 31999;
    for (int64_t i = 0; i < ncols; ++i) l[i] = i == c ? 1.0f : 0.0f;
    const double loss = k->cross_entropy_index_rows_f32(1, ncols, x, &c, g, 1.0f);
    const double loss_hot = k->cross_entropy_rows_f32(1, ncols, x, l, gh, 1.0f);
    th_check(th_near(loss, loss_hot, RTOL_EXP * fabs(loss_hot)), "%s: loss = %.9g, one-hot %.9g",
             ctx, loss, loss_hot);
    th_miss ref = TH_MISS_INIT;
    for (int64_t i = 0; i < ncols; ++i) th_expect(&ref, "grad vs one-hot", i, g[i], gh[i], 1e-9);
    uint16_t *g16 = (uint16_t *)th_alloc(2, ncols, 0), *want16 = (uint16_t *)th_alloc(2, ncols, 0);
    k->convert_f32_bf16(ncols, g, want16);
    int32_t amax = 0;
    k->argmax_rows_f32(1, ncols, x, &amax);
    float *keep = (float *)th_alloc(4, ncols, 0);
    for (int pass = 0; pass < 2; ++pass) {   /* recomputed, then argmax and kept exps */
        const double loss16 = k->cross_entropy_index_rows_g16_f32(
            1, ncols, x, &c, g16, 1.0f, pass ? &amax : NULL, pass ? keep : NULL);
        th_check(loss16 == loss, "%s pass %d: loss with a bf16 gradient = %.17g, float32 %.17g",
                 ctx, pass, loss16, loss);
        for (int64_t i = 0; i < ncols; ++i)
            th_expect_bits(&ref, "bf16 grad vs the float32 one rounded", i, (float)g16[i],
                           (float)want16[i]);
    }
    th_report(&ref, ctx);
}

static void test_squared_error(const ggmlopt_kernel_table *k, int64_t n, int off) {
    char ctx[160];
    CTX(ctx, "squared_error_f32", k, n, off, "");
    const float gs = 0.5f;
    float *out = th_rand_f32(n, off, -2.0f, 2.0f), *lab = th_rand_f32(n, off, -2.0f, 2.0f);
    float *grad = th_rand_f32(n, off, -9.0f, 9.0f), *grads = th_rand_f32(n, 0, -9.0f, 9.0f);

    const double loss = k->squared_error_f32(n, out, lab, grad, gs);
    const double loss_nograd = k->squared_error_f32(n, out, lab, NULL, gs);
    const double loss_s = SCALAR->squared_error_f32(n, out, lab, grads, gs);

    double want = 0.0;
    th_miss ref = TH_MISS_INIT, cross = TH_MISS_INIT;
    for (int64_t i = 0; i < n; ++i) {
        const double d = (double)out[i] - lab[i];
        want += d * d;
        th_expect(&ref, "grad", i, grad[i], 2.0 * d * gs, RTOL_ROUND * fabs(2.0 * d * gs));
        th_expect(&cross, "grad vs scalar", i, grad[i], grads[i], RTOL_PATHS * fabs(2.0 * d * gs));
    }
    /* d is rounded to float before squaring: 2 ulp of each term */
    const double tol = 3e-7 * want + 1e-300;
    th_check(th_near(loss, want, tol), "%s: loss = %.17g, want %.17g", ctx, loss, want);
    th_check(th_near(loss_nograd, loss, RTOL_SUM * want + 1e-300),
             "%s: loss without grad = %.17g, with grad %.17g", ctx, loss_nograd, loss);
    if (k != SCALAR)
        th_check(th_near(loss, loss_s, RTOL_SUM * want + 1e-300), "%s: loss = %.17g, scalar %.17g",
                 ctx, loss, loss_s);
    report(k, &ref, &cross, ctx);
}

/* ---- conversions ---------------------------------------------------------- */

static void test_convert_u8(const ggmlopt_kernel_table *k, int64_t n, int off, float scale) {
    char ctx[160], tag[32];
    snprintf(tag, sizeof tag, " scale=%g", scale);
    CTX(ctx, "convert_u8_f32", k, n, off, tag);
    uint8_t *src = (uint8_t *)th_alloc(1, n, off);
    for (int64_t i = 0; i < n; ++i) src[i] = (uint8_t)th_randint(0, 256);
    if (n > 0) src[0] = 255, src[n - 1] = 0;
    if (n > 2) src[n / 2] = 255, src[n / 2 - 1] = 0;
    float *dst = th_rand_f32(n, off, -1.0f, 1.0f);
    k->convert_u8_f32(n, src, dst, scale);
    th_miss ref = TH_MISS_INIT;
    for (int64_t i = 0; i < n; ++i) th_expect_bits(&ref, "dst", i, dst[i], (float)(src[i] * (double)scale));
    th_report(&ref, ctx);
}

static const uint16_t F16_SPECIALS[] = {
    0x0000, 0x8000, /* +-0 */
    0x0001, 0x8001, 0x03ff, 0x0200, /* subnormals */
    0x0400, 0x3c00, 0xbc00, 0x7bff, 0xfbff, /* smallest normal, +-1, +-max */
    0x7c00, 0xfc00, /* +-inf */
    0x7e00, 0xfe00, 0x7c01, 0x7fff, /* NaNs, quiet and signalling */
};
#define NF16_SPECIALS ((int)(sizeof(F16_SPECIALS) / sizeof(F16_SPECIALS[0])))

static void check_f16(const ggmlopt_kernel_table *k, int64_t n, const uint16_t *src, float *dst,
                      float scale, const char *ctx) {
    k->convert_f16_f32(n, src, dst, scale);
    th_miss ref = TH_MISS_INIT;
    for (int64_t i = 0; i < n; ++i) {
        const double v = th_f16_to_double(src[i]);
        /* an f16 times a float is exact in double, so this is the rounded product */
        th_expect_bits(&ref, "dst", i, dst[i], (float)(v * scale));
    }
    th_report(&ref, ctx);
}

static void test_convert_f16(const ggmlopt_kernel_table *k, int64_t n, int off, float scale) {
    char ctx[160], tag[32];
    snprintf(tag, sizeof tag, " scale=%g", scale);
    CTX(ctx, "convert_f16_f32", k, n, off, tag);
    uint16_t *src = (uint16_t *)th_alloc(2, n, off);
    for (int64_t i = 0; i < n; ++i)
        src[i] = i % 3 == 1 ? F16_SPECIALS[th_randint(0, NF16_SPECIALS)] : (uint16_t)th_next();
    float *dst = th_rand_f32(n, off, -1.0f, 1.0f);
    check_f16(k, n, src, dst, scale, ctx);
}

/* Every one of the 65536 halves. */
static void test_convert_f16_exhaustive(const ggmlopt_kernel_table *k) {
    char ctx[160];
    uint16_t *src = (uint16_t *)th_alloc(2, 65536, 0);
    float *dst = (float *)th_alloc(4, 65536, 0);
    for (int64_t i = 0; i < 65536; ++i) src[i] = (uint16_t)i;
    snprintf(ctx, sizeof ctx, "convert_f16_f32[%s] all 65536 halves scale=1", k->name);
    check_f16(k, 65536, src, dst, 1.0f, ctx);
    snprintf(ctx, sizeof ctx, "convert_f16_f32[%s] all 65536 halves scale=-2", k->name);
    check_f16(k, 65536, src, dst, -2.0f, ctx);
}

/* The bfloat16 nearest to x, ties to the even one, found by comparing the two
 * candidates' distances in double (independent of the kernels' bit trick);
 * NaN: a NaN of x's sign. */
static float bf16_nearest(float x) {
    uint32_t u;
    memcpy(&u, &x, 4);
    if (isnan(x)) {
        const uint32_t q = (u & 0x80000000u) | 0x7fc00000u;
        float f;
        memcpy(&f, &q, 4);
        return f;
    }
    if (isinf(x)) return x;
    const uint32_t lo = u & 0xffff0000u, hi = lo + 0x10000u;
    float flo, fhi;
    memcpy(&flo, &lo, 4);
    memcpy(&fhi, &hi, 4);
    /* past the largest finite bf16 the upper candidate is inf, which rounding
     * treats as 2^128, the next step of the exponent */
    const double dlo = fabs((double)x - flo);
    const double dhi = isinf(fhi) ? fabs(fabs((double)x) - 0x1p128) : fabs((double)x - fhi);
    if (dlo < dhi) return flo;
    if (dhi < dlo) return fhi;
    return (lo >> 16) & 1u ? fhi : flo;
}

static void check_bf16(const ggmlopt_kernel_table *k, int64_t n, const float *src,
                       uint16_t *dst, const char *ctx) {
    k->convert_f32_bf16(n, src, dst);
    th_miss ref = TH_MISS_INIT;
    for (int64_t i = 0; i < n; ++i) {
        const uint32_t bits = (uint32_t)dst[i] << 16;
        float got;
        memcpy(&got, &bits, 4);
        th_expect_bits(&ref, "dst", i, got, bf16_nearest(src[i]));
        if (isnan(src[i]) && signbit(got) != signbit(src[i])) th_expect(&ref, "sign", i, 0, 1, 0);
    }
    th_report(&ref, ctx);
}

static void test_convert_bf16(const ggmlopt_kernel_table *k, int64_t n, int off) {
    char ctx[160];
    CTX(ctx, "convert_f32_bf16", k, n, off, "");
    float *src = th_rand_f32(n, off, -3.0f, 3.0f);
    uint16_t *dst = (uint16_t *)th_alloc(2, n, off);
    /* every third value random bits: subnormals, huge values, inf, NaN, ties */
    for (int64_t i = 1; i < n; i += 3) {
        const uint32_t u = (uint32_t)th_next();
        memcpy(&src[i], &u, 4);
    }
    check_bf16(k, n, src, dst, ctx);
}

/* Each of the 65536 upper halves with a lower half below, at and above the tie. */
static void test_convert_bf16_exhaustive(const ggmlopt_kernel_table *k) {
    char ctx[160];
    const int64_t n = 4 * 65536;
    float *src = (float *)th_alloc(4, n, 0);
    uint16_t *dst = (uint16_t *)th_alloc(2, n, 0);
    static const uint32_t low[4] = {0x0000u, 0x7fffu, 0x8000u, 0x8001u};
    for (int64_t i = 0; i < n; ++i) {
        const uint32_t u = ((uint32_t)(i >> 2) << 16) | low[i & 3];
        memcpy(&src[i], &u, 4);
    }
    snprintf(ctx, sizeof ctx, "convert_f32_bf16[%s] every upper half, four lower halves",
             k->name);
    check_bf16(k, n, src, dst, ctx);
}

/* One wide row (a vocabulary): the softmax sums run over many terms. */
static void test_cross_entropy_wide(const ggmlopt_kernel_table *k) {
    const int64_t ncols = 65536;
    char ctx[160];
    snprintf(ctx, sizeof ctx, "cross_entropy_rows_f32[%s] one row of %lld soft labels", k->name,
             (long long)ncols);
    float *x = (float *)th_alloc(4, ncols, 0), *l = (float *)th_alloc(4, ncols, 0);
    fill_ce_row(CE_SOFT, ncols, x, l);
    check_cross_entropy(k, 1, ncols, x, l, 0, ctx);
}

/* ---- driver --------------------------------------------------------------- */

static int collect_tables(const ggmlopt_kernel_table **out) {
    int n = 0;
    out[n++] = &ggmlopt_kernels_scalar;
#if defined(__x86_64__) || defined(_M_X64)
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
        __builtin_cpu_supports("f16c"))
        out[n++] = &ggmlopt_kernels_avx2;
    else
        printf("note: this CPU lacks avx2/fma/f16c: the avx2 table is not tested\n");
    if (ggmlopt_simd_select("avx512") == 0)  /* the dispatcher's cpuid + XGETBV check */
        out[n++] = &ggmlopt_kernels_avx512;
    else
        printf("note: this CPU (or OS) lacks avx512f/bw/dq/vl: the avx512 table is not tested\n");
    ggmlopt_simd_select(NULL);
#endif
#if defined(__aarch64__)
    out[n++] = &ggmlopt_kernels_neon;
#endif
    return n;
}

static void test_table(const ggmlopt_kernel_table *k) {
    th_set_stage("kernel table %s", k->name);
    float adam_small[GGMLOPT_ADAMW_NPARAMS], adam_large[GGMLOPT_ADAMW_NPARAMS];
    th_adamw_params(adam_small, 1e-3f, 0.9f, 0.999f, 1e-8f, 0.01f, 3);
    th_adamw_params(adam_large, 0.05f, 0.8f, 0.99f, 1e-6f, 0.0f, 1);
    for (int s = 0; s < NSIZES; ++s) {
        const int64_t n = SIZES[s];
        for (int off = 0; off <= MAX_OFF; ++off) {
            th_seed(((uint64_t)n << 8) ^ (uint64_t)off ^ 0x5eedULL);
            test_adamw(k, n, off, adam_small, " alpha=1e-3 wd=0.01 t=3");
            test_adamw(k, n, off, adam_large, " alpha=0.05 wd=0 t=1");
            test_sgd(k, n, off);
            test_axpy(k, n, off);
            test_scale_fill(k, n, off);
            test_layer_helpers(k, n, off);
            test_sums(k, n, off);
            test_argmax(k, n, off);
            test_count_equal(k, n, off);
            test_cross_entropy(k, n, off);
            test_cross_entropy_rows(k, n, off);
            test_squared_error(k, n, off);
            test_cross_entropy_index(k, n, off);
            test_convert_u8(k, n, off, 1.0f / 255.0f);
            test_convert_u8(k, n, off, 3.0f);
            test_convert_f16(k, n, off, 1.0f);
            test_convert_f16(k, n, off, 0.5f);
            test_convert_bf16(k, n, off);
            test_activations(k, SCALAR, n, off);
            th_release_all();
        }
    }
    test_convert_f16_exhaustive(k);
    test_convert_bf16_exhaustive(k);
    test_cross_entropy_wide(k);
    test_cross_entropy_index_wide(k);
    th_release_all();
    test_conv_kernels(k);
    test_conv_direct_kernels(k);
    test_activations_sweep(k);
    test_lm_layers(k, SCALAR);
    test_attention_kernels(k, SCALAR);
    test_quant_kernels(k);
    test_gemm_kernels(k);
    test_gemm_thin_bits(k);
    test_gemm_bf16_kernels(k);
}

int main(int argc, char **argv) {
    int64_t big = 300001;
    unsigned timeout = 300;
    for (int i = 1; i < argc; ++i) {
        if (strcmp(argv[i], "--big") == 0 && i + 1 < argc) {
            big = atoll(argv[++i]);
        } else if (strcmp(argv[i], "--timeout") == 0 && i + 1 < argc) {
            timeout = (unsigned)atoi(argv[++i]);
        } else {
            fprintf(stderr, "usage: %s [--big N] [--timeout S]\n", argv[0]);
            return 2;
        }
    }
    th_start_watchdog(timeout);
    const ggmlopt_kernel_table *tables[8];
    const int ntables = collect_tables(tables);
    printf("kernel tables under test:");
    for (int t = 0; t < ntables; ++t) printf(" %s", tables[t]->name);
    printf("\n");
    for (int t = 0; t < ntables; ++t) test_table(tables[t]);

    test_public_api(big);
    test_conv_public_api();
    test_conv_direct_public_api();
    test_activations_public(big);
    test_lm_layers_public();
    test_attention_public();
    test_attention_public_waves();
    test_quant_public();
    test_quantize_k();
    test_decode_block_public();
    test_gemm_public();
    test_gemm_bf16_public();
    test_matmul_columns_public();

    printf("%d passed, %d failed\n", th_passed, th_failed);
    return th_failed ? 1 : 0;
}
