/*
 * Convolution and pooling kernels in the C harness: im2col (a copy: exact
 * bits), col2im and pooling against float64 references, every table against
 * the scalar one, on geometries with padding, strides, rectangular kernels and
 * rows shorter and longer than a vector; then the dispatched API with 1 and 2
 * threads, which must agree bit for bit.
 */
#include "harness.h"

void test_conv_kernels(const ggmlopt_kernel_table *k);
void test_conv_public_api(void);

typedef struct { int64_t n, c, h, w, kh, kw, sh, sw, ph, pw; } conv_case;

static const conv_case CASES[] = {
    {1, 1, 1, 1, 1, 1, 1, 1, 0, 0},   {2, 1, 28, 28, 3, 3, 1, 1, 1, 1},
    {3, 3, 7, 9, 3, 3, 1, 1, 1, 1},   {1, 5, 13, 17, 3, 2, 2, 1, 1, 2},
    {2, 3, 9, 11, 5, 5, 2, 2, 2, 2},  {1, 2, 8, 33, 2, 4, 3, 2, 0, 3},
    {2, 1, 4, 5, 4, 4, 1, 3, 3, 3},   {1, 3, 19, 40, 1, 3, 1, 1, 0, 1},
};
#define NCASES ((int)(sizeof(CASES) / sizeof(CASES[0])))

static go_conv_geom geom_of(const conv_case *c) {
    go_conv_geom g = {c->c, c->h, c->w, c->kh, c->kw, c->sh, c->sw, c->ph, c->pw,
                      (c->h + 2 * c->ph - c->kh) / c->sh + 1, (c->w + 2 * c->pw - c->kw) / c->sw + 1};
    return g;
}

/* the input element im2col puts at (image i, row r, output p), or -1 for padding */
static int64_t source_of(const go_conv_geom *g, int64_t i, int64_t r, int64_t p) {
    const int64_t ci = r / (g->kh * g->kw), ky = (r / g->kw) % g->kh, kx = r % g->kw;
    const int64_t iy = (p / g->ow) * g->sh - g->ph + ky, ix = (p % g->ow) * g->sw - g->pw + kx;
    if (iy < 0 || iy >= g->h || ix < 0 || ix >= g->w) return -1;
    return ((i * g->c + ci) * g->h + iy) * g->w + ix;
}

static void test_conv_case(const ggmlopt_kernel_table *k, const conv_case *cc, int off) {
    const ggmlopt_kernel_table *scalar = &ggmlopt_kernels_scalar;
    char ctx[200];
    snprintf(ctx, sizeof(ctx), "im2col/col2im[%s] n=%lld c=%lld %lldx%lld k=%lldx%lld s=%lldx%lld "
             "p=%lldx%lld off=%d", k->name, (long long)cc->n, (long long)cc->c, (long long)cc->h,
             (long long)cc->w, (long long)cc->kh, (long long)cc->kw, (long long)cc->sh,
             (long long)cc->sw, (long long)cc->ph, (long long)cc->pw, off);
    const go_conv_geom g = geom_of(cc);
    const int64_t rows = g.c * g.kh * g.kw, P = g.oh * g.ow;
    const int64_t nx = cc->n * g.c * g.h * g.w, ncol = cc->n * rows * P;
    float *x = th_rand_f32(nx, off, -1.0f, 1.0f);
    float *col = th_alloc(4, ncol, off), *colb = th_alloc(4, ncol, off);
    k->im2col_f32(&g, cc->n, x, col, rows * P, P);
    k->im2col_f32(&g, cc->n, x, colb, P, cc->n * P); /* one matrix for the batch */
    float *dcol = th_rand_f32(ncol, off, -1.0f, 1.0f);
    float *dx = th_alloc(4, nx, off), *dxs = th_alloc(4, nx, off);
    k->col2im_f32(&g, cc->n, dcol, rows * P, P, dx);
    scalar->col2im_f32(&g, cc->n, dcol, rows * P, P, dxs);

    double *want = calloc((size_t)nx + 1, sizeof(double)), *scale = calloc((size_t)nx + 1, sizeof(double));
    th_miss ref = TH_MISS_INIT;
    for (int64_t i = 0; i < cc->n; ++i) {
        for (int64_t r = 0; r < rows; ++r) {
            for (int64_t p = 0; p < P; ++p) {
                const int64_t s = source_of(&g, i, r, p);
                const int64_t at = (i * rows + r) * P + p;
                th_expect_bits(&ref, "im2col", at, col[at], s < 0 ? 0.0f : x[s]);
                th_expect_bits(&ref, "im2col batch matrix", at,
                               colb[(r * cc->n + i) * P + p], col[at]);
                if (s >= 0) {
                    want[s] += dcol[at];
                    scale[s] += fabs(dcol[at]);
                }
            }
        }
    }
    for (int64_t j = 0; j < nx; ++j) {
        th_expect(&ref, "col2im", j, dx[j], want[j], 1e-6 * scale[j]);
        /* additions in one order on every path */
        th_expect_bits(&ref, "col2im vs scalar", j, dx[j], dxs[j]);
    }
    free(want);
    free(scale);
    th_report(&ref, ctx);
}

