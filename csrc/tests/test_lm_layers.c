/*
 * The language-model layer kernels (kernels/embedding.inc, norm.inc, glu.inc)
 * of one dispatch table against float64 references, on awkward row lengths,
 * unaligned arrays that end where their allocation ends, and rows of NaN, inf,
 * huge and tiny values; on the other paths, also against the scalar path.
 * Then the public entry points: the same bits on 1 and 2 threads.
 * Bounds as in tests/test_kernels_norm.py and tests/test_kernels_glu.py.
 */
#include <float.h>

#include "harness.h"

#define TINY 1.401298464324817e-45 /* 2^-149 */
#define EPS32 1.1920928955078125e-07
#define RTOL_PATHS 1e-5

static const int64_t DIMS[] = {1, 2, 7, 8, 9, 16, 17, 33, 100};
#define NDIMS ((int)(sizeof(DIMS) / sizeof(DIMS[0])))
static const int64_t NROWS[] = {1, 3, 70};
#define NNROWS ((int)(sizeof(NROWS) / sizeof(NROWS[0])))

/* Rows of N(0,1)-ish values, and from row 0 on (when there are 6 rows or more):
 * a NaN, an inf, huge values, tiny values, a constant row, a -inf. */
static float *norm_input(int64_t nrows, int64_t dim, int off, float shift) {
    float *x = th_rand_f32(nrows * dim, off, -3.0f, 3.0f);
    for (int64_t i = 0; i < nrows * dim; ++i) x[i] += shift;
    if (nrows >= 6) {
        x[0] = NAN;
        x[dim + dim / 2] = INFINITY;
        for (int64_t j = 0; j < dim; ++j) {
            x[2 * dim + j] *= 1e30f;
            x[3 * dim + j] *= 1e-30f;
            x[4 * dim + j] = 2.5f;
        }
        x[6 * dim - 1] = -INFINITY;
    }
    return x;
}

/* mean (0 for RMSNorm) and rstd of one row, in double */
static void row_stats(const float *x, int64_t dim, int layer, double eps, double *mean,
                      double *rstd) {
    double s = 0.0, q = 0.0;
    for (int64_t j = 0; j < dim; ++j) s += x[j];
    const double m = layer ? s / (double)dim : 0.0;
    for (int64_t j = 0; j < dim; ++j) q += (x[j] - m) * (x[j] - m);
    *mean = m;
    *rstd = 1.0 / sqrt(q / (double)dim + eps);
}

