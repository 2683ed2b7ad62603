/*
 * The direct stride-1 convolution and ReLU + max pooling in the C harness:
 * every table's conv2d_direct and weight-gradient kernels against float64
 * references (scratch allocated at the size the sizing helpers give, so a
 * read or write past it is an ASan report), maxpool2d_relu against relu
 * then maxpool2d bit for bit; then the dispatched API (input gradient through
 * the flipped weights, groups of images) against the references with 1 and 2
 * threads, which must agree bit for bit, and a too-small workspace refused.
 */
#include "harness.h"

void test_conv_direct_kernels(const ggmlopt_kernel_table *k);
void test_conv_direct_public_api(void);

/* n, c, o, h, w, kh, kw, ph, pw */
typedef struct { int64_t n, c, o, h, w, kh, kw, ph, pw; } direct_case;

static const direct_case DCASES[] = {
    {1, 1, 1, 1, 1, 1, 1, 0, 0},   {2, 1, 8, 28, 28, 3, 3, 1, 1}, {3, 8, 16, 14, 14, 3, 3, 1, 1},
    {2, 3, 5, 7, 9, 3, 3, 0, 0},   {1, 5, 3, 5, 5, 5, 5, 2, 2},   {2, 2, 3, 7, 10, 3, 2, 1, 2},
    {9, 3, 7, 11, 6, 1, 1, 2, 1},  {2, 1, 2, 4, 6, 2, 4, 0, 3},   {1, 3, 9, 17, 33, 5, 3, 1, 0},
    {11, 7, 5, 3, 19, 3, 5, 2, 2},
};
#define NDCASES ((int)(sizeof(DCASES) / sizeof(DCASES[0])))

static int64_t out_h(const direct_case *d) { return d->h + 2 * d->ph - d->kh + 1; }
static int64_t out_w(const direct_case *d) { return d->w + 2 * d->pw - d->kw + 1; }

/* x[i, c, iy, ix] or 0 in the padding */
static double x_at(const direct_case *d, const float *x, int64_t i, int64_t c, int64_t iy,
                   int64_t ix) {
    if (iy < 0 || iy >= d->h || ix < 0 || ix >= d->w) return 0.0;
    return x[((i * d->c + c) * d->h + iy) * d->w + ix];
}

/* y (n, o, oh, ow), dx, dw, db in float64 (and the sums of |terms| for the
 * tolerances) of sum(conv(x) * dy) */
static void direct_reference(const direct_case *d, const float *x, const float *wt,
                             const float *bias, const float *dy, double *y, double *ys,
                             double *dx, double *dxs, double *dw, double *dws, double *db) {
    const int64_t oh = out_h(d), ow = out_w(d);
    for (int64_t i = 0; i < d->n; ++i) {
        for (int64_t o = 0; o < d->o; ++o) {
            for (int64_t oy = 0; oy < oh; ++oy) {
                for (int64_t ox = 0; ox < ow; ++ox) {
                    const int64_t at = ((i * d->o + o) * oh + oy) * ow + ox;
                    double s = bias ? bias[o] : 0.0, m = bias ? fabs(bias[o]) : 0.0;
                    const double g = dy[at];
                    db[o] += g;
                    for (int64_t c = 0; c < d->c; ++c) {
                        for (int64_t ky = 0; ky < d->kh; ++ky) {
                            for (int64_t kx = 0; kx < d->kw; ++kx) {
                                const int64_t iy = oy - d->ph + ky, ix = ox - d->pw + kx;
                                const int64_t wi = ((o * d->c + c) * d->kh + ky) * d->kw + kx;
                                const double xv = x_at(d, x, i, c, iy, ix);
                                s += wt[wi] * xv;
                                m += fabs(wt[wi] * xv);
                                dw[wi] += g * xv;
                                dws[wi] += fabs(g * xv);
                                if (iy >= 0 && iy < d->h && ix >= 0 && ix < d->w) {
                                    const int64_t xi = ((i * d->c + c) * d->h + iy) * d->w + ix;
                                    dx[xi] += g * wt[wi];
                                    dxs[xi] += fabs(g * wt[wi]);
                                }
                            }
                        }
                    }
                    y[at] = s;
                    ys[at] = m;
                }
            }
        }
    }
}