static void test_pool_case(const ggmlopt_kernel_table *k, int64_t nplanes, int64_t h, int64_t w,
                           int64_t kh, int64_t kw, int64_t sh, int64_t sw, int off) {
    char ctx[160];
    snprintf(ctx, sizeof(ctx), "pool2d[%s] planes=%lld %lldx%lld k=%lldx%lld s=%lldx%lld off=%d",
             k->name, (long long)nplanes, (long long)h, (long long)w, (long long)kh,
             (long long)kw, (long long)sh, (long long)sw, off);
    const go_pool_geom g = {h, w, kh, kw, sh, sw, (h - kh) / sh + 1, (w - kw) / sw + 1};
    const int64_t in = h * w, out = g.oh * g.ow;
    float *x = th_rand_f32(nplanes * in, off, -1.0f, 1.0f);
    if (nplanes * in > 5) x[5] = NAN;
    float *y = th_alloc(4, nplanes * out, off), *a = th_alloc(4, nplanes * out, off);
    int32_t *idx = th_alloc(4, nplanes * out, off);
    float *dy = th_rand_f32(nplanes * out, off, -1.0f, 1.0f);
    float *dxm = th_alloc(4, nplanes * in, off), *dxa = th_alloc(4, nplanes * in, off);
    k->maxpool2d_f32(&g, nplanes, x, y, idx);
    k->avgpool2d_f32(&g, nplanes, x, a);
    k->maxpool2d_backward_f32(&g, nplanes, dy, idx, dxm);
    k->avgpool2d_backward_f32(&g, nplanes, dy, dxa);

    double *wm = calloc((size_t)(nplanes * in) + 1, sizeof(double));
    double *wa = calloc((size_t)(nplanes * in) + 1, sizeof(double));
    th_miss ref = TH_MISS_INIT;
    for (int64_t p = 0; p < nplanes; ++p) {
        for (int64_t o = 0; o < out; ++o) {
            const int64_t oy = o / g.ow, ox = o % g.ow;
            float best = 0.0f;
            int64_t at = -1;
            double sum = 0.0, mag = 0.0;
            for (int64_t ky = 0; ky < kh; ++ky) {
                for (int64_t kx = 0; kx < kw; ++kx) {
                    const int64_t pos = (oy * sh + ky) * w + ox * sw + kx;
                    const float v = x[p * in + pos];
                    if (at < 0 || (isnan(v) && !isnan(best)) || v > best) {
                        if (at < 0 || !isnan(best)) {
                            best = v;
                            at = pos;
                        }
                    }
                    sum += v;
                    mag += fabs(v);
                }
            }
            th_expect_bits(&ref, "maxpool", p * out + o, y[p * out + o], best);
            th_expect(&ref, "maxpool index", p * out + o, idx[p * out + o], (double)at, 0.0);
            th_expect(&ref, "avgpool", p * out + o, a[p * out + o], sum / (double)(kh * kw),
                      1e-6 * mag);
            wm[p * in + at] += dy[p * out + o];
            for (int64_t ky = 0; ky < kh; ++ky)
                for (int64_t kx = 0; kx < kw; ++kx)
                    wa[p * in + (oy * sh + ky) * w + ox * sw + kx] +=
                        (double)(dy[p * out + o] * (1.0f / (float)(kh * kw)));
        }
    }
    for (int64_t j = 0; j < nplanes * in; ++j) {
        th_expect(&ref, "maxpool backward", j, dxm[j], wm[j], 1e-6 * (1.0 + fabs(wm[j])));
        th_expect(&ref, "avgpool backward", j, dxa[j], wa[j], 1e-6 * (1.0 + fabs(wa[j])));
    }
    free(wm);
    free(wa);
    th_report(&ref, ctx);
}

static void test_bias_planes(const ggmlopt_kernel_table *k, int64_t plane, int off) {
    char ctx[120];
    snprintf(ctx, sizeof(ctx), "add_bias_planes_f32[%s] plane=%lld off=%d", k->name,
             (long long)plane, off);
    const int64_t n = 2, c = 3;
    float *x = th_rand_f32(n * c * plane, off, -1.0f, 1.0f), *b = th_rand_f32(c, off, -1.0f, 1.0f);
    const float *x0 = th_dup(x, 4, n * c * plane);
    k->add_bias_planes_f32(n, c, plane, x, b);
    th_miss ref = TH_MISS_INIT;
    for (int64_t j = 0; j < n * c * plane; ++j)
        th_expect_bits(&ref, "x + bias", j, x[j], x0[j] + b[(j / plane) % c]);
    th_report(&ref, ctx);
}