static void test_norm(const ggmlopt_kernel_table *k, const ggmlopt_kernel_table *scalar,
                      int layer, int with_bias, int64_t nrows, int64_t dim, int off) {
    const float eps = layer ? 1e-5f : 1e-6f;
    const int64_t n = nrows * dim;
    float *x = norm_input(nrows, dim, off, layer ? 5.0f : 0.0f);
    float *w = th_rand_f32(dim, off, -2.0f, 2.0f);
    float *b = with_bias ? th_rand_f32(dim, off, -1.0f, 1.0f) : NULL;
    float *dy = th_rand_f32(n, off, -1.0f, 1.0f);
    float *y = th_alloc(4, n, off), *mean = th_alloc(4, nrows, off), *rstd = th_alloc(4, nrows, off);
    float *dx = th_alloc(4, n, off);
    float *dw0 = th_rand_f32(dim, off, -1.0f, 1.0f), *db0 = th_rand_f32(dim, off, -1.0f, 1.0f);
    float *dw = th_dup(dw0, 4, dim), *db = th_dup(db0, 4, dim);
    if (layer) {
        k->layernorm_f32(nrows, dim, x, w, b, eps, y, mean, rstd);
    } else {
        k->rmsnorm_f32(nrows, dim, x, w, eps, y, rstd);
    }
    const float *saved_mean = layer ? mean : NULL;
    double *pw = th_alloc(8, dim, 0), *pb = th_alloc(8, dim, 0);
    float *acc = th_alloc(4, 2 * dim, 0);
    k->norm_backward_f32(nrows, dim, x, w, saved_mean, rstd, dy, dx, pw, pb, acc);
    for (int64_t j = 0; j < dim; ++j) {
        dw[j] += (float)pw[j];
        db[j] += (float)pb[j];
    }

    th_miss m = TH_MISS_INIT;
    double *tw = calloc((size_t)dim, sizeof(double)), *sw = calloc((size_t)dim, sizeof(double));
    double *tb = calloc((size_t)dim, sizeof(double)), *sb = calloc((size_t)dim, sizeof(double));
    for (int64_t r = 0; r < nrows; ++r) {
        const float *xr = x + r * dim;
        double mu, rs;
        row_stats(xr, dim, layer, eps, &mu, &rs);
        th_expect(&m, "rstd", r, rstd[r], rs, 4e-7 * fabs(rs));
        if (layer) th_expect(&m, "mean", r, mean[r], mu, 2e-7 * fabs(mu));
        /* the backward passes from the saved (float) statistics */
        const double fm = layer ? mean[r] : 0.0, frs = rstd[r];
        double sg = 0.0, sgx = 0.0, sag = 0.0, sagx = 0.0;
        for (int64_t j = 0; j < dim; ++j) {
            const double ref = (xr[j] - mu) * rs * w[j] + (b ? b[j] : 0.0);
            const double tol = 2e-6 * fabs(ref) + 2e-7 * fabs(mu * rs * w[j]) +
                               (b ? 2e-7 * fabs(b[j]) : 0.0) + 1e-37;
            th_expect(&m, "y", r * dim + j, y[r * dim + j], ref, tol);
            const double g = (double)dy[r * dim + j] * w[j], xh = (xr[j] - fm) * frs;
            sg += g;
            sgx += g * xh;
            sag += fabs(g);
            sagx += fabs(g * xh);
            tw[j] += dy[r * dim + j] * xh;
            sw[j] += fabs(dy[r * dim + j] * xh);
            tb[j] += dy[r * dim + j];
            sb[j] += fabs(dy[r * dim + j]);
        }
        for (int64_t j = 0; j < dim; ++j) {
            const double g = (double)dy[r * dim + j] * w[j], xh = (xr[j] - fm) * frs;
            const double a = layer ? sg / (double)dim : 0.0;
            const double ref = frs * (g - a - xh * sgx / (double)dim);
            const double scale = fabs(frs) * (fabs(g) + (layer ? sag / (double)dim : 0.0) +
                                              fabs(xh) * sagx / (double)dim);
            th_expect(&m, "dx", r * dim + j, dx[r * dim + j], ref, 4e-6 * scale + 1e-37);
        }
    }
    for (int64_t j = 0; j < dim; ++j) {
        th_expect(&m, "dw", j, dw[j], dw0[j] + tw[j], 1e-5 * (fabs(dw0[j]) + sw[j]) + 1e-37);
        th_expect(&m, "db", j, db[j], db0[j] + tb[j], 1e-5 * (fabs(db0[j]) + sb[j]));
    }
    char ctx[160];
    snprintf(ctx, sizeof ctx, "%s[%s] nrows=%lld dim=%lld off=%d%s", layer ? "layernorm" : "rmsnorm",
             k->name, (long long)nrows, (long long)dim, off, b ? " bias" : "");
    th_report(&m, ctx);

    if (k != scalar) { /* the same computation on the scalar path */
        float *y2 = th_alloc(4, n, off), *mean2 = th_alloc(4, nrows, off);
        float *rstd2 = th_alloc(4, nrows, off), *dx2 = th_alloc(4, n, off);
        float *dw2 = th_dup(dw0, 4, dim), *db2 = th_dup(db0, 4, dim);
        if (layer) {
            scalar->layernorm_f32(nrows, dim, x, w, b, eps, y2, mean2, rstd2);
        } else {
            scalar->rmsnorm_f32(nrows, dim, x, w, eps, y2, rstd2);
        }
        scalar->norm_backward_f32(nrows, dim, x, w, saved_mean, rstd, dy, dx2, pw, pb, acc);
        for (int64_t j = 0; j < dim; ++j) {
            dw2[j] += (float)pw[j];
            db2[j] += (float)pb[j];
        }
        th_miss c = TH_MISS_INIT;
        for (int64_t i = 0; i < n; ++i) {
            th_expect(&c, "y vs scalar", i, y[i], y2[i], RTOL_PATHS * fabs(y2[i]) + 1e-30);
            th_expect(&c, "dx vs scalar", i, dx[i], dx2[i], RTOL_PATHS * (fabs(dx2[i]) + 1.0));
        }
        for (int64_t j = 0; j < dim; ++j)
            th_expect(&c, "dw vs scalar", j, dw[j], dw2[j], RTOL_PATHS * (fabs(dw0[j]) + sw[j]));
        th_report(&c, ctx);
    }
    free(tw);
    free(sw);
    free(tb);
    free(sb);
}

/* the parameter sums alone (dx NULL) are those of the full pass, and dx
 * alone (pw NULL) is that of the full pass */