static go_direct_geom geom_of_case(const direct_case *d) {
    go_direct_geom g = {d->c, d->h, d->w, d->o, d->kh, d->kw, d->ph, d->pw,
                        d->h + 2 * d->ph, d->w + 2 * d->pw};
    return g;
}

static void test_direct_case(const ggmlopt_kernel_table *k, const direct_case *d, int off) {
    char ctx[200];
    snprintf(ctx, sizeof(ctx), "conv2d_direct[%s] n=%lld c=%lld o=%lld %lldx%lld k=%lldx%lld "
             "p=%lldx%lld off=%d", k->name, (long long)d->n, (long long)d->c, (long long)d->o,
             (long long)d->h, (long long)d->w, (long long)d->kh, (long long)d->kw,
             (long long)d->ph, (long long)d->pw, off);
    const go_direct_geom g = geom_of_case(d);
    const int64_t oh = out_h(d), ow = out_w(d);
    const int64_t nx = d->n * d->c * d->h * d->w, ny = d->n * d->o * oh * ow;
    const int64_t nw = d->o * d->c * d->kh * d->kw;
    float *x = th_rand_f32(nx, off, -1.0f, 1.0f), *wt = th_rand_f32(nw, off, -1.0f, 1.0f);
    float *bias = th_rand_f32(d->o, off, -1.0f, 1.0f), *dy = th_rand_f32(ny, off, -1.0f, 1.0f);
    /* scratch of the size the dispatcher gives (the widest path's): ASan reports
     * a kernel going past it */
    const int64_t per_image = go_direct_padded_size(&g, GO_DIRECT_MAX_EPR) +
                              d->o * go_direct_wide_stride(&g, GO_DIRECT_MAX_EPR);
    float *scratch = th_alloc(4, d->n * per_image, off);
    float *y = th_alloc(4, ny, off), *dw = th_alloc(4, nw, off), *db = th_alloc(4, d->o, off);
    k->conv2d_direct_f32(&g, d->n, x, wt, bias, y, scratch);
    k->conv2d_direct_weight_grad_f32(&g, d->n, x, dy, dw, db, scratch);

    double *ry = calloc((size_t)ny, sizeof(double)), *rys = calloc((size_t)ny, sizeof(double));
    double *rdx = calloc((size_t)nx, sizeof(double)), *rdxs = calloc((size_t)nx, sizeof(double));
    double *rdw = calloc((size_t)nw, sizeof(double)), *rdws = calloc((size_t)nw, sizeof(double));
    double *rdb = calloc((size_t)d->o, sizeof(double));
    direct_reference(d, x, wt, bias, dy, ry, rys, rdx, rdxs, rdw, rdws, rdb);
    th_miss ref = TH_MISS_INIT;
    for (int64_t j = 0; j < ny; ++j)
        th_expect(&ref, "forward", j, y[j], ry[j], 2e-6 * rys[j] + 1e-7);
    for (int64_t j = 0; j < nw; ++j)
        th_expect(&ref, "weight gradient", j, dw[j], rdw[j], 2e-6 * rdws[j] + 1e-7);
    for (int64_t o = 0; o < d->o; ++o) {
        double s = 0.0;
        for (int64_t i = 0; i < d->n; ++i)
            for (int64_t p = 0; p < oh * ow; ++p) s += fabs(dy[(i * d->o + o) * oh * ow + p]);
        th_expect(&ref, "bias gradient", o, db[o], rdb[o], 2e-6 * s + 1e-7);
    }
    /* an inf in x: the weight gradient keeps finite what the definition does */
    x[nx / 2] = INFINITY;
    k->conv2d_direct_weight_grad_f32(&g, d->n, x, dy, dw, NULL, scratch);
    for (int64_t j = 0; j < nw; ++j) {
        rdw[j] = 0.0;
        rdws[j] = 0.0;
    }
    memset(ry, 0, (size_t)ny * sizeof(double));
    memset(rdx, 0, (size_t)nx * sizeof(double));
    memset(rdb, 0, (size_t)d->o * sizeof(double));
    direct_reference(d, x, wt, NULL, dy, ry, rys, rdx, rdxs, rdw, rdws, rdb);
    for (int64_t j = 0; j < nw; ++j) {
        if (isfinite(rdw[j])) {
            th_expect(&ref, "weight gradient with inf", j, dw[j], rdw[j], 2e-6 * rdws[j] + 1e-7);
        } else {
            th_expect(&ref, "weight gradient with inf (not finite)", j, isfinite(dw[j]), 0, 0);
        }
    }
    free(ry);
    free(rys);
    free(rdx);
    free(rdxs);
    free(rdw);
    free(rdws);
    free(rdb);
    th_report(&ref, ctx);
}

