/*
 * A few rows times a float32 weight stored (in, out), as a Linear keeps it
 * (kernels/matmul_columns.inc, ggmlopt_matmul_columns_f32 and _many): within
 * float32 rounding of a float64 product for awkward sizes (inputs and outputs
 * not multiples of a vector or of the 64-row chunks, one of each, a column
 * range of a wider weight, unaligned rows), on every path this CPU runs; the
 * same bits on 1 and 2 threads and with the caller's scratch or its own; the
 * several-products job the same bits as each product alone; nothing past an
 * output row written; the refused calls write nothing.
 */
#include "harness.h"


static void expect_same(const float *got, const float *want, int64_t n, const char *ctx) {
    th_miss m = TH_MISS_INIT;
    for (int64_t i = 0; i < n; ++i) th_expect_bits(&m, "bits", i, got[i], want[i]);
    th_report(&m, ctx);
}

/* y = x w checked against float64: each value within gamma_k of sum |x||w|
 * (chains of at most 64 products, then up to k/64 partial sums: k roundings
 * along any path, bounded by k u (1 + k u)) */
static void check_product(int64_t nx, int64_t k, int64_t n, const float *x, int64_t xs,
                          const float *w, int64_t ld, const float *y, int64_t ys,
                          const char *ctx) {
    th_miss m = TH_MISS_INIT;
    const double u = ldexp(1.0, -24), gamma = (double)k * u / (1.0 - (double)k * u);
    for (int64_t i = 0; i < nx; ++i) {
        for (int64_t j = 0; j < n; ++j) {
            double want = 0.0, mag = 0.0;
            for (int64_t c = 0; c < k; ++c) {
                want += (double)x[i * xs + c] * (double)w[c * ld + j];
                mag += fabs((double)x[i * xs + c] * (double)w[c * ld + j]);
            }
            th_expect(&m, "y", i * n + j, y[i * ys + j], want, gamma * mag);
        }
        for (int64_t j = n; j < ys; ++j)   /* the row's padding never written */
            th_expect_bits(&m, "padding", i * ys + j, y[i * ys + j], th_sentinel());
    }
    th_report(&m, ctx);
}

static void one_case(const char *path, int64_t nx, int64_t k, int64_t n, int64_t pad) {
    const int64_t ld = n + pad, xs = k + 1, ys = n + 3;
    const float *x = th_rand_f32(nx * xs, 1, -2.0f, 2.0f);
    const float *w = th_rand_f32(k * ld + 1, 1, -1.0f, 1.0f) + 1;   /* rows not 64-byte aligned */
    float *y1 = th_sentinels(nx * ys), *y2 = th_sentinels(nx * ys), *y3 = th_sentinels(nx * ys);
    char ctx[160];
    snprintf(ctx, sizeof ctx, "matmul_columns nx=%lld k=%lld n=%lld ld=%lld [%s]",
             (long long)nx, (long long)k, (long long)n, (long long)ld, path);
    ggmlopt_set_num_threads(1);
    int rc = ggmlopt_matmul_columns_f32(nx, k, x, xs, n, w, ld, y1, ys, NULL);
    th_check(rc == 0, "%s: return code %d", ctx, rc);
    check_product(nx, k, n, x, xs, w, ld, y1, ys, ctx);
    ggmlopt_set_num_threads(2);
    rc = ggmlopt_matmul_columns_f32(nx, k, x, xs, n, w, ld, y2, ys, NULL);
    char c2[200];
    snprintf(c2, sizeof c2, "%s: 2 threads vs 1", ctx);
    th_check(rc == 0, "%s: return code %d", c2, rc);
    expect_same(y2, y1, nx * ys, c2);
    const int64_t scratch = ggmlopt_matmul_columns_scratch(nx, k, n);
    th_check(scratch >= 0, "%s: scratch %lld", ctx, (long long)scratch);
    float *partials = th_alloc(4, scratch > 0 ? scratch : 1, 0);
    rc = ggmlopt_matmul_columns_f32(nx, k, x, xs, n, w, ld, y3, ys, partials);
    snprintf(c2, sizeof c2, "%s: the caller's scratch", ctx);
    th_check(rc == 0, "%s: return code %d", c2, rc);
    expect_same(y3, y1, nx * ys, c2);
}

