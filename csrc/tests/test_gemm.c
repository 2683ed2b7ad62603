/*
 * Float32 products (kernels/gemm.inc, ggmlopt_sgemm_f32) against a float64
 * reference: every path's block kernel over whole products and over sub-blocks
 * (nothing written outside the block), each operand layout the layers use (A
 * rows or a transposed view, B rows or transposed, rows longer than the
 * matrix), accumulation, sizes around the tile and the k chunk, buffers of the
 * exact size (the sanitizers see any stray access); the public function on 1,
 * 2 and 3 threads giving the same bits, and its refusals writing nothing.
 *
 * Tolerance: each value is a chain of k float32 FMAs (after the old value when
 * accumulating), so within (k + 1) 2^-24 of the sum of the terms' magnitudes.
 */
#include "harness.h"

typedef struct {
    int64_t m, n, k;
    int a_t, b_t;  /* A given transposed (a_row == 1), B given transposed */
    int64_t pad;   /* extra floats per stored row */
} gemm_case;

typedef struct {
    float *a, *b;
    int64_t a_row, a_col, b_row, b_col;
} gemm_operands;

static gemm_operands make_operands(const gemm_case *c, int off) {
    gemm_operands o;
    const int64_t a_rows = c->a_t ? c->k : c->m, a_cols = c->a_t ? c->m : c->k;
    const int64_t b_rows = c->b_t ? c->n : c->k, b_cols = c->b_t ? c->k : c->n;
    const int64_t lda = a_cols + c->pad, ldb = b_cols + c->pad;
    o.a = th_rand_f32(a_rows * lda, off, -1.0f, 1.0f);
    o.b = th_rand_f32(b_rows * ldb, off, -1.0f, 1.0f);
    o.a_row = c->a_t ? 1 : lda;
    o.a_col = c->a_t ? lda : 1;
    o.b_row = c->b_t ? 1 : ldb;
    o.b_col = c->b_t ? ldb : 1;
    return o;
}

/* C[i, j] against old + A B in double, for rows [r0, r1) x columns [j0, j1);
 * everything else in C must still be `old` */
static void check_product(const gemm_case *c, const gemm_operands *o, const float *got,
                          int64_t ldc, const float *old, int accumulate, int64_t r0, int64_t r1,
                          int64_t j0, int64_t j1, const char *ctx) {
    th_miss miss = TH_MISS_INIT, outside = TH_MISS_INIT;
    for (int64_t i = 0; i < c->m; ++i) {
        for (int64_t j = 0; j < ldc; ++j) {
            const int64_t at = i * ldc + j;
            if (i < r0 || i >= r1 || j < j0 || j >= j1 || j >= c->n) {
                th_expect_bits(&outside, "outside the block", at, got[at], old[at]);
                continue;
            }
            double want = accumulate ? old[at] : 0.0, scale = accumulate ? fabs(old[at]) : 0.0;
            for (int64_t p = 0; p < c->k; ++p) {
                const double t = (double)o->a[i * o->a_row + p * o->a_col] *
                                 (double)o->b[p * o->b_row + j * o->b_col];
                want += t;
                scale += fabs(t);
            }
            th_expect(&miss, "C", at, got[at], want, (double)(c->k + 1) * 0x1p-24 * scale);
        }
    }
    th_report(&miss, ctx);
    th_report(&outside, ctx);
}