static void test_norm_parts(const ggmlopt_kernel_table *k) {
    const int64_t nrows = 130, dim = 77;
    float *x = th_rand_f32(nrows * dim, 1, -2.0f, 2.0f), *dy = th_rand_f32(nrows * dim, 2, -1.0f, 1.0f);
    float *mean = th_rand_f32(nrows, 0, -0.5f, 0.5f), *rstd = th_rand_f32(nrows, 0, 0.5f, 2.0f);
    float *w = th_rand_f32(dim, 0, -1.0f, 1.0f), *acc = th_alloc(4, 2 * dim, 0);
    float *dx1 = th_alloc(4, nrows * dim, 0), *dx2 = th_alloc(4, nrows * dim, 0);
    double *pw1 = th_alloc(8, dim, 0), *pb1 = th_alloc(8, dim, 0);
    double *pw2 = th_alloc(8, dim, 0), *pb2 = th_alloc(8, dim, 0);
    k->norm_backward_f32(nrows, dim, x, w, mean, rstd, dy, dx1, pw1, pb1, acc);
    k->norm_backward_f32(nrows, dim, x, w, mean, rstd, dy, NULL, pw2, pb2, acc);
    k->norm_backward_f32(nrows, dim, x, w, mean, rstd, dy, dx2, NULL, NULL, NULL);
    th_miss m = TH_MISS_INIT;
    for (int64_t j = 0; j < dim; ++j) {
        th_expect(&m, "dw without dx", j, pw2[j], pw1[j], 0.0);
        th_expect(&m, "db without dx", j, pb2[j], pb1[j], 0.0);
    }
    for (int64_t i = 0; i < nrows * dim; ++i) th_expect_bits(&m, "dx without dw", i, dx2[i], dx1[i]);
    char ctx[96];
    snprintf(ctx, sizeof ctx, "norm_backward[%s] parts alone", k->name);
    th_report(&m, ctx);
}

static void test_embedding(const ggmlopt_kernel_table *k, int64_t dim, int off) {
    const int64_t num = 13, n = 40;
    float *w = th_rand_f32(num * dim, off, -2.0f, 2.0f);
    int32_t *ids = th_alloc(4, n, off);
    for (int64_t i = 0; i < n; ++i) ids[i] = (int32_t)th_randint(0, num);
    ids[1] = ids[2] = ids[7] = 3; /* repeats */
    w[3 * dim] = NAN;
    w[5 * dim + dim - 1] = INFINITY;
    float *out = th_alloc(4, n * dim, off), *g = th_rand_f32(n * dim, off, -1.0f, 1.0f);
    g[0] = 3e38f;
    g[dim] = 3e38f; /* may overflow to inf when two land on one row */
    float *gw = th_rand_f32(num * dim, off, -1.0f, 1.0f);
    float *want = th_dup(gw, 4, num * dim), *split = th_dup(gw, 4, num * dim);
    k->embedding_f32(n, dim, ids, w, out);
    k->embedding_backward_f32(n, dim, ids, g, 0, num, gw);
    k->embedding_backward_f32(n, dim, ids, g, 0, 4, split);
    k->embedding_backward_f32(n, dim, ids, g, 4, num, split);
    for (int64_t i = 0; i < n; ++i)
        for (int64_t j = 0; j < dim; ++j) want[ids[i] * dim + j] += g[i * dim + j];
    th_miss m = TH_MISS_INIT;
    for (int64_t i = 0; i < n; ++i)
        for (int64_t j = 0; j < dim; ++j)
            th_expect_bits(&m, "out", i * dim + j, out[i * dim + j], w[ids[i] * dim + j]);
    for (int64_t i = 0; i < num * dim; ++i) {
        th_expect_bits(&m, "grad_weight", i, gw[i], want[i]);
        th_expect_bits(&m, "grad_weight split rows", i, split[i], want[i]);
    }
    char ctx[96];
    snprintf(ctx, sizeof ctx, "embedding[%s] dim=%lld off=%d", k->name, (long long)dim, off);
    th_report(&m, ctx);
}

static double sigmoid64(double v) {
    const double e = exp(-fabs(v));
    return v >= 0 ? 1.0 / (1.0 + e) : e / (1.0 + e);
}