/* maxpool2d_relu against relu then maxpool2d, bit for bit, on integers
 * (ties, zeros, all-negative windows), a -0 and a NaN */
static void test_relu_pool_case(const ggmlopt_kernel_table *k, int64_t nplanes, int64_t h,
                                int64_t w, int64_t kk, int64_t s, int off) {
    char ctx[160];
    snprintf(ctx, sizeof(ctx), "maxpool2d_relu[%s] planes=%lld %lldx%lld k=%lld s=%lld off=%d",
             k->name, (long long)nplanes, (long long)h, (long long)w, (long long)kk,
             (long long)s, off);
    const go_pool_geom g = {h, w, kk, kk, s, s, (h - kk) / s + 1, (w - kk) / s + 1};
    const int64_t in = nplanes * h * w, out = nplanes * g.oh * g.ow;
    float *x = th_alloc(4, in, off), *r = th_alloc(4, in, off);
    for (int64_t j = 0; j < in; ++j) x[j] = (float)th_randint(-2, 3);
    x[in / 3] = -0.0f;
    x[in / 2] = NAN;
    float *dy = th_rand_f32(out, off, -1.0f, 1.0f);
    float *y = th_alloc(4, out, off), *ys = th_alloc(4, out, off);
    int32_t *idx = th_alloc(4, out, off), *idxs = th_alloc(4, out, off);
    float *dx = th_alloc(4, in, off), *dr = th_alloc(4, in, off), *dxs = th_alloc(4, in, off);
    k->maxpool2d_relu_f32(&g, nplanes, x, y, idx);
    k->maxpool2d_relu_backward_f32(&g, nplanes, dy, idx, y, dx);
    k->relu_f32(in, x, r);
    k->maxpool2d_f32(&g, nplanes, r, ys, idxs);
    k->maxpool2d_backward_f32(&g, nplanes, dy, idxs, dr);
    k->relu_backward_f32(in, r, dr, dxs);
    th_miss ref = TH_MISS_INIT;
    for (int64_t j = 0; j < out; ++j) th_expect_bits(&ref, "output", j, y[j], ys[j]);
    for (int64_t j = 0; j < in; ++j) th_expect_bits(&ref, "input gradient", j, dx[j], dxs[j]);
    th_report(&ref, ctx);
}

void test_conv_direct_kernels(const ggmlopt_kernel_table *k) {
    th_set_stage("direct convolution and relu+maxpool kernels of table %s", k->name);
    for (int off = 0; off <= 3; off += 3) {
        th_seed(0xd1ec7ULL + (uint64_t)off);
        for (int i = 0; i < NDCASES; ++i) test_direct_case(k, &DCASES[i], off);
        test_relu_pool_case(k, 1, 2, 2, 2, 2, off);
        test_relu_pool_case(k, 6, 28, 28, 2, 2, off);
        test_relu_pool_case(k, 5, 7, 9, 2, 2, off);
        test_relu_pool_case(k, 3, 14, 14, 2, 2, off);
        test_relu_pool_case(k, 2, 33, 34, 2, 2, off);
        test_relu_pool_case(k, 2, 9, 10, 3, 2, off);
        th_release_all();
    }
}