static const gemm_case CASES[] = {
    {1, 1, 1, 0, 0, 0},    {1, 5, 7, 0, 1, 0},    {5, 9, 1, 1, 0, 0},    {3, 1, 2, 1, 1, 3},
    {13, 31, 17, 0, 0, 1}, {15, 33, 16, 0, 1, 0}, {16, 32, 64, 1, 0, 5}, {29, 47, 65, 1, 1, 0},
    {14, 64, 9, 0, 0, 0},  {43, 70, 800, 0, 1, 2}, {30, 257, 30, 1, 0, 0}, {7, 20, 1537, 0, 0, 0},
    /* no wider than a vector (an adapter's rank side): the one-vector tiles, full
     * and every remainder, over A's two layouts and k chunks */
    {61, 8, 300, 0, 0, 0}, {87, 8, 256, 1, 0, 1},  {59, 16, 40, 0, 1, 3}, {33, 3, 9, 1, 1, 0},
    {45, 4, 1600, 0, 0, 2}, {30, 1, 17, 0, 1, 0},
    /* A's rows 64 KB apart: a tile's rows copied out of their shared cache sets */
    {20, 40, 16380, 0, 0, 4}, {29, 33, 16384, 0, 1, 0},
    /* several column blocks, cut into even whole panels (a long k: blocks of
     * 256 columns), and one block wider than 256 (a short k) */
    {20, 900, 700, 0, 1, 0}, {17, 530, 800, 1, 0, 1},
    {20, 600, 50, 0, 1, 0}, {17, 530, 33, 1, 0, 1},
    /* at most GO_GEMM_THIN rows, B's rows in place (every k % 4, column tails;
     * a 20 x 20 product's row groups on several threads end in a thin one) */
    {8, 70, 256, 0, 0, 0}, {5, 37, 13, 0, 0, 2}, {1, 50, 7, 1, 0, 0}, {8, 33, 9, 1, 0, 3},
    {3, 100, 6, 0, 0, 1}, {7, 17, 1, 0, 0, 0}, {20, 20, 37, 0, 0, 0},
};
#define NCASES ((int)(sizeof(CASES) / sizeof(CASES[0])))

/* one path's block kernel: whole products and a block inside one */
void test_gemm_kernels(const ggmlopt_kernel_table *k) {
    char ctx[160];
    const int nr = k->sgemm_panel_cols(), mr = k->sgemm_tile_rows();
    th_check(nr > 0 && GO_GEMM_NC % nr == 0 && mr > 0, "sgemm[%s]: panel %d, tile rows %d", k->name,
             nr, mr);
    for (int t = 0; t < NCASES; ++t) {
        const gemm_case *c = &CASES[t];
        for (int accumulate = 0; accumulate <= 1; ++accumulate) {
            const int off = (t + accumulate) % 4;
            gemm_operands o = make_operands(c, off);
            const int64_t ldc = c->n + c->pad;
            float *cm = th_rand_f32(c->m * ldc, off, -1.0f, 1.0f);
            float *old = th_dup(cm, 4, c->m * ldc);
            const go_gemm_args g = {c->m, c->n, c->k, o.a, o.a_row, o.a_col, o.b, o.b_row,
                                    o.b_col, cm, ldc, accumulate};
            /* a block of whole tiles and panels from the second on, or the whole */
            const int64_t r0 = c->m > mr ? mr : 0, j0 = c->n > nr ? nr : 0;
            const int64_t r1 = c->m, j1 = c->n;
            float *work = th_alloc(4, go_gemm_work_floats(c->k), 0);
            k->sgemm_block_f32(&g, r0, r1, j0, j1, work);
            snprintf(ctx, sizeof ctx, "sgemm_block[%s] m=%lld n=%lld k=%lld a_t=%d b_t=%d acc=%d",
                     k->name, (long long)c->m, (long long)c->n, (long long)c->k, c->a_t, c->b_t,
                     accumulate);
            check_product(c, &o, cm, ldc, old, accumulate, r0, r1, j0, j1, ctx);
            th_release_all();
        }
    }
}

/* the thin product (blocks of at most GO_GEMM_THIN rows, B read in place) gives
 * the bits of the tiles over the same rows: a product's row groups may be cut
 * either way */
void test_gemm_thin_bits(const ggmlopt_kernel_table *k) {
    static const gemm_case thin[] = {{22, 70, 256, 0, 0, 0}, {19, 37, 13, 1, 0, 2},
                                     {23, 100, 1030, 0, 0, 1}, {17, 33, 9, 1, 0, 0}};
    char ctx[160];
    for (int t = 0; t < (int)(sizeof thin / sizeof thin[0]); ++t) {
        const gemm_case *c = &thin[t];
        for (int accumulate = 0; accumulate <= 1; ++accumulate) {
            gemm_operands o = make_operands(c, t % 4);
            const int64_t ldc = c->n + c->pad;
            float *whole = th_rand_f32(c->m * ldc, t % 4, -1.0f, 1.0f);
            float *cut = th_dup(whole, 4, c->m * ldc);
            float *work = th_alloc(4, go_gemm_work_floats(c->k), 0);
            go_gemm_args g = {c->m, c->n, c->k, o.a, o.a_row, o.a_col, o.b, o.b_row,
                              o.b_col, whole, ldc, accumulate};
            k->sgemm_block_f32(&g, 0, c->m, 0, c->n, work);   /* the tiles */
            g.c = cut;
            for (int64_t r = 0; r < c->m; r += GO_GEMM_THIN)  /* thin blocks */
                k->sgemm_block_f32(&g, r, r + GO_GEMM_THIN < c->m ? r + GO_GEMM_THIN : c->m, 0,
                                   c->n, work);
            snprintf(ctx, sizeof ctx, "sgemm thin[%s] m=%lld n=%lld k=%lld acc=%d", k->name,
                     (long long)c->m, (long long)c->n, (long long)c->k, accumulate);
            th_miss same = TH_MISS_INIT;
            for (int64_t i = 0; i < c->m * ldc; ++i)
                th_expect_bits(&same, "thin against tiles", i, cut[i], whole[i]);
            th_report(&same, ctx);
            th_release_all();
        }
    }
}