static void test_swiglu(const ggmlopt_kernel_table *k, const ggmlopt_kernel_table *scalar,
                        int64_t n, int off) {
    float *g = th_rand_f32(n, off, -30.0f, 30.0f), *u = th_rand_f32(n, off, -3.0f, 3.0f);
    float *dh = th_rand_f32(n, off, -2.0f, 2.0f);
    static const float special[] = {INFINITY, -INFINITY, NAN, 0.0f, -0.0f, 100.0f, -100.0f,
                                    -90.0f, 1e-30f};
    for (int64_t i = 0; i < n && i < 9; ++i) g[i] = special[i];
    float *h = th_alloc(4, n, off), *dg = th_alloc(4, n, off), *du = th_alloc(4, n, off);
    k->swiglu_f32(n, g, u, h);
    k->swiglu_backward_f32(n, g, u, dh, dg, du);
    th_miss m = TH_MISS_INIT;
    for (int64_t i = 0; i < n; ++i) {
        const double gv = g[i], s = sigmoid64(gv), c = sigmoid64(-gv);
        const double gf = gv > FLT_MAX ? FLT_MAX : gv < -FLT_MAX ? -FLT_MAX : gv;
        const double silu = isinf(gv) && gv < 0 ? 0.0 : gv * s;
        const double sub = isfinite(gv) ? 2 * TINY * fabs(gv) : 0.0;
        const double hr = silu * u[i];
        th_expect(&m, "h", i, h[i], hr, 8 * EPS32 * fabs(hr) + sub * fabs(u[i]) + 4 * TINY);
        const double dgr = dh[i] * (double)u[i] * s * (1.0 + gf * c);
        const double dgs = fabs(dh[i] * (double)u[i]) * s * (1.0 + fabs(gf) * c);
        th_expect(&m, "grad_gate", i, dg[i], dgr,
                  12 * EPS32 * dgs + sub * fabs(dh[i] * (double)u[i]) + 4 * TINY);
        const double dur = dh[i] * silu;
        th_expect(&m, "grad_up", i, du[i], dur, 8 * EPS32 * fabs(dur) + sub * fabs(dh[i]) + 4 * TINY);
    }
    char ctx[96];
    snprintf(ctx, sizeof ctx, "swiglu[%s] n=%lld off=%d", k->name, (long long)n, off);
    th_report(&m, ctx);
    if (k != scalar) {
        float *h2 = th_alloc(4, n, off), *dg2 = th_alloc(4, n, off), *du2 = th_alloc(4, n, off);
        scalar->swiglu_f32(n, g, u, h2);
        scalar->swiglu_backward_f32(n, g, u, dh, dg2, du2);
        th_miss c = TH_MISS_INIT;
        for (int64_t i = 0; i < n; ++i) {
            th_expect(&c, "h vs scalar", i, h[i], h2[i], RTOL_PATHS * fabs(h2[i]) + 1e-38);
            th_expect(&c, "grad_gate vs scalar", i, dg[i], dg2[i], RTOL_PATHS * fabs(dg2[i]) + 1e-38);
            th_expect(&c, "grad_up vs scalar", i, du[i], du2[i], RTOL_PATHS * fabs(du2[i]) + 1e-38);
        }
        th_report(&c, ctx);
    }
}

void test_lm_layers(const ggmlopt_kernel_table *k, const ggmlopt_kernel_table *scalar) {
    th_set_stage("language-model layers, table %s", k->name);
    for (int d = 0; d < NDIMS; ++d) {
        for (int off = 0; off <= 3; ++off) {
            th_seed(((uint64_t)DIMS[d] << 8) ^ (uint64_t)off ^ 0x1a7e5ULL);
            for (int r = 0; r < NNROWS; ++r) {
                test_norm(k, scalar, 0, 0, NROWS[r], DIMS[d], off);
                test_norm(k, scalar, 1, 1, NROWS[r], DIMS[d], off);
                test_norm(k, scalar, 1, 0, NROWS[r], DIMS[d], off);
            }
            test_embedding(k, DIMS[d], off);
            test_swiglu(k, scalar, DIMS[d], off);
            th_release_all();
        }
    }
    test_swiglu(k, scalar, 4099, 1);
    test_norm_parts(k);
    th_release_all();
}