void test_conv_direct_public_api(void) {
    th_set_stage("direct convolution public API");
    th_seed(0xd1ec8ULL);
    const direct_case d = {37, 3, 5, 13, 11, 3, 3, 1, 1};
    const int64_t oh = out_h(&d), ow = out_w(&d);
    const int64_t nx = d.n * d.c * d.h * d.w, ny = d.n * d.o * oh * ow;
    const int64_t nw = d.o * d.c * d.kh * d.kw;
    float *x = th_rand_f32(nx, 0, -1.0f, 1.0f), *wt = th_rand_f32(nw, 0, -1.0f, 1.0f);
    float *bias = th_rand_f32(d.o, 0, -1.0f, 1.0f), *dy = th_rand_f32(ny, 0, -1.0f, 1.0f);
    float *y[2], *dx[2], *dw[2], *db[2];
    for (int t = 0; t < 2; ++t) {
        ggmlopt_set_num_threads(t + 1);
        const int64_t size = ggmlopt_conv2d_direct_workspace(d.n, d.c, d.h, d.w, d.o, d.kh, d.kw,
                                                             d.ph, d.pw, t + 1);
        float *work = th_alloc(4, size, 0);
        y[t] = th_alloc(4, ny, 0);
        dx[t] = th_alloc(4, nx, 0);
        dw[t] = th_alloc(4, nw, 0);
        db[t] = th_alloc(4, d.o, 0);
        th_check(ggmlopt_conv2d_direct_f32(d.n, d.c, d.h, d.w, d.o, d.kh, d.kw, d.ph, d.pw, x,
                                           wt, bias, y[t], work, size) == 0,
                 "conv2d_direct: refused its own workspace size");
        th_check(ggmlopt_conv2d_direct_backward_f32(d.n, d.c, d.h, d.w, d.o, d.kh, d.kw, d.ph,
                                                    d.pw, x, wt, dy, dx[t], dw[t], db[t], work,
                                                    size) == 0,
                 "conv2d_direct_backward: refused its own workspace size");
        th_check(ggmlopt_conv2d_direct_backward_f32(d.n, d.c, d.h, d.w, d.o, d.kh, d.kw, d.ph,
                                                    d.pw, x, wt, dy, dx[t], dw[t], db[t], work,
                                                    10) == -1,
                 "conv2d_direct_backward: accepted a workspace of 10 floats");
    }
    ggmlopt_set_num_threads(1);
    th_check(memcmp(y[0], y[1], (size_t)ny * 4) == 0, "conv2d_direct: 1 and 2 threads differ");
    th_check(memcmp(dx[0], dx[1], (size_t)nx * 4) == 0, "input gradient: threads differ");
    th_check(memcmp(dw[0], dw[1], (size_t)nw * 4) == 0, "weight gradient: threads differ");
    th_check(memcmp(db[0], db[1], (size_t)d.o * 4) == 0, "bias gradient: threads differ");

    double *ry = calloc((size_t)ny, sizeof(double)), *rys = calloc((size_t)ny, sizeof(double));
    double *rdx = calloc((size_t)nx, sizeof(double)), *rdxs = calloc((size_t)nx, sizeof(double));
    double *rdw = calloc((size_t)nw, sizeof(double)), *rdws = calloc((size_t)nw, sizeof(double));
    double *rdb = calloc((size_t)d.o, sizeof(double));
    direct_reference(&d, x, wt, bias, dy, ry, rys, rdx, rdxs, rdw, rdws, rdb);
    th_miss ref = TH_MISS_INIT;
    for (int64_t j = 0; j < ny; ++j) th_expect(&ref, "forward", j, y[0][j], ry[j], 2e-6 * rys[j]);
    for (int64_t j = 0; j < nx; ++j)
        th_expect(&ref, "input gradient", j, dx[0][j], rdx[j], 2e-6 * rdxs[j] + 1e-7);
    for (int64_t j = 0; j < nw; ++j)
        th_expect(&ref, "weight gradient", j, dw[0][j], rdw[j], 2e-6 * rdws[j] + 1e-7);
    for (int64_t j = 0; j < d.o; ++j)
        th_expect(&ref, "bias gradient", j, db[0][j], rdb[j], 1e-4);
    th_report(&ref, "conv2d_direct public API, 37 images");

    /* convolution, ReLU and 2x2 max pooling in one pass: the bits of the three
     * steps, on 1 and 2 threads */
    const int64_t poh = oh / 2, pow_ = ow / 2, np_ = d.n * d.o * poh * pow_;
    const int64_t size = ggmlopt_conv2d_direct_workspace(d.n, d.c, d.h, d.w, d.o, d.kh, d.kw,
                                                         d.ph, d.pw, 2);
    float *work = th_alloc(4, size, 0);
    float *sy = th_alloc(4, np_, 0), *sdy = th_alloc(4, ny, 0), *pg = th_rand_f32(np_, 0, -1, 1);
    int32_t *sidx = th_alloc(4, np_, 0);
    ggmlopt_maxpool2d_relu_f32(d.n * d.o, oh, ow, 2, 2, 2, 2, y[0], sy, sidx);
    ggmlopt_maxpool2d_relu_backward_f32(d.n * d.o, oh, ow, 2, 2, 2, 2, pg, sidx, sy, sdy);
    ggmlopt_conv2d_direct_backward_f32(d.n, d.c, d.h, d.w, d.o, d.kh, d.kw, d.ph, d.pw, x, wt,
                                       sdy, dx[0], dw[0], db[0], work, size);
    for (int t = 0; t < 2; ++t) {
        ggmlopt_set_num_threads(t + 1);
        float *fy = th_alloc(4, np_, 0), *fdx = th_alloc(4, nx, 0), *fdw = th_alloc(4, nw, 0);
        float *fdb = th_alloc(4, d.o, 0);
        int32_t *fidx = th_alloc(4, np_, 0);
        th_check(ggmlopt_conv2d_direct_relu_maxpool_f32(d.n, d.c, d.h, d.w, d.o, d.kh, d.kw, d.ph,
                                                        d.pw, 2, 2, 2, 2, x, wt, bias, fy, fidx,
                                                        work, size) == 0,
                 "conv2d_direct_relu_maxpool: refused its workspace");
        th_check(ggmlopt_conv2d_direct_relu_maxpool_backward_f32(
                     d.n, d.c, d.h, d.w, d.o, d.kh, d.kw, d.ph, d.pw, 2, 2, 2, 2, x, wt, pg, fidx,
                     fy, fdx, fdw, fdb, work, size) == 0,
                 "conv2d_direct_relu_maxpool_backward: refused its workspace");
        th_check(memcmp(fy, sy, (size_t)np_ * 4) == 0 && memcmp(fidx, sidx, (size_t)np_ * 4) == 0,
                 "conv2d_direct_relu_maxpool (%d threads): not the three steps' output", t + 1);
        th_check(memcmp(fdx, dx[0], (size_t)nx * 4) == 0 && memcmp(fdw, dw[0], (size_t)nw * 4) == 0
                     && memcmp(fdb, db[0], (size_t)d.o * 4) == 0,
                 "conv2d_direct_relu_maxpool_backward (%d threads): not the three steps' "
                 "gradients", t + 1);
    }
    ggmlopt_set_num_threads(1);
    free(ry);
    free(rys);
    free(rdx);
    free(rdxs);
    free(rdw);
    free(rdws);
    free(rdb);
    th_release_all();
}
