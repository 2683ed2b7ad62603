/*
 * bfloat16 products (kernels/gemm_bf16.inc, ggmlopt_gemm_bf16) against a
 * float64 reference of the exact products of the bf16 operands: every path's
 * block kernel (each pair as two FMAs) and, on a CPU with AVX512-BF16, the
 * vdpbf16ps kernel, over whole products and blocks inside them (nothing written
 * outside), the four operand layouts (A's rows, read in place or packed when
 * they are 16 KB apart, or a transposed A; B's rows or a transposed B; rows
 * longer than the matrix), accumulation, odd k and k
 * chunks whose last is odd, sizes around the tile, the panel and the vector,
 * buffers of the exact size at unaligned offsets (the sanitizers see any stray
 * access); the paths that add with FMAs giving the same bits; the public
 * function giving the same bits on 1, 2 and 3 threads; its refusals writing
 * nothing.
 *
 * Tolerance: each product of two bf16 values is exact in float32 and each
 * value a chain of k float32 additions (after the old value when
 * accumulating), so within (k + 1) 2^-24 of the sum of the terms' magnitudes.
 * The operands lie in [-1, 1] away from subnormals, which vdpbf16ps flushes.
 */
#include "harness.h"

typedef struct {
    int64_t m, n, k;
    int a_t, b_t;  /* A given transposed (a_row == 1), B given transposed (b_row == 1) */
    int64_t pad;   /* extra values per stored row */
} bgemm_case;

typedef struct {
    uint16_t *a, *b;
    int64_t a_row, a_col, b_row, b_col;
} bgemm_operands;

static double widen(uint16_t h) {
    const uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return (double)f;
}

/* n random values in [-1, 1] rounded to bf16, at offset off into an exact buffer */
static uint16_t *rand_bf16(int64_t n, int off) {
    float *f = th_rand_f32(n, 0, -1.0f, 1.0f);
    uint16_t *h = (uint16_t *)th_alloc(2, n, off);
    ggmlopt_convert_f32_bf16(n, f, h);
    return h;
}

static bgemm_operands make_operands(const bgemm_case *c, int off) {
    bgemm_operands o;
    const int64_t a_rows = c->a_t ? c->k : c->m, a_cols = c->a_t ? c->m : c->k;
    const int64_t b_rows = c->b_t ? c->n : c->k, b_cols = c->b_t ? c->k : c->n;
    const int64_t lda = a_cols + c->pad, ldb = b_cols + c->pad;
    o.a = rand_bf16(a_rows * lda, off);
    o.b = rand_bf16(b_rows * ldb, (off + 1) % 4);
    o.a_row = c->a_t ? 1 : lda;
    o.a_col = c->a_t ? lda : 1;
    o.b_row = c->b_t ? 1 : ldb;
    o.b_col = c->b_t ? ldb : 1;
    return o;
}

/* C[i, j] against old + A B in double over rows [r0, r1) x columns [j0, j1);
 * everything else in C must still be `old` */
static void check_product(const bgemm_case *c, const bgemm_operands *o, const float *got,
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
                const double t = widen(o->a[i * o->a_row + p * o->a_col]) *
                                 widen(o->b[p * o->b_row + j * o->b_col]);
                want += t;
                scale += fabs(t);
            }
            th_expect(&miss, "C", at, got[at], want, (double)(c->k + 1) * 0x1p-24 * scale);
        }
    }
    th_report(&miss, ctx);
    th_report(&outside, ctx);
}

static const bgemm_case CASES[] = {
    {1, 1, 1, 0, 0, 0},     {1, 5, 7, 0, 1, 0},     {5, 9, 1, 1, 0, 0},    {3, 1, 2, 1, 1, 3},
    {13, 31, 17, 0, 0, 1},  {15, 33, 16, 0, 1, 0},  {16, 32, 64, 1, 0, 5}, {29, 47, 65, 1, 1, 0},
    {14, 64, 9, 0, 0, 0},   {28, 96, 2, 1, 1, 1},   {30, 257, 30, 1, 0, 0}, {61, 8, 300, 0, 0, 0},
    /* k chunks (the float32 ones made even): 1537 = 514 + 514 + 509 (a lone
     * last value), 1600 = 534 + 534 + 532, 800 = 400 + 400 */
    {7, 20, 1537, 0, 0, 0}, {45, 4, 1600, 1, 1, 2}, {43, 70, 800, 0, 1, 2}, {17, 40, 1537, 1, 0, 1},
    /* a transposed A's tiles packed a vector of rows at a time, the last rows
     * one at a time (m around 16, 14 and their multiples) */
    {31, 33, 19, 1, 0, 0},  {17, 45, 6, 1, 1, 3},   {42, 64, 11, 1, 0, 0},
    /* several column blocks, cut into even whole panels (a long k: blocks of
     * 256 columns), and one block wider than 256 (a short k) */
    {20, 900, 700, 0, 1, 0}, {17, 530, 800, 1, 0, 1},
    {20, 600, 50, 0, 1, 0}, {17, 530, 33, 1, 0, 1},
    /* A's rows 16 KB apart (8192 values): its tiles packed from its rows */
    {20, 40, 8190, 0, 0, 2}, {29, 33, 8192, 0, 1, 0}, {3, 50, 8191, 0, 0, 1},
};
#define NCASES ((int)(sizeof(CASES) / sizeof(CASES[0])))