/* The public entry points: the same bits on 1 and 2 threads. */
void test_lm_layers_public(void) {
    th_set_stage("language-model layers, public API");
    th_seed(0x1a7e5ULL);
    const int64_t nrows = 2048, dim = 288, n = nrows * dim, num = 1000;
    float *x = th_rand_f32(n, 1, -3.0f, 3.0f), *w = th_rand_f32(dim, 0, -2.0f, 2.0f);
    float *b = th_rand_f32(dim, 0, -1.0f, 1.0f), *dy = th_rand_f32(n, 2, -1.0f, 1.0f);
    float *emb = th_rand_f32(num * dim, 0, -1.0f, 1.0f);
    int32_t *ids = th_alloc(4, nrows, 0);
    for (int64_t i = 0; i < nrows; ++i) ids[i] = (int32_t)th_randint(0, i < 100 ? 3 : num);
    float *res[2][12];
    float *work = th_alloc(4, ggmlopt_norm_backward_work_size(nrows, dim) + 1, 0);
    const int before = ggmlopt_get_num_threads();
    for (int t = 0; t < 2; ++t) {
        ggmlopt_set_num_threads(t + 1);
        float **r = res[t];
        r[0] = th_alloc(4, n, 0);           /* rmsnorm y */
        r[1] = th_alloc(4, nrows, 0);       /* rstd */
        r[2] = th_alloc(4, n, 0);           /* rmsnorm dx */
        r[3] = th_dup(b, 4, dim);           /* rmsnorm dw */
        r[4] = th_alloc(4, n, 0);           /* layernorm y */
        r[5] = th_alloc(4, nrows, 0);       /* mean */
        r[6] = th_alloc(4, nrows, 0);       /* rstd */
        r[7] = th_alloc(4, n, 0);           /* layernorm dx */
        r[8] = th_dup(w, 4, dim);           /* layernorm dw */
        r[9] = th_dup(b, 4, dim);           /* layernorm db */
        r[10] = th_alloc(4, n, 0);          /* embedding out */
        r[11] = th_dup(emb, 4, num * dim);  /* embedding grad */
        ggmlopt_rmsnorm_f32(nrows, dim, x, w, 1e-6f, r[0], r[1]);
        ggmlopt_rmsnorm_backward_f32(nrows, dim, x, w, r[1], dy, r[2], r[3], work);
        ggmlopt_layernorm_f32(nrows, dim, x, w, b, 1e-5f, r[4], r[5], r[6]);
        ggmlopt_layernorm_backward_f32(nrows, dim, x, w, r[5], r[6], dy, r[7], r[8], r[9], work);
        ggmlopt_embedding_f32(nrows, dim, ids, emb, r[10]);
        ggmlopt_embedding_backward_f32(nrows, dim, ids, dy, num, r[11]);
    }
    static const int64_t sizes_mult[12] = {1, 0, 1, -1, 1, 0, 0, 1, -1, -1, 1, -2};
    th_miss m = TH_MISS_INIT;
    for (int a = 0; a < 12; ++a) {
        const int64_t len = sizes_mult[a] == 1 ? n : sizes_mult[a] == 0 ? nrows
                          : sizes_mult[a] == -1 ? dim : num * dim;
        for (int64_t i = 0; i < len; ++i) th_expect_bits(&m, "2 threads vs 1", a * 1000000000LL + i,
                                                         res[1][a][i], res[0][a][i]);
    }
    th_report(&m, "rmsnorm, layernorm, embedding public n=2048x288 threads 1 and 2");

    /* swiglu, and the parameter-gradient-only backward (grad_x NULL) */
    float *h[2], *dg[2], *du[2], *dw[2];
    float *dh = th_rand_f32(n, 3, -2.0f, 2.0f);
    for (int t = 0; t < 2; ++t) {
        ggmlopt_set_num_threads(t + 1);
        h[t] = th_alloc(4, n, 0);
        dg[t] = th_alloc(4, n, 0);
        du[t] = th_alloc(4, n, 0);
        dw[t] = th_dup(b, 4, dim); /* as r[3] was: the same sums land on the same start */
        ggmlopt_swiglu_f32(n, x, dy, h[t]);
        ggmlopt_swiglu_backward_f32(n, x, dy, dh, dg[t], du[t]);
        ggmlopt_rmsnorm_backward_f32(nrows, dim, x, w, res[0][1], dy, NULL, dw[t], work);
    }
    th_miss s = TH_MISS_INIT;
    for (int64_t i = 0; i < n; ++i) {
        th_expect_bits(&s, "h", i, h[1][i], h[0][i]);
        th_expect_bits(&s, "grad_gate", i, dg[1][i], dg[0][i]);
        th_expect_bits(&s, "grad_up", i, du[1][i], du[0][i]);
    }
    for (int64_t j = 0; j < dim; ++j) {
        th_expect_bits(&s, "dw only, 2 threads vs 1", j, dw[1][j], dw[0][j]);
        th_expect_bits(&s, "dw only vs with dx", j, dw[0][j], res[0][3][j]);
    }
    th_report(&s, "swiglu public, rmsnorm dw only, threads 1 and 2");
    ggmlopt_set_num_threads(before);
    th_release_all();
}