/* the public function: threads give the same bits; refused calls write nothing */
void test_gemm_public(void) {
    char ctx[160];
    for (int t = 0; t < NCASES; ++t) {
        const gemm_case *c = &CASES[t];
        gemm_operands o = make_operands(c, 1);
        const int64_t ldc = c->n + c->pad;
        float *first = NULL;
        for (int threads = 1; threads <= 3; ++threads) {
            ggmlopt_set_num_threads(threads);
            float *cm = th_rand_f32(c->m * ldc, 0, -1.0f, 1.0f);
            float *old = th_dup(cm, 4, c->m * ldc);
            const int rc = ggmlopt_sgemm_f32(c->m, c->n, c->k, o.a, o.a_row, o.a_col, o.b,
                                             o.b_row, o.b_col, cm, ldc, threads == 2);
            snprintf(ctx, sizeof ctx, "ggmlopt_sgemm_f32 m=%lld n=%lld k=%lld threads=%d",
                     (long long)c->m, (long long)c->n, (long long)c->k, threads);
            th_check(rc == 0, "%s: returned %d", ctx, rc);
            check_product(c, &o, cm, ldc, old, threads == 2, 0, c->m, 0, c->n, ctx);
            if (threads == 2) continue;  /* accumulated: not comparable */
            if (!first) {
                first = cm;
                continue;
            }
            th_miss same = TH_MISS_INIT;
            for (int64_t i = 0; i < c->m; ++i)
                for (int64_t j = 0; j < c->n; ++j)
                    th_expect_bits(&same, "threads", i * ldc + j, cm[i * ldc + j], first[i * ldc + j]);
            th_report(&same, ctx);
        }
        ggmlopt_set_num_threads(2);
        th_release_all();
    }
    /* k = 0: zeros, or C unchanged when accumulating */
    float *a = th_rand_f32(6, 0, -1.0f, 1.0f), *b = th_rand_f32(6, 0, -1.0f, 1.0f);
    float *cm = th_rand_f32(6, 0, 1.0f, 2.0f);
    th_check(ggmlopt_sgemm_f32(2, 3, 0, a, 1, 1, b, 3, 1, cm, 3, 1) == 0 && cm[0] >= 1.0f,
             "sgemm k=0 accumulate keeps C");
    th_check(ggmlopt_sgemm_f32(2, 3, 0, a, 1, 1, b, 3, 1, cm, 3, 0) == 0 && cm[0] == 0.0f &&
                 cm[5] == 0.0f,
             "sgemm k=0 writes zeros");
    /* refusals */
    float *keep = th_rand_f32(6, 0, 1.0f, 2.0f), *ref = th_dup(keep, 4, 6);
    const int rcs[] = {
        ggmlopt_sgemm_f32(-1, 3, 2, a, 2, 1, b, 3, 1, keep, 3, 0),
        ggmlopt_sgemm_f32(2, 3, 2, a, 2, 1, b, 3, 1, keep, 2, 0), /* ldc < n */
        ggmlopt_sgemm_f32(2, 3, 2, a, 2, 2, b, 3, 1, keep, 3, 0), /* no unit stride in A */
        ggmlopt_sgemm_f32(2, 3, 2, a, 2, 1, b, -3, 1, keep, 3, 0),
    };
    for (int i = 0; i < 4; ++i) th_check(rcs[i] == -1, "sgemm refusal %d returned %d", i, rcs[i]);
    th_check(memcmp(keep, ref, 6 * sizeof(float)) == 0, "sgemm refusals wrote nothing");
    th_release_all();
}