typedef void (*bgemm_block_fn)(const go_gemm_bf16_args *g, int64_t r0, int64_t r1, int64_t j0,
                               int64_t j1, float *work);

static void check_block_kernel(const char *name, bgemm_block_fn block, int nr, int mr) {
    char ctx[192];
    for (int t = 0; t < NCASES; ++t) {
        const bgemm_case *c = &CASES[t];
        /* accumulate, and a packed A packed once per k chunk (pack_a_once, in front
         * of the panels: the scratch just large enough) or per row tile */
        for (int variant = 0; variant < 4; ++variant) {
            const int accumulate = variant & 1, once = variant >> 1;
            const int off = (t + accumulate) % 4;
            bgemm_operands o = make_operands(c, off);
            const int64_t ldc = c->n + c->pad;
            float *cm = th_rand_f32(c->m * ldc, off, -1.0f, 1.0f);
            float *old = th_dup(cm, 4, c->m * ldc);
            const go_gemm_bf16_args g = {c->m, c->n, c->k, o.a, o.a_row, o.a_col, o.b,
                                         o.b_row, o.b_col, cm, ldc, accumulate, 0, once};
            /* a block of whole tiles and panels from the second on, or the whole */
            const int64_t r0 = c->m > mr ? mr : 0, j0 = c->n > nr ? nr : 0;
            const int64_t apart = once && !go_gemm_bf16_a_direct(o.a_row, o.a_col)
                                      ? go_gemm_bf16_a_floats(c->m - r0, c->k) : 0;
            float *work = th_alloc(4, go_gemm_bf16_work_floats(c->k) + apart, 0);
            block(&g, r0, c->m, j0, c->n, work);
            snprintf(ctx, sizeof ctx,
                     "gemm_block_bf16[%s] m=%lld n=%lld k=%lld a_t=%d b_t=%d acc=%d once=%d", name,
                     (long long)c->m, (long long)c->n, (long long)c->k, c->a_t, c->b_t,
                     accumulate, once);
            check_product(c, &o, cm, ldc, old, accumulate, r0, c->m, j0, c->n, ctx);
            th_release_all();
        }
    }
}

/* the whole product of case t on one path's block kernel, into a new C */
static float *whole_product(bgemm_block_fn block, const bgemm_case *c, int off) {
    th_seed(0xbf16ULL + (uint64_t)off);
    bgemm_operands o = make_operands(c, off);
    float *cm = th_alloc(4, c->m * c->n, 0);
    const go_gemm_bf16_args g = {c->m, c->n, c->k, o.a, o.a_row, o.a_col, o.b,
                                 o.b_row, o.b_col, cm, c->n, 0, 0, 0};
    float *work = th_alloc(4, go_gemm_bf16_work_floats(c->k), 0);
    block(&g, 0, c->m, 0, c->n, work);
    return cm;
}

/* C written around the caches (stream_c: a C 64-byte aligned, rows a whole number
 * of cache lines apart) holds the bits of C written through them, for every case,
 * the whole product and a block from the second tile and panel on */
static void check_streamed(const char *name, bgemm_block_fn block, int nr, int mr) {
    char ctx[192];
    for (int t = 0; t < NCASES; ++t) {
        const bgemm_case *c = &CASES[t];
        const int64_t ldc = (c->n + 15) / 16 * 16;
        for (int whole = 0; whole <= 1; ++whole) {
            bgemm_operands o = make_operands(c, t % 4);
            const int64_t r0 = whole || c->m <= mr ? 0 : mr, j0 = whole || c->n <= nr ? 0 : nr;
            float *want = th_rand_f32(c->m * ldc, 0, -1.0f, 1.0f);
            /* exactly C's bytes (a multiple of 64): a write past them is caught */
            float *got = (float *)aligned_alloc(64, (size_t)(c->m * ldc) * sizeof(float));
            memcpy(got, want, (size_t)(c->m * ldc) * sizeof(float));
            go_gemm_bf16_args g = {c->m, c->n, c->k, o.a, o.a_row, o.a_col, o.b,
                                   o.b_row, o.b_col, want, ldc, 0, 0, 0};
            float *work = th_alloc(4, go_gemm_bf16_work_floats(c->k), 0);
            block(&g, r0, c->m, j0, c->n, work);
            g.c = got;
            g.stream_c = 1;
            block(&g, r0, c->m, j0, c->n, work);
            th_miss same = TH_MISS_INIT;
            for (int64_t i = 0; i < c->m * ldc; ++i) th_expect_bits(&same, "C", i, got[i], want[i]);
            snprintf(ctx, sizeof ctx, "gemm_block_bf16[%s] stream_c m=%lld n=%lld k=%lld from (%lld, %lld)",
                     name, (long long)c->m, (long long)c->n, (long long)c->k, (long long)r0,
                     (long long)j0);
            th_report(&same, ctx);
            free(got);
            th_release_all();
        }
    }
}