/* three products of one input, one job: each the bits of the product alone */
static void many(const char *path) {
    const int64_t nx = 3, k = 97, nouts[3] = {40, 17, 64}, ld = 130;
    const float *x = th_rand_f32(nx * k, 0, -2.0f, 2.0f);
    const float *w = th_rand_f32(k * ld, 0, -1.0f, 1.0f);
    ggmlopt_columns_product p[3];
    int64_t at = 0;
    for (int m = 0; m < 3; ++m) {   /* column ranges of one wide weight, as a fused one */
        p[m].nout = nouts[m];
        p[m].w = w + at;
        p[m].ld = ld;
        p[m].y_stride = nouts[m] + 1;
        p[m].y = th_sentinels(nx * p[m].y_stride);
        at += nouts[m];
    }
    for (int threads = 1; threads <= 2; ++threads) {
        ggmlopt_set_num_threads(threads);
        for (int m = 0; m < 3; ++m)
            for (int64_t i = 0; i < nx * p[m].y_stride; ++i) p[m].y[i] = th_sentinel();
        const int rc = ggmlopt_matmul_columns_many(3, p, nx, k, x, k, NULL);
        char ctx[160];
        snprintf(ctx, sizeof ctx, "matmul_columns_many [%s, %d threads]", path, threads);
        th_check(rc == 0, "%s: return code %d", ctx, rc);
        for (int m = 0; m < 3; ++m) {
            float *want = th_sentinels(nx * p[m].y_stride);
            ggmlopt_matmul_columns_f32(nx, k, x, k, nouts[m], p[m].w, ld, want,
                                       p[m].y_stride, NULL);
            char c2[200];
            snprintf(c2, sizeof c2, "%s: product %d vs alone", ctx, m);
            expect_same(p[m].y, want, nx * p[m].y_stride, c2);
        }
    }
}

static void refused(void) {
    const float *x = th_rand_f32(8, 0, -1.0f, 1.0f), *w = th_rand_f32(64, 0, -1.0f, 1.0f);
    float *y = th_sentinels(8), *none = th_sentinels(8);
    th_check(ggmlopt_matmul_columns_f32(1, 8, x, 8, 8, w, 7, y, 8, NULL) == -1,
             "matmul_columns: ld < nout not refused");
    ggmlopt_columns_product p = {8, w, 7, y, 8};   /* rows narrower than the product */
    th_check(ggmlopt_matmul_columns_many(1, &p, 1, 8, x, 8, NULL) == -1,
             "matmul_columns_many: ld < nout not refused");
    p.ld = 8;
    th_check(ggmlopt_matmul_columns_many(GGMLOPT_QPRODUCTS_MAX + 1, &p, 1, 8, x, 8, NULL) == -3,
             "matmul_columns_many: too many products not refused");
    expect_same(y, none, 8, "matmul_columns: refused calls write nothing");
    th_check(ggmlopt_matmul_columns_f32(0, 8, x, 8, 8, w, 8, y, 8, NULL) == 0 &&
                 ggmlopt_matmul_columns_f32(1, 8, x, 8, 0, w, 0, y, 8, NULL) == 0,
             "matmul_columns: no rows or no columns is a call that does nothing");
    expect_same(y, none, 8, "matmul_columns: empty calls write nothing");
    ggmlopt_matmul_columns_f32(1, 0, x, 8, 5, w, 8, y, 8, NULL);   /* no inputs: zeros */
    th_check(y[0] == 0.0f && y[4] == 0.0f && th_same_f32(y[5], th_sentinel()),
             "matmul_columns: an empty sum is not zero, or wrote past its columns");
}

void test_matmul_columns_public(void) {
    const int threads_before = ggmlopt_get_num_threads();
    th_set_stage("matmul columns");
    th_seed(0xc01u);
    static const int64_t ks[] = {1, 7, 33, 63, 64, 65, 129, 576};
    static const int64_t ns[] = {1, 5, 16, 17, 100, 300};
    for (int p = 0; p < ggmlopt_simd_count(); ++p) {
        if (!ggmlopt_simd_supported(p)) continue;
        const char *path = ggmlopt_simd_name(p);
        th_check(ggmlopt_simd_select(path) == 0, "select %s", path);
        for (size_t a = 0; a < sizeof ks / sizeof ks[0]; ++a)
            for (size_t b = 0; b < sizeof ns / sizeof ns[0]; ++b)
                for (int64_t nx = 1; nx <= 3; nx += 2) {
                    one_case(path, nx, ks[a], ns[b], (a + b) % 3 == 0 ? 0 : 9);
                    th_release_all();
                }
        one_case(path, 1, 1536, 576, 0);   /* a decode's down projection */
        many(path);
        th_release_all();
    }
    ggmlopt_simd_select(NULL);
    ggmlopt_set_num_threads(threads_before);
    refused();
    th_release_all();
}