void test_conv_kernels(const ggmlopt_kernel_table *k) {
    th_set_stage("conv/pool kernels of table %s", k->name);
    for (int off = 0; off <= 3; off += 3) {
        th_seed(0xc0417ULL + (uint64_t)off);
        for (int i = 0; i < NCASES; ++i) test_conv_case(k, &CASES[i], off);
        test_pool_case(k, 1, 2, 2, 2, 2, 2, 2, off);
        test_pool_case(k, 6, 28, 28, 2, 2, 2, 2, off);
        test_pool_case(k, 5, 7, 9, 2, 2, 2, 2, off);
        test_pool_case(k, 2, 9, 10, 3, 3, 2, 2, off);
        test_pool_case(k, 2, 8, 11, 3, 2, 1, 3, off);
        test_pool_case(k, 1, 5, 21, 1, 12, 1, 9, off);
        static const int64_t planes[] = {1, 7, 8, 9, 33, 196};
        for (int i = 0; i < 6; ++i) test_bias_planes(k, planes[i], off);
        th_release_all();
    }
}

/* The dispatched API: threads split images and planes, results must not move. */
void test_conv_public_api(void) {
    th_set_stage("conv/pool public API");
    th_seed(0xd15bULL);
    const int64_t n = 67, c = 3, h = 21, w = 19, kh = 3, kw = 2, sh = 2, sw = 1, ph = 1, pw = 1;
    const int64_t oh = (h + 2 * ph - kh) / sh + 1, ow = (w + 2 * pw - kw) / sw + 1;
    const int64_t nx = n * c * h * w, ncol = n * c * kh * kw * oh * ow;
    const int64_t poh = (h - 3) / 2 + 1, pow_ = (w - 3) / 2 + 1, npool = n * c * poh * pow_;
    float *x = th_rand_f32(nx, 1, -1.0f, 1.0f);
    float *col[2], *dx[2], *y[2], *dm[2], *a[2], *da[2];
    int32_t *idx[2];
    for (int t = 0; t < 2; ++t) {
        ggmlopt_set_num_threads(t + 1);
        col[t] = th_alloc(4, ncol, 0);
        dx[t] = th_alloc(4, nx, 0);
        y[t] = th_alloc(4, npool, 0);
        a[t] = th_alloc(4, npool, 0);
        idx[t] = th_alloc(4, npool, 0);
        dm[t] = th_alloc(4, nx, 0);
        da[t] = th_alloc(4, nx, 0);
        ggmlopt_im2col_f32(n, c, h, w, kh, kw, sh, sw, ph, pw, x, col[t], c * kh * kw * oh * ow,
                           oh * ow);
        ggmlopt_col2im_f32(n, c, h, w, kh, kw, sh, sw, ph, pw, col[t], c * kh * kw * oh * ow,
                           oh * ow, dx[t]);
        ggmlopt_maxpool2d_f32(n * c, h, w, 3, 3, 2, 2, x, y[t], idx[t]);
        ggmlopt_maxpool2d_backward_f32(n * c, h, w, 3, 3, 2, 2, y[t], idx[t], dm[t]);
        ggmlopt_avgpool2d_f32(n * c, h, w, 3, 3, 2, 2, x, a[t]);
        ggmlopt_avgpool2d_backward_f32(n * c, h, w, 3, 3, 2, 2, a[t], da[t]);
    }
    ggmlopt_set_num_threads(1);
    th_check(memcmp(col[0], col[1], (size_t)ncol * 4) == 0, "im2col: 1 and 2 threads differ");
    th_check(memcmp(dx[0], dx[1], (size_t)nx * 4) == 0, "col2im: 1 and 2 threads differ");
    th_check(memcmp(y[0], y[1], (size_t)npool * 4) == 0, "maxpool2d: 1 and 2 threads differ");
    th_check(memcmp(idx[0], idx[1], (size_t)npool * 4) == 0, "maxpool2d index: threads differ");
    th_check(memcmp(dm[0], dm[1], (size_t)nx * 4) == 0, "maxpool2d backward: threads differ");
    th_check(memcmp(a[0], a[1], (size_t)npool * 4) == 0, "avgpool2d: 1 and 2 threads differ");
    th_check(memcmp(da[0], da[1], (size_t)nx * 4) == 0, "avgpool2d backward: threads differ");
    /* one spot check against the definition */
    th_check(col[0][0] == 0.0f, "im2col: the first entry lies in the padding, got %g",
             (double)col[0][0]);
    th_release_all();
}