/* one path's block kernel (the pairs as two FMAs); on the avx512 table, also
 * the vdpbf16ps one where the CPU runs it; and the FMA paths' bits equal the
 * scalar path's (the same chain of FMAs over the same pairs) */
void test_gemm_bf16_kernels(const ggmlopt_kernel_table *k) {
    const int nr = k->sgemm_panel_cols(), mr = k->sgemm_tile_rows();
    check_block_kernel(k->name, k->gemm_block_bf16, nr, mr);
    check_streamed(k->name, k->gemm_block_bf16, nr, mr);
#if defined(__x86_64__) || defined(_M_X64)
    if (k == &ggmlopt_kernels_avx512 && strstr(ggmlopt_cpu_features(), "avx512_bf16=1")) {
        check_block_kernel("avx512 vdpbf16ps", ggmlopt_gemm_block_bf16_avx512bf16, nr, mr);
        check_streamed("avx512 vdpbf16ps", ggmlopt_gemm_block_bf16_avx512bf16, nr, mr);
    }
    else if (k == &ggmlopt_kernels_avx512)
        printf("note: this CPU lacks AVX512-BF16: the vdpbf16ps kernel is not tested\n");
#endif
    if (k == &ggmlopt_kernels_scalar) return;
    char ctx[160];
    for (int t = 0; t < NCASES; ++t) {
        const bgemm_case *c = &CASES[t];
        float *got = whole_product(k->gemm_block_bf16, c, t % 4);
        float *want = whole_product(ggmlopt_kernels_scalar.gemm_block_bf16, c, t % 4);
        th_miss same = TH_MISS_INIT;
        for (int64_t i = 0; i < c->m * c->n; ++i) th_expect_bits(&same, "C", i, got[i], want[i]);
        snprintf(ctx, sizeof ctx, "gemm_block_bf16[%s] against scalar's bits m=%lld n=%lld k=%lld",
                 k->name, (long long)c->m, (long long)c->n, (long long)c->k);
        th_report(&same, ctx);
        th_release_all();
    }
}

/* the public function: threads give the same bits; refused calls write nothing */
void test_gemm_bf16_public(void) {
    char ctx[160];
    for (int t = 0; t < NCASES; ++t) {
        const bgemm_case *c = &CASES[t];
        bgemm_operands o = make_operands(c, 1);
        const int64_t ldc = c->n + c->pad;
        float *first = NULL;
        for (int threads = 1; threads <= 3; ++threads) {
            ggmlopt_set_num_threads(threads);
            float *cm = th_rand_f32(c->m * ldc, 0, -1.0f, 1.0f);
            float *old = th_dup(cm, 4, c->m * ldc);
            const int rc = ggmlopt_gemm_bf16(c->m, c->n, c->k, o.a, o.a_row, o.a_col, o.b,
                                             o.b_row, o.b_col, cm, ldc, threads == 2);
            snprintf(ctx, sizeof ctx, "ggmlopt_gemm_bf16 m=%lld n=%lld k=%lld threads=%d",
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
    uint16_t *a = rand_bf16(6, 0), *b = rand_bf16(6, 0);
    float *cm = th_rand_f32(6, 0, 1.0f, 2.0f);
    th_check(ggmlopt_gemm_bf16(2, 3, 0, a, 1, 1, b, 3, 1, cm, 3, 1) == 0 && cm[0] >= 1.0f,
             "gemm_bf16 k=0 accumulate keeps C");
    th_check(ggmlopt_gemm_bf16(2, 3, 0, a, 1, 1, b, 3, 1, cm, 3, 0) == 0 && cm[0] == 0.0f &&
                 cm[5] == 0.0f,
             "gemm_bf16 k=0 writes zeros");
    /* refusals */
    float *keep = th_rand_f32(6, 0, 1.0f, 2.0f), *ref = th_dup(keep, 4, 6);
    const int rcs[] = {
        ggmlopt_gemm_bf16(-1, 3, 2, a, 2, 1, b, 3, 1, keep, 3, 0),
        ggmlopt_gemm_bf16(2, 3, 2, a, 2, 1, b, 3, 1, keep, 2, 0), /* ldc < n */
        ggmlopt_gemm_bf16(2, 3, 2, a, 2, 2, b, 3, 1, keep, 3, 0), /* no unit stride in A */
        ggmlopt_gemm_bf16(2, 3, 2, a, 2, 1, b, 3, 2, keep, 3, 0), /* none in B */
        ggmlopt_gemm_bf16(2, 3, 2, a, 2, 1, b, -3, 1, keep, 3, 0),
    };
    for (int i = 0; i < 5; ++i)
        th_check(rcs[i] == -1, "gemm_bf16 refusal %d returned %d", i, rcs[i]);
    th_check(memcmp(keep, ref, 6 * sizeof(float)) == 0, "gemm_bf16 refusals wrote nothing");
    th_release_all();
}
