/*
 * The public kernels of ggmlopt.h: pick the SIMD path once, then cut each call
 * into blocks and run the blocks on the thread pool.
 *
 * Reductions are summed block by block in a fixed order, and the block size
 * depends only on the problem size, so a sum is the same whatever the number of
 * threads.
 */
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#if defined(_WIN32)
#include <malloc.h> /* _aligned_malloc */
#endif

#include "ggmlopt.h"
#include "kernel_table.h"
#include "quantize_k.h"
#include "threadpool.h"

#if defined(__x86_64__) || defined(_M_X64)
#include <cpuid.h>
#endif

/* ---- CPU detection and the table of paths --------------------------------- */

typedef struct {
    const char *name;
    const ggmlopt_kernel_table *table; /* NULL: not compiled in */
    int supported;
} go_path;

static go_path paths[] = {
#if defined(__x86_64__) || defined(_M_X64)
    {"avx512", &ggmlopt_kernels_avx512, 0},
    {"avx2", &ggmlopt_kernels_avx2, 0},
#else
    {"avx512", NULL, 0},
    {"avx2", NULL, 0},
#endif
#if defined(__aarch64__)
    {"neon", &ggmlopt_kernels_neon, 1},
#else
    {"neon", NULL, 0},
#endif
    {"scalar", &ggmlopt_kernels_scalar, 1},
};
#define GO_NPATHS ((int)(sizeof(paths) / sizeof(paths[0])))

static char cpu_features[192];
#if defined(__x86_64__) || defined(_M_X64)
/* AVX512-BF16's vdpbf16ps usable (with the ZMM state): the bf16 products' own
 * instruction on the avx512 path */
static int cpu_avx512_bf16 = 0;
#endif
static _Atomic(const ggmlopt_kernel_table *) active = NULL;

#if defined(__x86_64__) || defined(_M_X64)
static unsigned long long go_xgetbv0(void) {
    unsigned int eax, edx;
    __asm__ __volatile__("xgetbv" : "=a"(eax), "=d"(edx) : "c"(0));
    return ((unsigned long long)edx << 32) | eax;
}
#endif

static void detect_cpu(void) {
#if defined(__x86_64__) || defined(_M_X64)
    unsigned int a, b, c, d;
    int avx = 0, fma = 0, f16c = 0, avx2 = 0, osymm = 0;
    if (__get_cpuid(1, &a, &b, &c, &d)) {
        fma = (c >> 12) & 1;
        f16c = (c >> 29) & 1;
        avx = (c >> 28) & 1;
        /* the OS must save the YMM registers on context switches */
        if ((c >> 27) & 1) osymm = (go_xgetbv0() & 6) == 6;
    }
    int avx512f = 0, avx512bw = 0, avx512dq = 0, avx512vl = 0, oszmm = 0;
    int avx512_bf16 = 0, amx_bf16 = 0, amx_tile = 0;
    if (__get_cpuid_count(7, 0, &a, &b, &c, &d)) {
        avx2 = (b >> 5) & 1;
        avx512f = (b >> 16) & 1;
        avx512dq = (b >> 17) & 1;
        avx512bw = (b >> 30) & 1;
        avx512vl = (b >> 31) & 1;
        amx_bf16 = (d >> 22) & 1;
        amx_tile = (d >> 24) & 1;
    }
    /* native bf16 products (the bf16 precision; kernels_avx512bf16.c) */
    if (__get_cpuid_count(7, 1, &a, &b, &c, &d)) avx512_bf16 = (a >> 5) & 1;
    /* ... and the opmask and ZMM registers (XCR0 bits 5, 6, 7) on top of those */
    if (osymm) oszmm = (go_xgetbv0() & 0xE6) == 0xE6;
    const int avx2_ok = avx && avx2 && fma && f16c && osymm;
    paths[1].supported = avx2_ok;
    paths[0].supported = avx2_ok && avx512f && avx512bw && avx512dq && avx512vl && oszmm;
    cpu_avx512_bf16 = paths[0].supported && avx512_bf16;
    snprintf(cpu_features, sizeof(cpu_features),
             "avx=%d avx2=%d fma=%d f16c=%d os_ymm=%d avx512f=%d avx512bw=%d avx512dq=%d "
             "avx512vl=%d os_zmm=%d avx512_bf16=%d amx_tile=%d amx_bf16=%d",
             avx, avx2, fma, f16c, osymm, avx512f, avx512bw, avx512dq, avx512vl, oszmm,
             avx512_bf16 && oszmm, amx_tile, amx_bf16);
#elif defined(__aarch64__)
    snprintf(cpu_features, sizeof(cpu_features), "neon=1");
#else
    cpu_features[0] = '\0';
#endif
}

static const ggmlopt_kernel_table *best_table(void) {
    for (int i = 0; i < GO_NPATHS; ++i)
        if (paths[i].table && paths[i].supported) return paths[i].table;
    return &ggmlopt_kernels_scalar;
}

static const ggmlopt_kernel_table *kernels(void) {
    const ggmlopt_kernel_table *t = atomic_load_explicit(&active, memory_order_acquire);
    if (!t) {
        detect_cpu();
        t = best_table();
        atomic_store_explicit(&active, t, memory_order_release);
    }
    return t;
}

int ggmlopt_simd_count(void) { return GO_NPATHS; }
const char *ggmlopt_simd_name(int i) { return i >= 0 && i < GO_NPATHS ? paths[i].name : NULL; }
int ggmlopt_simd_compiled(int i) { return i >= 0 && i < GO_NPATHS && paths[i].table != NULL; }
int ggmlopt_simd_supported(int i) {
    kernels();
    return i >= 0 && i < GO_NPATHS && paths[i].table != NULL && paths[i].supported;
}
const char *ggmlopt_simd_active(void) { return kernels()->name; }
const char *ggmlopt_cpu_features(void) {
    kernels();
    return cpu_features;
}

int ggmlopt_simd_select(const char *name) {
    kernels();
    if (!name) {
        atomic_store_explicit(&active, best_table(), memory_order_release);
        return 0;
    }
    for (int i = 0; i < GO_NPATHS; ++i) {
        if (strcmp(paths[i].name, name) != 0) continue;
        if (!paths[i].table) return -2;
        if (!paths[i].supported) return -3;
        atomic_store_explicit(&active, paths[i].table, memory_order_release);
        return 0;
    }
    return -1;
}

void ggmlopt_set_num_threads(int n) { go_pool_set_threads(n); }
int64_t ggmlopt_set_pool_linger_ns(int64_t ns) { return go_pool_set_linger_ns(ns); }
int ggmlopt_get_num_threads(void) { return go_pool_threads(); }

/* ---- blocks on threads ---------------------------------------------------- */

#define GO_MAX_BLOCKS 256

typedef double (*go_block_fn)(const void *args, int64_t begin, int64_t end);

typedef struct {
    go_block_fn fn;
    const void *args;
    int64_t n, block;
    int nblocks;
    double *partial;
} go_blocks_job;

static void blocks_one(void *ctx, int b) {
    go_blocks_job *job = (go_blocks_job *)ctx;
    const int64_t begin = b * job->block;
    const int64_t end = begin + job->block < job->n ? begin + job->block : job->n;
    job->partial[b] = job->fn(job->args, begin, end);
}

/* Runs fn over [0, n) in blocks of at least block_min items (a multiple of 16,
 * so threads never share a cache line of output) and returns the sum of what
 * the blocks return, added in block order.  Threads join in only once n reaches
 * parallel_min. */
/* the length of run_blocks' blocks of n items */
static int64_t block_length(int64_t n, int64_t block_min) {
    int64_t block = (n + GO_MAX_BLOCKS - 1) / GO_MAX_BLOCKS;
    if (block < block_min) block = block_min;
    return (block + 15) & ~(int64_t)15;
}

static double run_blocks(int64_t n, int64_t block_min, int64_t parallel_min, go_block_fn fn,
                         const void *args) {
    if (n <= 0) return 0.0;
    const int64_t block = block_length(n, block_min);
    const int nblocks = (int)((n + block - 1) / block);
    if (nblocks == 1) return fn(args, 0, n);

    double partial[GO_MAX_BLOCKS];
    go_blocks_job job = {fn, args, n, block, nblocks, partial};
    if (n >= parallel_min) {
        go_pool_for(nblocks, blocks_one, &job);
    } else {
        for (int b = 0; b < nblocks; ++b) blocks_one(&job, b);
    }
    double s = 0.0;
    for (int b = 0; b < nblocks; ++b) s += partial[b];
    return s;
}

/* Threads join from about 512 KiB of traffic for elementwise kernels and 1 MiB
 * for reductions: below that, waking a worker costs more than it saves. */
#define GO_BLOCK_MIN 16384
#define GO_PARALLEL_MIN_ELEMWISE 65536
#define GO_PARALLEL_MIN_REDUCE 262144

/* Rows (or shards) that make up about items elements. */
static int64_t rows_for(int64_t ncols, int64_t items) {
    const int64_t r = ncols > 0 ? items / ncols : items;
    return r > 0 ? r : 1;
}

/* ---- the public kernels --------------------------------------------------- */

typedef struct { float *w; const float *g; float *m; float *v; const float *params; } adamw_args;
static double adamw_block(const void *p, int64_t b, int64_t e) {
    const adamw_args *a = (const adamw_args *)p;
    kernels()->adamw_step_f32(e - b, a->w + b, a->g + b, a->m + b, a->v + b, a->params);
    return 0.0;
}
void ggmlopt_adamw_step_f32(int64_t n, float *w, const float *g, float *m, float *v,
                            const float params[GGMLOPT_ADAMW_NPARAMS]) {
    adamw_args a = {w, g, m, v, params};
    run_blocks(n, GO_BLOCK_MIN, GO_PARALLEL_MIN_ELEMWISE / 2, adamw_block, &a);
}

typedef struct { float *w; const float *g; float alpha, wd; } sgd_args;
static double sgd_block(const void *p, int64_t b, int64_t e) {
    const sgd_args *a = (const sgd_args *)p;
    kernels()->sgd_step_f32(e - b, a->w + b, a->g + b, a->alpha, a->wd);
    return 0.0;
}
void ggmlopt_sgd_step_f32(int64_t n, float *w, const float *g, float alpha, float wd) {
    sgd_args a = {w, g, alpha, wd};
    run_blocks(n, GO_BLOCK_MIN, GO_PARALLEL_MIN_ELEMWISE, sgd_block, &a);
}

typedef struct { float a; const float *x; float *y; } axpy_args;
static double axpy_block(const void *p, int64_t b, int64_t e) {
    const axpy_args *a = (const axpy_args *)p;
    kernels()->axpy_f32(e - b, a->a, a->x ? a->x + b : NULL, a->y + b);
    return 0.0;
}
void ggmlopt_axpy_f32(int64_t n, float a, const float *x, float *y) {
    axpy_args args = {a, x, y};
    run_blocks(n, GO_BLOCK_MIN, GO_PARALLEL_MIN_ELEMWISE, axpy_block, &args);
}

static double scale_block(const void *p, int64_t b, int64_t e) {
    const axpy_args *a = (const axpy_args *)p;
    kernels()->scale_f32(e - b, a->a, a->y + b);
    return 0.0;
}
void ggmlopt_scale_f32(int64_t n, float a, float *x) {
    axpy_args args = {a, NULL, x};
    run_blocks(n, GO_BLOCK_MIN, GO_PARALLEL_MIN_ELEMWISE, scale_block, &args);
}

static double fill_block(const void *p, int64_t b, int64_t e) {
    const axpy_args *a = (const axpy_args *)p;
    kernels()->fill_f32(e - b, a->a, a->y + b);
    return 0.0;
}
void ggmlopt_fill_f32(int64_t n, float value, float *x) {
    axpy_args args = {value, NULL, x};
    run_blocks(n, GO_BLOCK_MIN, GO_PARALLEL_MIN_ELEMWISE, fill_block, &args);
}

typedef struct { int64_t ncols; float *x; const float *bias; } bias_args;
static double bias_block(const void *p, int64_t b, int64_t e) {
    const bias_args *a = (const bias_args *)p;
    kernels()->add_bias_rows_f32(e - b, a->ncols, a->x + b * a->ncols, a->bias);
    return 0.0;
}
void ggmlopt_add_bias_rows_f32(int64_t nrows, int64_t ncols, float *x, const float *bias) {
    bias_args a = {ncols, x, bias};
    run_blocks(nrows, rows_for(ncols, GO_BLOCK_MIN), rows_for(ncols, GO_PARALLEL_MIN_ELEMWISE),
               bias_block, &a);
}

typedef struct { const float *x, *g; float *y; } relu_args;
static double relu_block(const void *p, int64_t b, int64_t e) {
    const relu_args *a = (const relu_args *)p;
    kernels()->relu_f32(e - b, a->x + b, a->y + b);
    return 0.0;
}
void ggmlopt_relu_f32(int64_t n, const float *x, float *y) {
    relu_args a = {x, NULL, y};
    run_blocks(n, GO_BLOCK_MIN, GO_PARALLEL_MIN_ELEMWISE, relu_block, &a);
}
static double relu_backward_block(const void *p, int64_t b, int64_t e) {
    const relu_args *a = (const relu_args *)p;
    kernels()->relu_backward_f32(e - b, a->x + b, a->g + b, a->y + b);
    return 0.0;
}
void ggmlopt_relu_backward_f32(int64_t n, const float *y, const float *g, float *out) {
    relu_args a = {y, g, out};
    run_blocks(n, GO_BLOCK_MIN, GO_PARALLEL_MIN_ELEMWISE, relu_backward_block, &a);
}

static double sum_block(const void *p, int64_t b, int64_t e) {
    return kernels()->sum_f32(e - b, (const float *)p + b);
}
double ggmlopt_sum_f32(int64_t n, const float *x) {
    return run_blocks(n, GO_BLOCK_MIN, GO_PARALLEL_MIN_REDUCE, sum_block, x);
}

static double sumsq_block(const void *p, int64_t b, int64_t e) {
    return kernels()->sumsq_f32(e - b, (const float *)p + b);
}
double ggmlopt_sumsq_f32(int64_t n, const float *x) {
    return run_blocks(n, GO_BLOCK_MIN, GO_PARALLEL_MIN_REDUCE, sumsq_block, x);
}

typedef struct { int64_t ncols; const float *x; int32_t *out; } argmax_args;
static double argmax_block(const void *p, int64_t b, int64_t e) {
    const argmax_args *a = (const argmax_args *)p;
    kernels()->argmax_rows_f32(e - b, a->ncols, a->x + b * a->ncols, a->out + b);
    return 0.0;
}
void ggmlopt_argmax_rows_f32(int64_t nrows, int64_t ncols, const float *x, int32_t *out) {
    argmax_args a = {ncols, x, out};
    run_blocks(nrows, rows_for(ncols, GO_BLOCK_MIN), rows_for(ncols, GO_PARALLEL_MIN_REDUCE),
               argmax_block, &a);
}

typedef struct { const int32_t *a, *b; } count_args;
static double count_block(const void *p, int64_t b, int64_t e) {
    const count_args *a = (const count_args *)p;
    return (double)kernels()->count_equal_i32(e - b, a->a + b, a->b + b);
}
int64_t ggmlopt_count_equal_i32(int64_t n, const int32_t *a, const int32_t *b) {
    count_args args = {a, b};
    /* each block's count is exact in a double, and so is their sum below 2^53 */
    return (int64_t)run_blocks(n, GO_BLOCK_MIN, GO_PARALLEL_MIN_REDUCE, count_block, &args);
}

typedef struct { int64_t ncols; const float *x, *l; float *grad; float scale; } ce_args;
static double ce_block(const void *p, int64_t b, int64_t e) {
    const ce_args *a = (const ce_args *)p;
    return kernels()->cross_entropy_rows_f32(e - b, a->ncols, a->x + b * a->ncols,
                                             a->l + b * a->ncols,
                                             a->grad ? a->grad + b * a->ncols : NULL, a->scale);
}
double ggmlopt_cross_entropy_f32(int64_t nrows, int64_t ncols, const float *logits,
                                 const float *labels, float *grad, float grad_scale) {
    if (nrows <= 0) return 0.0;
    ce_args a = {ncols, logits, labels, grad, grad_scale / (float)nrows};
    /* exp-bound: a second thread pays off from a few thousand logits */
    const double total = run_blocks(nrows, rows_for(ncols, 1024), rows_for(ncols, 4096), ce_block, &a);
    return total / (double)nrows;
}

typedef struct { const float *out, *l; float *grad; float scale; } se_args;
static double se_block(const void *p, int64_t b, int64_t e) {
    const se_args *a = (const se_args *)p;
    return kernels()->squared_error_f32(e - b, a->out + b, a->l + b, a->grad ? a->grad + b : NULL,
                                        a->scale);
}
double ggmlopt_squared_error_f32(int64_t n, const float *out, const float *labels, float *grad,
                                 float grad_scale) {
    se_args a = {out, labels, grad, grad_scale};
    return run_blocks(n, GO_BLOCK_MIN, GO_PARALLEL_MIN_ELEMWISE, se_block, &a);
}

typedef struct { const void *src; float *dst; float scale; } convert_args;
static double u8_block(const void *p, int64_t b, int64_t e) {
    const convert_args *a = (const convert_args *)p;
    kernels()->convert_u8_f32(e - b, (const uint8_t *)a->src + b, a->dst + b, a->scale);
    return 0.0;
}
void ggmlopt_convert_u8_f32(int64_t n, const uint8_t *src, float *dst, float scale) {
    convert_args a = {src, dst, scale};
    run_blocks(n, GO_BLOCK_MIN, GO_PARALLEL_MIN_REDUCE, u8_block, &a);
}
static double f16_block(const void *p, int64_t b, int64_t e) {
    const convert_args *a = (const convert_args *)p;
    kernels()->convert_f16_f32(e - b, (const uint16_t *)a->src + b, a->dst + b, a->scale);
    return 0.0;
}
void ggmlopt_convert_f16_f32(int64_t n, const uint16_t *src, float *dst, float scale) {
    convert_args a = {src, dst, scale};
    run_blocks(n, GO_BLOCK_MIN, GO_PARALLEL_MIN_REDUCE, f16_block, &a);
}

typedef struct { const float *src; uint16_t *dst; } bf16_args;
static double bf16_block(const void *p, int64_t b, int64_t e) {
    const bf16_args *a = (const bf16_args *)p;
    kernels()->convert_f32_bf16(e - b, a->src + b, a->dst + b);
    return 0.0;
}
void ggmlopt_convert_f32_bf16(int64_t n, const float *src, uint16_t *dst) {
    bf16_args a = {src, dst};
    run_blocks(n, GO_BLOCK_MIN, GO_PARALLEL_MIN_REDUCE, bf16_block, &a);
}

/* ---- dataset shard gathers ----------------------------------------------- */

/* kind 0: raw bytes; 1: uint8 -> float32; 2: float16 -> float32 */
typedef struct {
    int kind;
    int64_t shard;  /* bytes (kind 0) or elements */
    const int64_t *perm;
    const void *src;
    void *dst;
    float scale;
} gather_args;
static double gather_block(const void *p, int64_t b, int64_t e) {
    const gather_args *a = (const gather_args *)p;
    const ggmlopt_kernel_table *k = kernels();
    for (int64_t j = b; j < e; ++j) {
        const int64_t s = a->perm[j];
        switch (a->kind) {
        case 0:
            memcpy((char *)a->dst + j * a->shard, (const char *)a->src + s * a->shard,
                   (size_t)a->shard);
            break;
        case 1:
            k->convert_u8_f32(a->shard, (const uint8_t *)a->src + s * a->shard,
                              (float *)a->dst + j * a->shard, a->scale);
            break;
        default:
            k->convert_f16_f32(a->shard, (const uint16_t *)a->src + s * a->shard,
                               (float *)a->dst + j * a->shard, a->scale);
            break;
        }
    }
    return 0.0;
}
static void gather(gather_args *a, int64_t nshards, int64_t shard_bytes_out) {
    /* a block moves at least 256 KiB; threads from 1 MiB */
    const int64_t per_block = rows_for(shard_bytes_out, 1 << 18);
    const int64_t parallel = rows_for(shard_bytes_out, 1 << 20);
    run_blocks(nshards, per_block, parallel, gather_block, a);
}
void ggmlopt_gather_shards(int64_t nshards, int64_t shard_bytes, const int64_t *perm,
                           const void *src, void *dst) {
    gather_args a = {0, shard_bytes, perm, src, dst, 1.0f};
    gather(&a, nshards, shard_bytes);
}
void ggmlopt_gather_shards_u8_f32(int64_t nshards, int64_t shard_elems, const int64_t *perm,
                                  const uint8_t *src, float *dst, float scale) {
    gather_args a = {1, shard_elems, perm, src, dst, scale};
    gather(&a, nshards, shard_elems * 4);
}
void ggmlopt_gather_shards_f16_f32(int64_t nshards, int64_t shard_elems, const int64_t *perm,
                                   const uint16_t *src, float *dst, float scale) {
    gather_args a = {2, shard_elems, perm, src, dst, scale};
    gather(&a, nshards, shard_elems * 4);
}

/* ---- convolution and pooling ----------------------------------------------- */

/* Runs fn over n images (or planes) of about item_work elements of traffic
 * each, in blocks of whole items: items are independent, so the result is the
 * same for any split, and outputs of one item are large enough that blocks
 * need no alignment. */
static void run_items(int64_t n, int64_t item_work, go_block_fn fn, const void *args) {
    if (n <= 0) return;
    if (item_work < 1) item_work = 1;
    int64_t block = (n + GO_MAX_BLOCKS - 1) / GO_MAX_BLOCKS;
    const int64_t min_items = rows_for(item_work, GO_BLOCK_MIN / 4);
    if (block < min_items) block = min_items;
    const int nblocks = (int)((n + block - 1) / block);
    if (nblocks == 1) {
        fn(args, 0, n);
        return;
    }
    double partial[GO_MAX_BLOCKS];
    go_blocks_job job = {fn, args, n, block, nblocks, partial};
    if (n * item_work >= GO_PARALLEL_MIN_ELEMWISE) {
        go_pool_for(nblocks, blocks_one, &job);
    } else {
        for (int b = 0; b < nblocks; ++b) blocks_one(&job, b);
    }
}

static go_conv_geom conv_geom(int64_t c, int64_t h, int64_t w, int64_t kh, int64_t kw,
                              int64_t sh, int64_t sw, int64_t ph, int64_t pw) {
    go_conv_geom g = {c, h, w, kh, kw, sh, sw, ph, pw, (h + 2 * ph - kh) / sh + 1,
                      (w + 2 * pw - kw) / sw + 1};
    return g;
}

typedef struct {
    go_conv_geom g;
    const float *x;
    float *col;
    int64_t col_image, col_row;
    float *dx;
} conv_args;
static double im2col_block(const void *p, int64_t b, int64_t e) {
    const conv_args *a = (const conv_args *)p;
    kernels()->im2col_f32(&a->g, e - b, a->x + b * a->g.c * a->g.h * a->g.w,
                          a->col + b * a->col_image, a->col_image, a->col_row);
    return 0.0;
}
void ggmlopt_im2col_f32(int64_t n, int64_t c, int64_t h, int64_t w, int64_t kh, int64_t kw,
                        int64_t sh, int64_t sw, int64_t ph, int64_t pw, const float *x,
                        float *col, int64_t col_image, int64_t col_row) {
    conv_args a = {conv_geom(c, h, w, kh, kw, sh, sw, ph, pw), x, col, col_image, col_row, NULL};
    run_items(n, c * kh * kw * a.g.oh * a.g.ow + c * h * w, im2col_block, &a);
}
static double col2im_block(const void *p, int64_t b, int64_t e) {
    const conv_args *a = (const conv_args *)p;
    kernels()->col2im_f32(&a->g, e - b, a->col + b * a->col_image, a->col_image, a->col_row,
                          a->dx + b * a->g.c * a->g.h * a->g.w);
    return 0.0;
}
void ggmlopt_col2im_f32(int64_t n, int64_t c, int64_t h, int64_t w, int64_t kh, int64_t kw,
                        int64_t sh, int64_t sw, int64_t ph, int64_t pw, const float *col,
                        int64_t col_image, int64_t col_row, float *dx) {
    conv_args a = {conv_geom(c, h, w, kh, kw, sh, sw, ph, pw), NULL, (float *)col, col_image,
                   col_row, dx};
    run_items(n, c * kh * kw * a.g.oh * a.g.ow + c * h * w, col2im_block, &a);
}

typedef struct { int64_t c, plane; float *x; const float *bias; } bias_planes_args;
static double bias_planes_block(const void *p, int64_t b, int64_t e) {
    const bias_planes_args *a = (const bias_planes_args *)p;
    kernels()->add_bias_planes_f32(e - b, a->c, a->plane, a->x + b * a->c * a->plane, a->bias);
    return 0.0;
}
void ggmlopt_add_bias_planes_f32(int64_t n, int64_t c, int64_t plane, float *x, const float *bias) {
    bias_planes_args a = {c, plane, x, bias};
    run_items(n, c * plane, bias_planes_block, &a);
}

typedef struct {
    go_pool_geom g;
    const float *x;
    float *y;
    int32_t *idx;
} pool_args;
static go_pool_geom pool_geom(int64_t h, int64_t w, int64_t kh, int64_t kw, int64_t sh,
                              int64_t sw) {
    go_pool_geom g = {h, w, kh, kw, sh, sw, (h - kh) / sh + 1, (w - kw) / sw + 1};
    return g;
}
static int64_t pool_work(const go_pool_geom *g) { return g->h * g->w + g->oh * g->ow * 2; }

static double maxpool_block(const void *p, int64_t b, int64_t e) {
    const pool_args *a = (const pool_args *)p;
    const int64_t in = a->g.h * a->g.w, out = a->g.oh * a->g.ow;
    kernels()->maxpool2d_f32(&a->g, e - b, a->x + b * in, a->y + b * out, a->idx + b * out);
    return 0.0;
}
void ggmlopt_maxpool2d_f32(int64_t nplanes, int64_t h, int64_t w, int64_t kh, int64_t kw,
                           int64_t sh, int64_t sw, const float *x, float *y, int32_t *idx) {
    pool_args a = {pool_geom(h, w, kh, kw, sh, sw), x, y, idx};
    run_items(nplanes, pool_work(&a.g), maxpool_block, &a);
}
/* backward: x is dy, y is dx */
static double maxpool_backward_block(const void *p, int64_t b, int64_t e) {
    const pool_args *a = (const pool_args *)p;
    const int64_t in = a->g.h * a->g.w, out = a->g.oh * a->g.ow;
    kernels()->maxpool2d_backward_f32(&a->g, e - b, a->x + b * out, a->idx + b * out,
                                      a->y + b * in);
    return 0.0;
}
void ggmlopt_maxpool2d_backward_f32(int64_t nplanes, int64_t h, int64_t w, int64_t kh,
                                    int64_t kw, int64_t sh, int64_t sw, const float *dy,
                                    const int32_t *idx, float *dx) {
    pool_args a = {pool_geom(h, w, kh, kw, sh, sw), dy, dx, (int32_t *)idx};
    run_items(nplanes, pool_work(&a.g), maxpool_backward_block, &a);
}
static double avgpool_block(const void *p, int64_t b, int64_t e) {
    const pool_args *a = (const pool_args *)p;
    const int64_t in = a->g.h * a->g.w, out = a->g.oh * a->g.ow;
    kernels()->avgpool2d_f32(&a->g, e - b, a->x + b * in, a->y + b * out);
    return 0.0;
}
void ggmlopt_avgpool2d_f32(int64_t nplanes, int64_t h, int64_t w, int64_t kh, int64_t kw,
                           int64_t sh, int64_t sw, const float *x, float *y) {
    pool_args a = {pool_geom(h, w, kh, kw, sh, sw), x, y, NULL};
    run_items(nplanes, pool_work(&a.g), avgpool_block, &a);
}
static double avgpool_backward_block(const void *p, int64_t b, int64_t e) {
    const pool_args *a = (const pool_args *)p;
    const int64_t in = a->g.h * a->g.w, out = a->g.oh * a->g.ow;
    kernels()->avgpool2d_backward_f32(&a->g, e - b, a->x + b * out, a->y + b * in);
    return 0.0;
}
void ggmlopt_avgpool2d_backward_f32(int64_t nplanes, int64_t h, int64_t w, int64_t kh,
                                    int64_t kw, int64_t sh, int64_t sw, const float *dy,
                                    float *dx) {
    pool_args a = {pool_geom(h, w, kh, kw, sh, sw), dy, dx, NULL};
    run_items(nplanes, pool_work(&a.g), avgpool_backward_block, &a);
}

/* ---- activations ------------------------------------------------------------ */

/* The transcendental ones cost some 2-6 ns an element on one thread: blocks
 * of 4096 and threads from 16384 elements (the elementwise rule above is for
 * kernels that only move memory). */
#define GO_ACT_BLOCK_MIN 4096
#define GO_ACT_PARALLEL_MIN 16384

typedef struct { const float *a, *g; float *out; float param; } act_args;

#define GO_ACTIVATION_FORWARD(name)                                                         \
    static double name##_block(const void *p, int64_t b, int64_t e) {                       \
        const act_args *a = (const act_args *)p;                                            \
        kernels()->name##_f32(e - b, a->a + b, a->out + b);                                 \
        return 0.0;                                                                         \
    }                                                                                       \
    void ggmlopt_##name##_f32(int64_t n, const float *x, float *y) {                        \
        act_args a = {x, NULL, y, 0.0f};                                                    \
        run_blocks(n, GO_ACT_BLOCK_MIN, GO_ACT_PARALLEL_MIN, name##_block, &a);             \
    }
#define GO_ACTIVATION_BACKWARD(name)                                                        \
    static double name##_block(const void *p, int64_t b, int64_t e) {                       \
        const act_args *a = (const act_args *)p;                                            \
        kernels()->name##_f32(e - b, a->a + b, a->g + b, a->out + b);                       \
        return 0.0;                                                                         \
    }                                                                                       \
    void ggmlopt_##name##_f32(int64_t n, const float *in, const float *g, float *out) {     \
        act_args a = {in, g, out, 0.0f};                                                    \
        run_blocks(n, GO_ACT_BLOCK_MIN, GO_ACT_PARALLEL_MIN, name##_block, &a);             \
    }

GO_ACTIVATION_FORWARD(tanh)
GO_ACTIVATION_BACKWARD(tanh_backward)
GO_ACTIVATION_FORWARD(sigmoid)
GO_ACTIVATION_BACKWARD(sigmoid_backward)
GO_ACTIVATION_FORWARD(silu)
GO_ACTIVATION_BACKWARD(silu_backward)
GO_ACTIVATION_FORWARD(gelu)
GO_ACTIVATION_BACKWARD(gelu_backward)
GO_ACTIVATION_FORWARD(gelu_tanh)
GO_ACTIVATION_BACKWARD(gelu_tanh_backward)

/* LeakyReLU only moves memory: the elementwise thresholds */
static double leaky_relu_block(const void *p, int64_t b, int64_t e) {
    const act_args *a = (const act_args *)p;
    kernels()->leaky_relu_f32(e - b, a->a + b, a->out + b, a->param);
    return 0.0;
}
void ggmlopt_leaky_relu_f32(int64_t n, const float *x, float *y, float negative_slope) {
    act_args a = {x, NULL, y, negative_slope};
    run_blocks(n, GO_BLOCK_MIN, GO_PARALLEL_MIN_ELEMWISE, leaky_relu_block, &a);
}
static double leaky_relu_backward_block(const void *p, int64_t b, int64_t e) {
    const act_args *a = (const act_args *)p;
    kernels()->leaky_relu_backward_f32(e - b, a->a + b, a->g + b, a->out + b, a->param);
    return 0.0;
}
void ggmlopt_leaky_relu_backward_f32(int64_t n, const float *x, const float *g, float *out,
                                     float negative_slope) {
    act_args a = {x, g, out, negative_slope};
    run_blocks(n, GO_BLOCK_MIN, GO_PARALLEL_MIN_ELEMWISE, leaky_relu_backward_block, &a);
}

/* ---- cross-entropy against class indices ------------------------------------ */

/* the matrix products' cached scratch (below), lent to other kernels between them */
static float *gemm_scratch(int64_t floats, int *cached);
static void gemm_scratch_done(float *buf, int cached);

typedef struct {
    int64_t ncols; const float *x; const int32_t *c; float *grad; float scale; int32_t *pred;
    uint16_t *grad16;   /* instead of grad: the gradient as bfloat16 bits */
    float *keep;        /* with grad16: ncols floats of scratch a block (or NULL) */
    int64_t block;      /* run_blocks' block length: row r's block is r / block */
} ce_index_args;
/* Rows from which a bf16 gradient's exponentials are kept between the sum and the
 * gradient (kernels/loss.inc), not taken twice */
#define GO_CE_KEEP_MIN 1024
/* Rows from which a row's argmax and its loss run one after the other (the row
 * still in cache for the second); narrower rows take the block's argmax first,
 * keeping the loss kernel's rows-at-once path. */
#define GO_CE_ROWWISE_ARGMAX_MIN 1024
/* rows [b, e) of the loss, their gradient in float32 or bf16 (the rows' argmax
 * in pred already, when asked for) */
static double ce_index_rows(const ce_index_args *a, int64_t b, int64_t e) {
    const int64_t n = a->ncols;
    if (a->grad16)
        return kernels()->cross_entropy_index_rows_g16_f32(
            e - b, n, a->x + b * n, a->c + b, a->grad16 + b * n, a->scale,
            a->pred ? a->pred + b : NULL, a->keep ? a->keep + b / a->block * n : NULL);
    return kernels()->cross_entropy_index_rows_f32(e - b, n, a->x + b * n, a->c + b,
                                                   a->grad ? a->grad + b * n : NULL, a->scale);
}

static double ce_index_block(const void *p, int64_t b, int64_t e) {
    const ce_index_args *a = (const ce_index_args *)p;
    const int64_t n = a->ncols;
    if (a->pred && n >= GO_CE_ROWWISE_ARGMAX_MIN) {
        double total = 0.0;
        for (int64_t r = b; r < e; ++r) {
            kernels()->argmax_rows_f32(1, n, a->x + r * n, a->pred + r);
            total += ce_index_rows(a, r, r + 1);
        }
        return total;
    }
    if (a->pred) kernels()->argmax_rows_f32(e - b, n, a->x + b * n, a->pred + b);
    return ce_index_rows(a, b, e);
}
/* the mean over the labelled rows (masked ones, class < 0, count for nothing), in
 * the blocks of the one-hot path, so every call sums the same rows in the same order */
static double ce_index_mean(ce_index_args a, int64_t nrows) {
    if (nrows <= 0) return 0.0;
    int64_t labelled = 0;
    for (int64_t r = 0; r < nrows; ++r) labelled += a.c[r] >= 0;
    const int64_t denom = labelled > 0 ? labelled : 1;
    a.scale /= (float)denom;
    a.block = block_length(nrows, rows_for(a.ncols, 1024));
    /* the products' scratch (free between products) holds the kept exponentials */
    int cached = 0;
    a.keep = a.grad16 && a.ncols >= GO_CE_KEEP_MIN
                 ? gemm_scratch((nrows + a.block - 1) / a.block * a.ncols, &cached)
                 : NULL;
    const double total = run_blocks(nrows, rows_for(a.ncols, 1024), rows_for(a.ncols, 4096),
                                    ce_index_block, &a);
    if (a.keep) gemm_scratch_done(a.keep, cached);
    return total / (double)denom;
}
double ggmlopt_cross_entropy_index_argmax_f32(int64_t nrows, int64_t ncols, const float *logits,
                                              const int32_t *classes, float *grad,
                                              float grad_scale, int32_t *pred) {
    const ce_index_args a = {ncols, logits, classes, grad, grad_scale, pred, NULL, NULL, 1};
    return ce_index_mean(a, nrows);
}
double ggmlopt_cross_entropy_index_g16_f32(int64_t nrows, int64_t ncols, const float *logits,
                                           const int32_t *classes, uint16_t *grad16,
                                           float grad_scale, int32_t *pred) {
    const ce_index_args a = {ncols, logits, classes, NULL, grad_scale, pred, grad16, NULL, 1};
    return ce_index_mean(a, nrows);
}
double ggmlopt_cross_entropy_index_f32(int64_t nrows, int64_t ncols, const float *logits,
                                       const int32_t *classes, float *grad, float grad_scale) {
    return ggmlopt_cross_entropy_index_argmax_f32(nrows, ncols, logits, classes, grad,
                                                  grad_scale, NULL);
}

/* ---- direct stride-1 convolution ------------------------------------------- */

/* Images per weight-gradient group: each group's sums stay in registers over
 * its images and land in their own partial, and the partials are added in
 * group order, so the gradient depends on the shapes only, never on the
 * threads.  Up to 8 images (fewer register reductions), as many as keep a
 * group's scratch within about 1 MiB (half an L2 here); forward and
 * input-gradient blocks use the same groups. */
#define GO_DIRECT_GROUP_MAX 8
#define GO_DIRECT_GROUP_FLOATS (1 << 18)
#define GO_DIRECT_MAX_SLOTS 64
/* multiply-adds below which the threads are not woken */
#define GO_DIRECT_PARALLEL_MIN 262144

typedef struct {
    go_direct_geom fwd, bwd; /* bwd: the input gradient as a convolution of dy */
    go_pool_geom pool;       /* with a ReLU and max pooling after the convolution */
    int pooled;
    int64_t n, group, groups;
    const float *x, *w, *bias, *dy, *wt;
    float *y, *dx, *partial; /* partial: groups * (dw, db) */
    int32_t *idx;            /* pooled: the pool's indices; y and dy are pooled */
    int with_bias;
    float *slots;
    int64_t slot_size;
    int nslots;
    _Atomic int busy[GO_DIRECT_MAX_SLOTS];
} direct_args;

static go_direct_geom direct_forward_geom(int64_t c, int64_t h, int64_t w, int64_t o,
                                          int64_t kh, int64_t kw, int64_t ph, int64_t pw) {
    go_direct_geom g = {c, h, w, o, kh, kw, ph, pw, h + 2 * ph, w + 2 * pw};
    return g;
}
/* dx = the full convolution of dy with the flipped, transposed weights */
static go_direct_geom direct_input_grad_geom(const go_direct_geom *f) {
    const int64_t oh = f->hp - f->kh + 1, ow = f->wp - f->kw + 1;
    go_direct_geom g = {f->cout, oh, ow, f->cin, f->kh, f->kw, f->kh - 1 - f->top,
                        f->kw - 1 - f->left, f->hs + f->kh - 1, f->ws + f->kw - 1};
    return g;
}
/* floats of one image's convolution output */
static int64_t direct_output_size(const go_direct_geom *g) {
    return g->cout * (g->hp - g->kh + 1) * (g->wp - g->kw + 1);
}
/* n floats rounded up to 64 bytes: every area of a slot starts aligned */
static int64_t direct_round(int64_t n) {
    return (n + GO_DIRECT_MAX_EPR - 1) / GO_DIRECT_MAX_EPR * GO_DIRECT_MAX_EPR;
}
/* one image's scratch for conv2d_direct_f32 */
static int64_t direct_image_scratch(const go_direct_geom *g) {
    return go_direct_padded_size(g, GO_DIRECT_MAX_EPR) +
           g->cout * go_direct_wide_stride(g, GO_DIRECT_MAX_EPR);
}
/* A thread's slot, for the plain and the pooled calls alike.  Forward: one
 * image's scratch, then its convolution output (pooled: the pool reads it
 * there).  Backward: a group's weight-gradient scratch, one image's
 * input-gradient scratch, then the group's output gradients (pooled: scattered
 * there from the pool's). */
static int64_t direct_forward_slot(const go_direct_geom *f) {
    return direct_image_scratch(f) + direct_round(direct_output_size(f));
}
static int64_t direct_group(const go_direct_geom *f) {
    const int64_t per_image = direct_image_scratch(f) + direct_output_size(f);
    const int64_t g = GO_DIRECT_GROUP_FLOATS / per_image;
    return g < 1 ? 1 : g > GO_DIRECT_GROUP_MAX ? GO_DIRECT_GROUP_MAX : g;
}
static int64_t direct_backward_slot(const go_direct_geom *f) {
    const go_direct_geom b = direct_input_grad_geom(f);
    return direct_round(direct_group(f) * (direct_image_scratch(f) + direct_output_size(f)) +
                        direct_image_scratch(&b));
}
static int64_t direct_groups(const go_direct_geom *f, int64_t n) {
    return (n + direct_group(f) - 1) / direct_group(f);
}
/* floats before the slots in a backward workspace: the flipped weights and
 * the groups' partial sums */
static int64_t direct_backward_head(const go_direct_geom *f, int64_t n) {
    const int64_t nw = f->cout * f->cin * f->kh * f->kw;
    return nw + direct_groups(f, n) * (nw + f->cout);
}

int64_t ggmlopt_conv2d_direct_workspace(int64_t n, int64_t c, int64_t h, int64_t w, int64_t o,
                                        int64_t kh, int64_t kw, int64_t ph, int64_t pw,
                                        int nthreads) {
    if (nthreads < 1) nthreads = 1;
    if (nthreads > GO_DIRECT_MAX_SLOTS) nthreads = GO_DIRECT_MAX_SLOTS;
    const go_direct_geom f = direct_forward_geom(c, h, w, o, kh, kw, ph, pw);
    /* the slots start at the first 64-byte boundary after the head */
    const int64_t forward = nthreads * direct_forward_slot(&f);
    const int64_t backward = direct_backward_head(&f, n) + nthreads * direct_backward_slot(&f);
    return (forward > backward ? forward : backward) + GO_DIRECT_MAX_EPR;
}

/* A free slot of scratch: at most one block per thread runs at a time, so
 * one is free (or about to be) whenever a block starts. */
static int direct_claim(direct_args *a) {
    for (;;) {
        for (int s = 0; s < a->nslots; ++s) {
            int expected = 0;
            if (atomic_compare_exchange_strong(&a->busy[s], &expected, 1)) return s;
        }
    }
}
static void direct_release(direct_args *a, int s) { atomic_store(&a->busy[s], 0); }

static void direct_run(direct_args *a, go_pool_block_fn fn, int64_t madds) {
    const int nblocks = (int)a->groups;
    for (int s = 0; s < GO_DIRECT_MAX_SLOTS; ++s) atomic_init(&a->busy[s], 0);
    if (nblocks > 1 && a->nslots > 1 && madds >= GO_DIRECT_PARALLEL_MIN) {
        go_pool_for(nblocks, fn, a);
    } else {
        for (int b = 0; b < nblocks; ++b) fn(a, b);
    }
}

static int direct_slots(direct_args *a, float *work, int64_t work_size, int64_t head,
                        int64_t slot) {
    float *base = work + head;
    const uintptr_t misaligned = (uintptr_t)base % (GO_DIRECT_MAX_EPR * sizeof(float));
    if (misaligned % sizeof(float) == 0 && misaligned)
        base += (GO_DIRECT_MAX_EPR * sizeof(float) - misaligned) / sizeof(float);
    int64_t fit = (work + work_size - base) / slot;
    int64_t t = go_pool_threads();
    if (fit > t) fit = t;
    if (fit > GO_DIRECT_MAX_SLOTS) fit = GO_DIRECT_MAX_SLOTS;
    if (fit < 1) return -1;
    a->slots = base;
    a->slot_size = slot;
    a->nslots = (int)fit;
    return 0;
}

static void direct_init(direct_args *a, int64_t n, int64_t c, int64_t h, int64_t w, int64_t o,
                        int64_t kh, int64_t kw, int64_t ph, int64_t pw, const int64_t *pool) {
    memset(a, 0, sizeof(*a));
    a->fwd = direct_forward_geom(c, h, w, o, kh, kw, ph, pw);
    a->bwd = direct_input_grad_geom(&a->fwd);
    a->n = n;
    a->group = direct_group(&a->fwd);
    a->groups = direct_groups(&a->fwd, n);
    if (pool) {
        a->pooled = 1;
        a->pool = pool_geom(h + 2 * ph - kh + 1, w + 2 * pw - kw + 1, pool[0], pool[1], pool[2],
                            pool[3]);
    }
}

static void direct_forward_block(void *p, int b) {
    direct_args *a = (direct_args *)p;
    const go_direct_geom *g = &a->fwd;
    const int64_t i0 = (int64_t)b * a->group;
    const int64_t i1 = i0 + a->group < a->n ? i0 + a->group : a->n;
    const int64_t out = direct_output_size(g), in = g->cin * g->hs * g->ws;
    const int s = direct_claim(a);
    float *scratch = a->slots + s * a->slot_size;
    const ggmlopt_kernel_table *k = kernels();
    if (!a->pooled) {
        k->conv2d_direct_f32(g, i1 - i0, a->x + i0 * in, a->w, a->bias, a->y + i0 * out,
                             scratch);
    } else {
        /* each image's output stays in the slot, where the pool reads it */
        float *conv = scratch + direct_image_scratch(g);
        const int64_t pout = g->cout * a->pool.oh * a->pool.ow;
        for (int64_t i = i0; i < i1; ++i) {
            k->conv2d_direct_f32(g, 1, a->x + i * in, a->w, a->bias, conv, scratch);
            k->maxpool2d_relu_f32(&a->pool, g->cout, conv, a->y + i * pout, a->idx + i * pout);
        }
    }
    direct_release(a, s);
}

static int direct_forward(direct_args *a, const float *x, const float *weight, const float *bias,
                          float *y, int32_t *idx, float *work, int64_t work_size) {
    if (a->n <= 0) return 0;
    a->x = x;
    a->w = weight;
    a->bias = bias;
    a->y = y;
    a->idx = idx;
    if (direct_slots(a, work, work_size, 0, direct_forward_slot(&a->fwd)) != 0) return -1;
    const go_direct_geom *g = &a->fwd;
    direct_run(a, direct_forward_block, a->n * direct_output_size(g) * g->cin * g->kh * g->kw);
    return 0;
}

int ggmlopt_conv2d_direct_f32(int64_t n, int64_t c, int64_t h, int64_t w, int64_t o, int64_t kh,
                              int64_t kw, int64_t ph, int64_t pw, const float *x,
                              const float *weight, const float *bias, float *y, float *work,
                              int64_t work_size) {
    direct_args a;
    direct_init(&a, n, c, h, w, o, kh, kw, ph, pw, NULL);
    return direct_forward(&a, x, weight, bias, y, NULL, work, work_size);
}

int ggmlopt_conv2d_direct_relu_maxpool_f32(int64_t n, int64_t c, int64_t h, int64_t w, int64_t o,
                                           int64_t kh, int64_t kw, int64_t ph, int64_t pw,
                                           int64_t pkh, int64_t pkw, int64_t psh, int64_t psw,
                                           const float *x, const float *weight,
                                           const float *bias, float *y, int32_t *idx,
                                           float *work, int64_t work_size) {
    const int64_t pool[4] = {pkh, pkw, psh, psw};
    direct_args a;
    direct_init(&a, n, c, h, w, o, kh, kw, ph, pw, pool);
    return direct_forward(&a, x, weight, bias, y, idx, work, work_size);
}

static void direct_backward_block(void *p, int b) {
    direct_args *a = (direct_args *)p;
    const go_direct_geom *g = &a->fwd;
    const int64_t i0 = (int64_t)b * a->group;
    const int64_t i1 = i0 + a->group < a->n ? i0 + a->group : a->n;
    const int64_t out = direct_output_size(g), in = g->cin * g->hs * g->ws;
    const int64_t nw = g->cout * g->cin * g->kh * g->kw;
    const int s = direct_claim(a);
    float *scratch = a->slots + s * a->slot_size;
    float *dx_scratch = scratch + a->group * direct_image_scratch(g);
    const ggmlopt_kernel_table *k = kernels();
    const float *dy = a->dy + i0 * out;
    if (a->pooled) {
        /* the group's output gradients, scattered from the pool's into the slot */
        float *d = dx_scratch + direct_image_scratch(&a->bwd);
        const int64_t pout = g->cout * a->pool.oh * a->pool.ow;
        for (int64_t i = i0; i < i1; ++i)
            k->maxpool2d_relu_backward_f32(&a->pool, g->cout, a->dy + i * pout,
                                           a->idx + i * pout, a->y + i * pout,
                                           d + (i - i0) * out);
        dy = d;
    }
    float *part = a->partial + b * (nw + g->cout);
    k->conv2d_direct_weight_grad_f32(g, i1 - i0, a->x + i0 * in, dy, part,
                                     a->with_bias ? part + nw : NULL, scratch);
    if (a->dx)
        k->conv2d_direct_f32(&a->bwd, i1 - i0, dy, a->wt, NULL, a->dx + i0 * in, dx_scratch);
    direct_release(a, s);
}

static int direct_backward(direct_args *a, const float *x, const float *weight, const float *dy,
                           const int32_t *idx, const float *y, float *dx, float *dw, float *db,
                           float *work, int64_t work_size) {
    const go_direct_geom *g = &a->fwd;
    const int64_t taps = g->kh * g->kw, nw = g->cout * g->cin * taps, o = g->cout, c = g->cin;
    if (a->n <= 0) {
        for (int64_t i = 0; i < nw; ++i) dw[i] = 0.0f;
        if (db)
            for (int64_t i = 0; i < o; ++i) db[i] = 0.0f;
        return 0;
    }
    a->x = x;
    a->dy = dy;
    a->idx = (int32_t *)idx;
    a->y = (float *)y;
    a->dx = dx;
    a->with_bias = db != NULL;
    const int64_t head = direct_backward_head(g, a->n);
    if (direct_slots(a, work, work_size, head, direct_backward_slot(g)) != 0) return -1;
    float *wt = work;
    a->partial = work + nw;
    /* wt[ci, oi, ky, kx] = weight[oi, ci, kh-1-ky, kw-1-kx] */
    for (int64_t oi = 0; oi < o; ++oi)
        for (int64_t ci = 0; ci < c; ++ci)
            for (int64_t t = 0; t < taps; ++t)
                wt[(ci * o + oi) * taps + (taps - 1 - t)] = weight[(oi * c + ci) * taps + t];
    a->wt = wt;
    direct_run(a, direct_backward_block, (dx ? 2 : 1) * a->n * direct_output_size(g) * c * taps);
    /* the groups' partials, added in group order */
    const int64_t stride = nw + o;
    for (int64_t i = 0; i < nw; ++i) {
        float s = a->partial[i];
        for (int64_t b = 1; b < a->groups; ++b) s += a->partial[b * stride + i];
        dw[i] = s;
    }
    if (db) {
        for (int64_t i = 0; i < o; ++i) {
            float s = a->partial[nw + i];
            for (int64_t b = 1; b < a->groups; ++b) s += a->partial[b * stride + nw + i];
            db[i] = s;
        }
    }
    return 0;
}

int ggmlopt_conv2d_direct_backward_f32(int64_t n, int64_t c, int64_t h, int64_t w, int64_t o,
                                       int64_t kh, int64_t kw, int64_t ph, int64_t pw,
                                       const float *x, const float *weight, const float *dy,
                                       float *dx, float *dw, float *db, float *work,
                                       int64_t work_size) {
    direct_args a;
    direct_init(&a, n, c, h, w, o, kh, kw, ph, pw, NULL);
    return direct_backward(&a, x, weight, dy, NULL, NULL, dx, dw, db, work, work_size);
}

int ggmlopt_conv2d_direct_relu_maxpool_backward_f32(
    int64_t n, int64_t c, int64_t h, int64_t w, int64_t o, int64_t kh, int64_t kw, int64_t ph,
    int64_t pw, int64_t pkh, int64_t pkw, int64_t psh, int64_t psw, const float *x,
    const float *weight, const float *dy, const int32_t *idx, const float *y, float *dx,
    float *dw, float *db, float *work, int64_t work_size) {
    const int64_t pool[4] = {pkh, pkw, psh, psw};
    direct_args a;
    direct_init(&a, n, c, h, w, o, kh, kw, ph, pw, pool);
    return direct_backward(&a, x, weight, dy, idx, y, dx, dw, db, work, work_size);
}

/* ---- ReLU then max pooling ----------------------------------------------------- */

typedef struct {
    go_pool_geom g;
    const float *x, *y_in;
    float *y;
    int32_t *idx;
} relu_pool_args;
static double maxpool_relu_block(const void *p, int64_t b, int64_t e) {
    const relu_pool_args *a = (const relu_pool_args *)p;
    const int64_t in = a->g.h * a->g.w, out = a->g.oh * a->g.ow;
    kernels()->maxpool2d_relu_f32(&a->g, e - b, a->x + b * in, a->y + b * out, a->idx + b * out);
    return 0.0;
}
void ggmlopt_maxpool2d_relu_f32(int64_t nplanes, int64_t h, int64_t w, int64_t kh, int64_t kw,
                                int64_t sh, int64_t sw, const float *x, float *y, int32_t *idx) {
    relu_pool_args a = {pool_geom(h, w, kh, kw, sh, sw), x, NULL, y, idx};
    run_items(nplanes, pool_work(&a.g), maxpool_relu_block, &a);
}
/* backward: x is dy, y_in the forward output, y is dx */
static double maxpool_relu_backward_block(const void *p, int64_t b, int64_t e) {
    const relu_pool_args *a = (const relu_pool_args *)p;
    const int64_t in = a->g.h * a->g.w, out = a->g.oh * a->g.ow;
    kernels()->maxpool2d_relu_backward_f32(&a->g, e - b, a->x + b * out, a->idx + b * out,
                                           a->y_in + b * out, a->y + b * in);
    return 0.0;
}
void ggmlopt_maxpool2d_relu_backward_f32(int64_t nplanes, int64_t h, int64_t w, int64_t kh,
                                         int64_t kw, int64_t sh, int64_t sw, const float *dy,
                                         const int32_t *idx, const float *y, float *dx) {
    relu_pool_args a = {pool_geom(h, w, kh, kw, sh, sw), dy, y, dx, (int32_t *)idx};
    run_items(nplanes, pool_work(&a.g), maxpool_relu_backward_block, &a);
}

/* ---- language-model layers ---------------------------------------------------- */

typedef struct {
    int64_t n, dim;
    const int32_t *ids;
    const float *src;
    float *dst;
} embedding_args;

static double embedding_block(const void *p, int64_t b, int64_t e) {
    const embedding_args *a = (const embedding_args *)p;
    kernels()->embedding_f32(e - b, a->dim, a->ids + b, a->src, a->dst + b * a->dim);
    return 0.0;
}
void ggmlopt_embedding_f32(int64_t n, int64_t dim, const int32_t *ids, const float *weight,
                           float *out) {
    embedding_args a = {n, dim, ids, weight, out};
    run_blocks(n, rows_for(dim, GO_BLOCK_MIN), rows_for(dim, GO_PARALLEL_MIN_ELEMWISE),
               embedding_block, &a);
}

/* Blocks of weight rows: each scans all the ids and adds those in its range. */
static double embedding_backward_block(const void *p, int64_t b, int64_t e) {
    const embedding_args *a = (const embedding_args *)p;
    kernels()->embedding_backward_f32(a->n, a->dim, a->ids, a->src, b, e, a->dst);
    return 0.0;
}
void ggmlopt_embedding_backward_f32(int64_t n, int64_t dim, const int32_t *ids,
                                    const float *grad, int64_t num, float *grad_weight) {
    if (n <= 0 || dim <= 0 || num <= 0) return;
    embedding_args a = {n, dim, ids, grad, grad_weight};
    if (n * dim < GO_PARALLEL_MIN_ELEMWISE) {
        kernels()->embedding_backward_f32(n, dim, ids, grad, 0, num, grad_weight);
        return;
    }
    /* every block reads all n ids: two blocks a thread, enough to even out the
     * load without rescanning the ids often (any split gives the same bits) */
    const int64_t nblocks = 2 * (int64_t)go_pool_threads();
    run_blocks(num, (num + nblocks - 1) / nblocks, 0, embedding_backward_block, &a);
}

typedef struct {
    int64_t nrows, dim;
    const float *x, *w, *b, *mean, *rstd, *dy;
    float *y, *out_mean, *out_rstd, *dw, *db;
    float eps;
    float *work;   /* backward: the blocks' partial sums (8-byte aligned) */
    int64_t block; /* backward: rows a block */
} norm_args;

/* A row costs some 2-4 passes over dim floats: blocks of about 4096 elements,
 * threads from 32768 */
#define GO_NORM_BLOCK_MIN 4096
#define GO_NORM_PARALLEL_MIN 32768

static double rmsnorm_block(const void *p, int64_t b, int64_t e) {
    const norm_args *a = (const norm_args *)p;
    kernels()->rmsnorm_f32(e - b, a->dim, a->x + b * a->dim, a->w, a->eps, a->y + b * a->dim,
                           a->out_rstd + b);
    return 0.0;
}
void ggmlopt_rmsnorm_f32(int64_t nrows, int64_t dim, const float *x, const float *weight,
                         float eps, float *y, float *rstd) {
    if (dim <= 0) return;
    norm_args a = {nrows, dim, x, weight, NULL, NULL, NULL, NULL, y, NULL, rstd, NULL, NULL, eps,
                   NULL, 0};
    run_blocks(nrows, rows_for(dim, GO_NORM_BLOCK_MIN), rows_for(dim, GO_NORM_PARALLEL_MIN),
               rmsnorm_block, &a);
}

static double layernorm_block(const void *p, int64_t b, int64_t e) {
    const norm_args *a = (const norm_args *)p;
    kernels()->layernorm_f32(e - b, a->dim, a->x + b * a->dim, a->w, a->b, a->eps,
                             a->y + b * a->dim, a->out_mean + b, a->out_rstd + b);
    return 0.0;
}
void ggmlopt_layernorm_f32(int64_t nrows, int64_t dim, const float *x, const float *weight,
                           const float *bias, float eps, float *y, float *mean, float *rstd) {
    if (dim <= 0) return;
    norm_args a = {nrows, dim, x, weight, bias, NULL, NULL, NULL, y, mean, rstd, NULL, NULL, eps,
                   NULL, 0};
    run_blocks(nrows, rows_for(dim, GO_NORM_BLOCK_MIN), rows_for(dim, GO_NORM_PARALLEL_MIN),
               layernorm_block, &a);
}

/* Backward blocks: at least 4x the forward's, so a block's partial sums (the
 * work area) stay few; they depend on the shape only. */
static int64_t norm_backward_block_rows(int64_t nrows, int64_t dim) {
    int64_t block = (nrows + GO_MAX_BLOCKS - 1) / GO_MAX_BLOCKS;
    const int64_t min = rows_for(dim, 4 * GO_NORM_BLOCK_MIN);
    if (block < min) block = min;
    return (block + 15) & ~(int64_t)15; /* as run_blocks rounds it */
}
/* a block's part of the work area: partial sums pw, pb (dim doubles each) and
 * the kernel's run accumulators (2 * dim floats) */
#define GO_NORM_WORK_PER_COL 6

int64_t ggmlopt_norm_backward_work_size(int64_t nrows, int64_t dim) {
    if (nrows <= 0 || dim <= 0) return 0;
    const int64_t block = norm_backward_block_rows(nrows, dim);
    return (nrows + block - 1) / block * GO_NORM_WORK_PER_COL * dim;
}

static double norm_backward_block(const void *p, int64_t b, int64_t e) {
    const norm_args *a = (const norm_args *)p;
    double *pw = NULL, *pb = NULL;
    float *acc = NULL;
    if (a->dw || a->db) {
        double *part = (double *)a->work + (b / a->block) * (GO_NORM_WORK_PER_COL / 2) * a->dim;
        pw = part;
        pb = part + a->dim;
        acc = (float *)(part + 2 * a->dim);
    }
    kernels()->norm_backward_f32(e - b, a->dim, a->x + b * a->dim, a->w,
                                 a->mean ? a->mean + b : NULL, a->rstd + b, a->dy + b * a->dim,
                                 a->y ? a->y + b * a->dim : NULL, pw, pb, acc);
    return 0.0;
}
/* dx and the blocks' partial parameter sums in one pass over the rows, then
 * the partial sums added in block order (the same bits on any number of
 * threads) */
static void norm_backward(norm_args *a, float *dx) {
    if (a->nrows <= 0 || a->dim <= 0 || (!dx && !a->dw && !a->db)) return;
    a->y = dx;
    a->block = norm_backward_block_rows(a->nrows, a->dim);
    run_blocks(a->nrows, a->block, rows_for(a->dim, GO_NORM_PARALLEL_MIN), norm_backward_block, a);
    if (!a->dw && !a->db) return;
    const int64_t nblocks = (a->nrows + a->block - 1) / a->block;
    const int64_t stride = (GO_NORM_WORK_PER_COL / 2) * a->dim;
    const double *part = (const double *)a->work;
    for (int64_t j = 0; j < a->dim; ++j) {
        double sw = 0.0, sb = 0.0;
        for (int64_t k = 0; k < nblocks; ++k) {
            sw += part[k * stride + j];
            sb += part[k * stride + a->dim + j];
        }
        if (a->dw) a->dw[j] += (float)sw;
        if (a->db) a->db[j] += (float)sb;
    }
}
void ggmlopt_rmsnorm_backward_f32(int64_t nrows, int64_t dim, const float *x, const float *weight,
                                  const float *rstd, const float *grad_y, float *grad_x,
                                  float *grad_weight, float *work) {
    norm_args a = {nrows, dim, x, weight, NULL, NULL, rstd, grad_y, NULL, NULL, NULL,
                   grad_weight, NULL, 0.0f, work, 0};
    norm_backward(&a, grad_x);
}
void ggmlopt_layernorm_backward_f32(int64_t nrows, int64_t dim, const float *x,
                                    const float *weight, const float *mean, const float *rstd,
                                    const float *grad_y, float *grad_x, float *grad_weight,
                                    float *grad_bias, float *work) {
    norm_args a = {nrows, dim, x, weight, NULL, mean, rstd, grad_y, NULL, NULL, NULL,
                   grad_weight, grad_bias, 0.0f, work, 0};
    norm_backward(&a, grad_x);
}

typedef struct { const float *gate, *up, *dh; float *h, *du; } swiglu_args;

static double swiglu_block(const void *p, int64_t b, int64_t e) {
    const swiglu_args *a = (const swiglu_args *)p;
    kernels()->swiglu_f32(e - b, a->gate + b, a->up + b, a->h + b);
    return 0.0;
}
void ggmlopt_swiglu_f32(int64_t n, const float *gate, const float *up, float *h) {
    swiglu_args a = {gate, up, NULL, h, NULL};
    run_blocks(n, GO_ACT_BLOCK_MIN, GO_ACT_PARALLEL_MIN, swiglu_block, &a);
}
static double swiglu_backward_block(const void *p, int64_t b, int64_t e) {
    const swiglu_args *a = (const swiglu_args *)p;
    kernels()->swiglu_backward_f32(e - b, a->gate + b, a->up + b, a->dh + b, a->h + b, a->du + b);
    return 0.0;
}
void ggmlopt_swiglu_backward_f32(int64_t n, const float *gate, const float *up,
                                 const float *grad_h, float *grad_gate, float *grad_up) {
    swiglu_args a = {gate, up, grad_h, grad_gate, grad_up};
    run_blocks(n, GO_ACT_BLOCK_MIN, GO_ACT_PARALLEL_MIN, swiglu_backward_block, &a);
}

/* Scratch for the kernels on 64-byte boundaries: they load it a vector at a
 * time, and malloc's 16-byte alignment split every AVX-512 load across two cache
 * lines (the GEMM's packed panels: a 256 x 576 x 576 product on one core,
 * 155 -> 164-174 GFLOP/s). */
static float *alloc_floats64(int64_t floats) {
    const size_t bytes = ((size_t)floats * sizeof(float) + 63) / 64 * 64;
#if defined(_WIN32)
    return (float *)_aligned_malloc(bytes, 64);
#else
    return (float *)aligned_alloc(64, bytes);
#endif
}

static void free_floats64(float *buf) {
#if defined(_WIN32)
    _aligned_free(buf);
#else
    free(buf);
#endif
}

/* ---- causal attention and rotary embedding ----------------------------------- */

/* multiply-adds below which the threads are not woken */
#define GO_ATTN_PARALLEL_MIN 262144

static int attn_shape_ok(int64_t batch, int64_t seq, int64_t n_heads, int64_t n_kv_heads,
                         int64_t head_dim) {
    return batch >= 0 && seq >= 0 && n_heads >= 1 && n_kv_heads >= 1 &&
           n_heads % n_kv_heads == 0 && head_dim >= 1 && head_dim <= GO_ATTN_MAX_D;
}

typedef struct {
    go_attn_args a;
    int64_t nblocks; /* query blocks per head */
    int64_t rows;    /* rows per query block */
} attn_job;

/* Item it: a query block of one head; a head's blocks come one after the
 * other, the latest (longest: causal) first, so the blocks running together
 * share the head's keys and values in cache.  Each output row is computed by
 * one item in one way: the result does not depend on the threads. */
static void attn_forward_item(void *p, int it) {
    const attn_job *job = (const attn_job *)p;
    const int64_t qb = job->nblocks - 1 - it % job->nblocks, bh = it / job->nblocks;
    const int64_t i0 = qb * job->rows;
    const int64_t i1 = i0 + job->rows < job->a.seq ? i0 + job->rows : job->a.seq;
    kernels()->attention_forward_f32(&job->a, bh / job->a.n_heads, bh % job->a.n_heads, i0, i1);
}

static void attn_backward_item(void *p, int it) {
    const attn_job *job = (const attn_job *)p;
    kernels()->attention_backward_f32(&job->a, it / job->a.n_kv_heads, it % job->a.n_kv_heads);
}

/* Fewer (batch, kv head) items than the threads can share evenly (batch 1 of a
 * model with 2 to 8 kv heads): the backward in waves of key tiles.  First each
 * (item, tile) of the wave computes its tile's dk and dv and stores its ds
 * blocks, then each (item, query head, query block) adds those blocks into its
 * dq rows: the additions attention_backward_f32 makes, in its order, so the
 * same bits on any number of threads.  A wave's store is bounded. */
#define GO_ATTN_SPLIT_STORE_BYTES ((int64_t)32 << 20)
#define GO_ATTN_DS_BLOCK (GO_ATTN_BQ_BWD * GO_ATTN_BK_BWD)

typedef struct {
    const go_attn_args *a;
    float *dss;
    int64_t nib, tiles, j_from, i_from;
} attn_wave;

/* (tile, item), the tiles with more query rows after them first */
static void attn_keys_item(void *p, int it) {
    const attn_wave *w = (const attn_wave *)p;
    const int64_t items = w->a->batch * w->a->n_kv_heads;
    const int64_t group = w->a->n_heads / w->a->n_kv_heads;
    const int64_t t = it / items, bg = it % items;
    float *dss = w->dss + (bg * w->tiles + t) * group * w->nib * GO_ATTN_DS_BLOCK;
    kernels()->attention_backward_keys_f32(w->a, bg / w->a->n_kv_heads, bg % w->a->n_kv_heads,
                                           w->j_from + t * GO_ATTN_BK_BWD, dss, w->nib);
}

/* (item, query head, query block), the blocks with more tiles before them first */
static void attn_dq_item(void *p, int it) {
    const attn_wave *w = (const attn_wave *)p;
    const go_attn_args *a = w->a;
    const int64_t blocks = w->nib - w->i_from, group = a->n_heads / a->n_kv_heads;
    const int64_t mi = w->nib - 1 - it % blocks, bh = it / blocks;
    const int64_t b = bh / a->n_heads, h = bh % a->n_heads;
    const float *dss =
        w->dss + (b * a->n_kv_heads + h / group) * w->tiles * group * w->nib * GO_ATTN_DS_BLOCK;
    kernels()->attention_backward_dq_f32(a, b, h, mi * GO_ATTN_BQ_BWD, w->j_from,
                                         w->j_from + w->tiles * GO_ATTN_BK_BWD, dss, w->nib,
                                         w->j_from == 0);
}

/* 1 when it ran the backward in waves, 0 when the (batch, kv head) items suit
 * the threads (or one thread, one key tile, or no memory for a wave) */
static int attn_backward_split(attn_job *job, int64_t items, int64_t madds) {
    const go_attn_args *a = &job->a;
    const int64_t threads = go_pool_threads();
    const int64_t tiles = (a->seq + GO_ATTN_BK_BWD - 1) / GO_ATTN_BK_BWD;
    if (threads < 2 || tiles < 2 || madds < GO_ATTN_PARALLEL_MIN) return 0;
    if (items >= threads && (items % threads == 0 || items >= 2 * threads)) return 0;
    const int64_t nib = (a->seq + GO_ATTN_BQ_BWD - 1) / GO_ATTN_BQ_BWD;
    const int64_t tile_bytes =
        a->batch * a->n_heads * nib * GO_ATTN_DS_BLOCK * (int64_t)sizeof(float);
    int64_t wave = (2 * threads + items - 1) / items;
    if (wave > tiles) wave = tiles;
    if (wave * tile_bytes > GO_ATTN_SPLIT_STORE_BYTES)
        wave = GO_ATTN_SPLIT_STORE_BYTES / tile_bytes;
    if (wave < 1) return 0;
    float *dss = alloc_floats64(wave * tile_bytes / (int64_t)sizeof(float));
    if (!dss) return 0;
    for (int64_t t0 = 0; t0 < tiles; t0 += wave) {
        attn_wave w = {a, dss, nib, tiles - t0 < wave ? tiles - t0 : wave, t0 * GO_ATTN_BK_BWD,
                       t0 * GO_ATTN_BK_BWD / GO_ATTN_BQ_BWD};
        go_pool_for((int)(w.tiles * items), attn_keys_item, &w);
        go_pool_for((int)(a->batch * a->n_heads * (nib - w.i_from)), attn_dq_item, &w);
    }
    free_floats64(dss);
    return 1;
}

static void attn_run(int64_t nitems, int64_t madds, go_pool_block_fn fn, attn_job *job) {
    if (nitems > 1 && madds >= GO_ATTN_PARALLEL_MIN) {
        go_pool_for((int)nitems, fn, job);
    } else {
        for (int64_t i = 0; i < nitems; ++i) fn(job, (int)i);
    }
}

/* The arguments both directions share; the backward adds its gradients. */
static void attn_job_init(attn_job *job, int64_t batch, int64_t seq, int64_t n_heads,
                          int64_t n_kv_heads, int64_t head_dim, const float *q, int64_t q_stride,
                          const float *k, int64_t k_stride, const float *v, int64_t v_stride,
                          float *out, int64_t out_stride, float *lse) {
    memset(job, 0, sizeof *job);
    go_attn_args *a = &job->a;
    a->batch = batch;
    a->seq = seq;
    a->n_heads = n_heads;
    a->n_kv_heads = n_kv_heads;
    a->head_dim = head_dim;
    a->q = q;
    a->k = k;
    a->v = v;
    a->q_stride = q_stride;
    a->k_stride = k_stride;
    a->v_stride = v_stride;
    a->out = out;
    a->out_stride = out_stride;
    a->lse = lse;
    a->scale = (float)(1.0 / sqrt((double)head_dim));
}

/* kv_start NULL, or each row's first key in [0, i], non-decreasing along each item */
static int attn_starts_ok(int64_t batch, int64_t seq, const int32_t *kv_start) {
    if (!kv_start) return 1;
    for (int64_t b = 0; b < batch; ++b) {
        const int32_t *f = kv_start + b * seq;
        for (int64_t i = 0; i < seq; ++i)
            if (f[i] < 0 || f[i] > i || (i > 0 && f[i] < f[i - 1])) return 0;
    }
    return 1;
}

int ggmlopt_attention_forward_f32(int64_t batch, int64_t seq, int64_t n_heads, int64_t n_kv_heads,
                                  int64_t head_dim, const float *q, int64_t q_stride,
                                  const float *k, int64_t k_stride, const float *v,
                                  int64_t v_stride, float *out, int64_t out_stride, float *lse) {
    return ggmlopt_attention_forward_ranged_f32(batch, seq, n_heads, n_kv_heads, head_dim, q,
                                                q_stride, k, k_stride, v, v_stride, out,
                                                out_stride, lse, NULL);
}

int ggmlopt_attention_forward_ranged_f32(int64_t batch, int64_t seq, int64_t n_heads,
                                         int64_t n_kv_heads, int64_t head_dim, const float *q,
                                         int64_t q_stride, const float *k, int64_t k_stride,
                                         const float *v, int64_t v_stride, float *out,
                                         int64_t out_stride, float *lse,
                                         const int32_t *kv_start) {
    return ggmlopt_attention_forward_capped_f32(batch, seq, n_heads, n_kv_heads, head_dim, q,
                                                q_stride, k, k_stride, v, v_stride, out,
                                                out_stride, lse, kv_start, 0.0f);
}

/* 0 (no cap) or a finite cap > 0 */
static int attn_softcap_ok(float softcap) {
    return softcap == 0.0f || (softcap > 0.0f && isfinite(softcap));
}

int ggmlopt_attention_forward_capped_f32(int64_t batch, int64_t seq, int64_t n_heads,
                                         int64_t n_kv_heads, int64_t head_dim, const float *q,
                                         int64_t q_stride, const float *k, int64_t k_stride,
                                         const float *v, int64_t v_stride, float *out,
                                         int64_t out_stride, float *lse, const int32_t *kv_start,
                                         float softcap) {
    if (!attn_shape_ok(batch, seq, n_heads, n_kv_heads, head_dim)) return -1;
    if (!attn_starts_ok(batch, seq, kv_start) || !attn_softcap_ok(softcap)) return -1;
    if (batch == 0 || seq == 0) return 0;
    attn_job job;
    attn_job_init(&job, batch, seq, n_heads, n_kv_heads, head_dim, q, q_stride, k, k_stride, v,
                  v_stride, out, out_stride, lse);
    job.a.kv_start = kv_start;
    job.a.softcap = softcap;
    job.rows = go_attn_forward_rows(head_dim);
    job.nblocks = (seq + job.rows - 1) / job.rows;
    attn_run(batch * n_heads * job.nblocks, batch * n_heads * seq * seq * head_dim,
             attn_forward_item, &job);
    return 0;
}

int ggmlopt_attention_backward_f32(int64_t batch, int64_t seq, int64_t n_heads,
                                   int64_t n_kv_heads, int64_t head_dim, const float *q,
                                   int64_t q_stride, const float *k, int64_t k_stride,
                                   const float *v, int64_t v_stride, const float *out,
                                   int64_t out_stride, const float *lse, const float *dout,
                                   float *dq, float *dk, float *dv) {
    return ggmlopt_attention_backward_ranged_f32(batch, seq, n_heads, n_kv_heads, head_dim, q,
                                                 q_stride, k, k_stride, v, v_stride, out,
                                                 out_stride, lse, dout, dq, dk, dv, NULL);
}

int ggmlopt_attention_backward_ranged_f32(int64_t batch, int64_t seq, int64_t n_heads,
                                          int64_t n_kv_heads, int64_t head_dim, const float *q,
                                          int64_t q_stride, const float *k, int64_t k_stride,
                                          const float *v, int64_t v_stride, const float *out,
                                          int64_t out_stride, const float *lse,
                                          const float *dout, float *dq, float *dk, float *dv,
                                          const int32_t *kv_start) {
    return ggmlopt_attention_backward_capped_f32(batch, seq, n_heads, n_kv_heads, head_dim, q,
                                                 q_stride, k, k_stride, v, v_stride, out,
                                                 out_stride, lse, dout, dq, dk, dv, kv_start,
                                                 0.0f);
}

int ggmlopt_attention_backward_capped_f32(int64_t batch, int64_t seq, int64_t n_heads,
                                          int64_t n_kv_heads, int64_t head_dim, const float *q,
                                          int64_t q_stride, const float *k, int64_t k_stride,
                                          const float *v, int64_t v_stride, const float *out,
                                          int64_t out_stride, const float *lse,
                                          const float *dout, float *dq, float *dk, float *dv,
                                          const int32_t *kv_start, float softcap) {
    if (!attn_shape_ok(batch, seq, n_heads, n_kv_heads, head_dim)) return -1;
    if (!attn_starts_ok(batch, seq, kv_start) || !attn_softcap_ok(softcap)) return -1;
    if (batch == 0 || seq == 0) return 0;
    attn_job job;
    /* out and lse are only read in the backward */
    attn_job_init(&job, batch, seq, n_heads, n_kv_heads, head_dim, q, q_stride, k, k_stride, v,
                  v_stride, (float *)out, out_stride, (float *)lse);
    job.a.dout = dout;
    job.a.kv_start = kv_start;
    job.a.softcap = softcap;
    job.a.dq = dq;
    job.a.dk = dk;
    job.a.dv = dv;
    const int64_t items = batch * n_kv_heads, madds = 3 * batch * n_heads * seq * seq * head_dim;
    if (!attn_backward_split(&job, items, madds))
        attn_run(items, madds, attn_backward_item, &job);
    return 0;
}

static double rope_block(const void *p, int64_t b, int64_t e) {
    kernels()->rope_f32((const go_rope_args *)p, b, e);
    return 0.0;
}
int ggmlopt_attention_decode_f32(int64_t batch, int64_t n_heads, int64_t n_kv_heads,
                                 int64_t head_dim, int64_t length, const float *q,
                                 const float *k, const float *v, int64_t kv_item_stride,
                                 float *out, float *scores, float scale) {
    return ggmlopt_attention_decode_capped_f32(batch, n_heads, n_kv_heads, head_dim, length, q, k,
                                               v, kv_item_stride, out, scores, scale, 0.0f);
}

int ggmlopt_attention_decode_capped_f32(int64_t batch, int64_t n_heads, int64_t n_kv_heads,
                                        int64_t head_dim, int64_t length, const float *q,
                                        const float *k, const float *v, int64_t kv_item_stride,
                                        float *out, float *scores, float scale, float softcap) {
    if (batch < 0 || n_heads < 1 || n_kv_heads < 1 || n_heads % n_kv_heads != 0 ||
        head_dim < 1 || length < 1 || !attn_softcap_ok(softcap))
        return -1;
    /* a step's heads are a few thousand multiply-adds each: one thread, no wake-ups */
    for (int64_t b = 0; b < batch; ++b) {
        const go_attn_decode_args a = {n_heads, n_kv_heads, head_dim, length,
                                       n_kv_heads * head_dim, q + b * n_heads * head_dim,
                                       k + b * kv_item_stride, v + b * kv_item_stride,
                                       out + b * n_heads * head_dim, scores, scale, softcap};
        kernels()->attention_decode_f32(&a, 0, n_heads);
    }
    return 0;
}

void ggmlopt_rope_f32(int64_t nrows, int64_t seq, int64_t pos0, int64_t n_heads,
                      int64_t head_dim, const float *x, int64_t x_stride, float *y,
                      int64_t y_stride, const float *cos, const float *sin, int inverse) {
    if (nrows <= 0 || seq <= 0) return;
    go_rope_args a = {seq, pos0, n_heads, head_dim, x, x_stride, y, y_stride, cos, sin, inverse};
    run_items(nrows, 3 * n_heads * head_dim, rope_block, &a);
}

/* ---- GGUF block types ------------------------------------------------------- */

int64_t ggmlopt_quant_row_bytes(int type, int64_t ncols) {
    const int64_t bs = go_qtype_block(type);
    if (bs == 0 || ncols < 0 || ncols % bs != 0) return -1;
    return ncols / bs * go_qtype_size(type);
}

typedef struct {
    int type;
    int64_t nx, ncols, row_bytes, x_stride, y_stride, dst_stride, r0;
    const uint8_t *src;
    const float *x;
    float *y;
} quant_args;

static double dequantize_block(const void *p, int64_t b, int64_t e) {
    const quant_args *a = (const quant_args *)p;
    kernels()->dequantize_rows(a->type, a->r0 + b, a->r0 + e, a->ncols, a->src, a->row_bytes,
                               a->y + b * a->dst_stride, a->dst_stride);
    return 0.0;
}
int ggmlopt_dequantize_rows(int type, int64_t r0, int64_t r1, int64_t ncols, const uint8_t *src,
                            float *dst, int64_t dst_stride) {
    const int64_t row_bytes = ggmlopt_quant_row_bytes(type, ncols);
    if (row_bytes < 0) return -1;
    if (r1 <= r0 || ncols == 0) return 0;
    quant_args a = {type, 0, ncols, row_bytes, 0, 0, dst_stride, r0, src, NULL, dst};
    /* a row costs a read of row_bytes and a write of ncols floats */
    run_items(r1 - r0, ncols, dequantize_block, &a);
    return 0;
}

/* The weight rows of a product of few input rows, in blocks of some 32K
 * weights (times the input rows) and on the pool from some 256K: a block's
 * claim is a round trip of a shared counter between cores, worth a few rows
 * of a fast kernel (smaller blocks left a second thread idle on SmolLM2's
 * 576 x 1536 products); a whole multiple of 16 rows keeps threads off each
 * other's output cache lines. */
static void run_weight_rows(int64_t nout, int64_t row_work, go_block_fn fn, const void *args) {
    if (row_work < 1) row_work = 1;
    run_blocks(nout, rows_for(row_work, 32768), rows_for(row_work, 262144), fn, args);
}

static double quant_matmul_block(const void *p, int64_t b, int64_t e) {
    const quant_args *a = (const quant_args *)p;
    kernels()->quant_matmul_rows(a->type, a->nx, a->ncols, a->x, a->x_stride, a->src,
                                 a->row_bytes, b, e, a->y, a->y_stride);
    return 0.0;
}
int ggmlopt_quant_matmul_f32(int type, int64_t nx, int64_t ncols, const float *x,
                             int64_t x_stride, int64_t nout, const uint8_t *w, float *y,
                             int64_t y_stride) {
    const int64_t row_bytes = ggmlopt_quant_row_bytes(type, ncols);
    if (row_bytes < 0) return -1;
    if (nx <= 0 || nout <= 0) return 0;
    if (ncols == 0) {
        for (int64_t i = 0; i < nx; ++i)
            for (int64_t j = 0; j < nout; ++j) y[i * y_stride + j] = 0.0f;
        return 0;
    }
    quant_args a = {type, nx, ncols, row_bytes, x_stride, y_stride, 0, 0, w, x, y};
    run_weight_rows(nout, ncols * (nx < GO_QMM_ROWS ? nx : GO_QMM_ROWS), quant_matmul_block, &a);
    return 0;
}

/* Activations rounded as llama.cpp rounds them for a weight's integer dot
 * products, one row of ncols values: to Q8_0 blocks (quants, a scale and
 * Q8_1's s per 32: Q4_1 and Q5_1 read the s) or, for the K types, to
 * Q8_K blocks (quants, a scale per 256 in xd, a sum per 16 quants as int16 in
 * xsum's bytes: the same scratch holds either); the 32 quants past the row
 * zeroed (an odd last Q8_0 block reads them unscaled). */
static void quantize_activations(int form, const float *x, int64_t ncols, int8_t *xqs, float *xd,
                                 float *xsum) {
    if (form == GO_Q8_K) go_quantize_q8_k_row(x, ncols, xqs, xd, (int16_t *)(void *)xsum);
    else go_quantize_q8_0_row(x, ncols, xqs, xd, xsum);
    memset(xqs + ncols, 0, 32);
}
/* weight rows [j0, j1) times one row so rounded */
static void dot_rounded_rows(int form, int type, int64_t ncols, const int8_t *xqs, const float *xd,
                             const float *xsum, const uint8_t *w, int64_t row_bytes, int64_t j0,
                             int64_t j1, float *y) {
    if (form == GO_Q8_K)
        kernels()->quant_dot_q8k_rows(type, ncols, xqs, xd, (const int16_t *)(const void *)xsum,
                                      w, row_bytes, j0, j1, y);
    else
        kernels()->quant_dot_q8_rows(type, ncols, xqs, xd, xsum, w, row_bytes, j0, j1, y);
}

typedef struct {
    int type;
    int64_t ncols, row_bytes;
    const int8_t *xqs;
    const float *xd, *xsum;
    const uint8_t *w;
    float *y;
} quant_q8_args;

static double quant_dot_q8_block(const void *p, int64_t b, int64_t e) {
    const quant_q8_args *a = (const quant_q8_args *)p;
    dot_rounded_rows(go_qtype_q8_form(a->type), a->type, a->ncols, a->xqs, a->xd, a->xsum, a->w,
                     a->row_bytes, b, e, a->y);
    return 0.0;
}
void ggmlopt_quantize_q8_0_row(const float *x, int64_t n, int8_t *qs, float *scales,
                               float *sums) {
    go_quantize_q8_0_row(x, n, qs, scales, sums);
}
void ggmlopt_quantize_q8_k_row(const float *x, int64_t n, int8_t *qs, float *scales,
                               int16_t *sums) {
    go_quantize_q8_k_row(x, n, qs, scales, sums);
}
int ggmlopt_quant_matmul_q8(int type, int64_t nx, int64_t ncols, const float *x,
                            int64_t x_stride, int64_t nout, const uint8_t *w, float *y,
                            int64_t y_stride, int8_t *xqs, float *xd, float *xsum) {
    const int64_t row_bytes = ggmlopt_quant_row_bytes(type, ncols);
    if (row_bytes < 0) return -1;
    if (!go_qtype_has_q8_dot(type)) return -2;
    if (nx <= 0 || nout <= 0) return 0;
    for (int64_t i = 0; i < nx; ++i) {
        float *yi = y + i * y_stride;
        if (ncols == 0) {
            for (int64_t j = 0; j < nout; ++j) yi[j] = 0.0f;
            continue;
        }
        /* the row's quants once, in this thread: every weight row reads them */
        quantize_activations(go_qtype_q8_form(type), x + i * x_stride, ncols, xqs, xd, xsum);
        quant_q8_args a = {type, ncols, row_bytes, xqs, xd, xsum, w, yi};
        run_weight_rows(nout, ncols, quant_dot_q8_block, &a);
    }
    return 0;
}

/* ---- a few rows times Linear weights (kernels/matmul_columns.inc) ---------- */

/* y's nx rows (y_stride apart) of nout zeros: a product over no inputs */
static void zero_rows(int64_t nx, int64_t nout, float *y, int64_t y_stride) {
    for (int64_t i = 0; i < nx; ++i)
        for (int64_t j = 0; j < nout; ++j) y[i * y_stride + j] = 0.0f;
}

/* Rows of w a partial sum covers.  Fixed, so the bits do not depend on the
 * threads: each y value is the sum, in order, of its chunks' chains. */
#define GO_COLUMN_CHUNK 64

static int64_t column_chunks(int64_t ncols) {
    return (ncols + GO_COLUMN_CHUNK - 1) / GO_COLUMN_CHUNK;
}

int64_t ggmlopt_matmul_columns_scratch(int64_t nx, int64_t ncols, int64_t nout) {
    if (nx < 0 || ncols < 0 || nout < 0) return -1;
    return column_chunks(ncols) > 1 ? nx * column_chunks(ncols) * nout : 0;
}

/* The products' work: item b is chunk b % nchunks of product b / nchunks, its
 * partial sums at row (chunk, i) of partials, columns [first[m], + nout) of
 * total; with a single chunk, y itself. */
typedef struct {
    int n;
    const ggmlopt_columns_product *p;
    int64_t nx, ncols, x_stride, nchunks, total;
    int64_t first[GGMLOPT_QPRODUCTS_MAX];
    const float *x;
    float *partials;
} columns_job;

static void columns_chunk(void *ctx, int b) {
    const columns_job *a = (const columns_job *)ctx;
    const ggmlopt_columns_product *p = &a->p[b / a->nchunks];
    const int64_t c = b % a->nchunks, k0 = c * GO_COLUMN_CHUNK;
    const int64_t rows = a->ncols - k0 < GO_COLUMN_CHUNK ? a->ncols - k0 : GO_COLUMN_CHUNK;
    const float *w = p->w + k0 * p->ld;
    if (a->nchunks == 1)
        kernels()->matmul_columns_f32(a->nx, rows, a->x, a->x_stride, w, p->ld, 0, p->nout,
                                      p->y, p->y_stride);
    else
        kernels()->matmul_columns_f32(a->nx, rows, a->x + k0, a->x_stride, w, p->ld, 0,
                                      p->nout, a->partials + c * a->nx * a->total +
                                                   a->first[b / a->nchunks],
                                      a->total);
}

/* each product's y = its chunks' partial sums, added in chunk order */
static void columns_sum(const columns_job *a) {
    for (int m = 0; m < a->n; ++m) {
        const ggmlopt_columns_product *p = &a->p[m];
        for (int64_t i = 0; i < a->nx; ++i) {
            float *restrict yi = p->y + i * p->y_stride;
            const float *part = a->partials + i * a->total + a->first[m];
            for (int64_t j = 0; j < p->nout; ++j) yi[j] = part[j];
            for (int64_t c = 1; c < a->nchunks; ++c) {
                const float *restrict pc = part + c * a->nx * a->total;
                for (int64_t j = 0; j < p->nout; ++j) yi[j] += pc[j];
            }
        }
    }
}

int ggmlopt_matmul_columns_many(int n, const ggmlopt_columns_product *products, int64_t nx,
                                int64_t ncols, const float *x, int64_t x_stride,
                                float *partials) {
    if (n < 0 || n > GGMLOPT_QPRODUCTS_MAX) return -3;
    columns_job a = {n, products, nx, ncols, x_stride, column_chunks(ncols), 0, {0}, x, partials};
    for (int m = 0; m < n; ++m) {
        const ggmlopt_columns_product *p = &products[m];
        if (p->nout < 0 || p->ld < p->nout || p->ld < 1) return -1;
        a.first[m] = a.total;
        a.total += p->nout;
    }
    if (nx <= 0 || a.total == 0) return 0;
    if (ncols == 0) {
        for (int m = 0; m < n; ++m)
            zero_rows(nx, products[m].nout, products[m].y, products[m].y_stride);
        return 0;
    }
    if (a.nchunks > INT32_MAX / GGMLOPT_QPRODUCTS_MAX) return -1;
    float *own = NULL;
    if (a.nchunks > 1 && partials == NULL) {
        own = (float *)malloc((size_t)(a.nchunks * nx * a.total) * sizeof(float));
        if (own == NULL) return -2;
        a.partials = own;
    }
    const int items = (int)(n * a.nchunks);
    /* threads join from 64 Ki multiply-adds: below, waking one costs more */
    if (nx * ncols * a.total >= 65536 && go_pool_threads() > 1) {
        go_pool_for(items, columns_chunk, &a);
    } else {
        for (int b = 0; b < items; ++b) columns_chunk(&a, b);
    }
    if (a.nchunks > 1) columns_sum(&a);   /* a pass over L2: one thread */
    free(own);
    return 0;
}

int ggmlopt_matmul_columns_f32(int64_t nx, int64_t ncols, const float *x, int64_t x_stride,
                               int64_t nout, const float *w, int64_t ld, float *y,
                               int64_t y_stride, float *partials) {
    const ggmlopt_columns_product p = {nout, w, ld, y, y_stride};
    if (nout < 1) return ld < 0 ? -1 : 0;
    return ggmlopt_matmul_columns_many(1, &p, nx, ncols, x, x_stride, partials);
}

/* Several products of the same rows x, one pool job over all their weight
 * rows (a decode step's q, k and v; gate and up): global row r of the job is
 * row r - first of the product whose rows [first, first + nout) hold it.  The
 * products whose rounding form is `form` multiply x so rounded (xqs, xd and
 * xsum: every row's), the others float32 x. */
typedef struct {
    int n, form;
    const ggmlopt_qproduct *p;
    const int64_t *first, *row_bytes;
    int64_t nx, ncols, x_stride;
    const float *x;
    const int8_t *xqs;   /* row i's quants at xqs + i * (ncols + 32) */
    const float *xd, *xsum;
} quant_many_args;

static double quant_many_block(const void *pa, int64_t b, int64_t e) {
    const quant_many_args *a = (const quant_many_args *)pa;
    const int64_t nb = a->ncols / 32;
    for (int m = 0; m < a->n && b < e; ++m) {
        const ggmlopt_qproduct *p = &a->p[m];
        const int64_t lo = a->first[m], hi = lo + p->nout;
        if (b >= hi) continue;
        const int64_t j0 = b - lo, j1 = (e < hi ? e : hi) - lo;
        if (a->form != GO_Q8_NONE && go_qtype_q8_form(p->type) == a->form) {
            for (int64_t i = 0; i < a->nx; ++i)
                dot_rounded_rows(a->form, p->type, a->ncols, a->xqs + i * (a->ncols + 32),
                                 a->xd + i * nb, a->xsum + i * nb, p->w, a->row_bytes[m], j0, j1,
                                 p->y + i * p->y_stride);
        } else {
            kernels()->quant_matmul_rows(p->type, a->nx, a->ncols, a->x, a->x_stride, p->w,
                                         a->row_bytes[m], j0, j1, p->y, p->y_stride);
        }
        b = lo + j1;
    }
    return 0.0;
}

/* the n products (rows checked) as one job, x rounded to form first */
static void quant_many_job(int n, const ggmlopt_qproduct *products, int64_t nx, int64_t ncols,
                           const float *x, int64_t x_stride, int form, int8_t *xqs, float *xd,
                           float *xsum) {
    int64_t first[GGMLOPT_QPRODUCTS_MAX], row_bytes[GGMLOPT_QPRODUCTS_MAX], total = 0;
    for (int m = 0; m < n; ++m) {
        row_bytes[m] = ggmlopt_quant_row_bytes(products[m].type, ncols);
        first[m] = total;
        total += products[m].nout > 0 ? products[m].nout : 0;
    }
    if (total == 0) return;
    if (form != GO_Q8_NONE) {
        /* every row's quants once, in this thread: every weight row reads them */
        const int64_t nb = ncols / 32;
        for (int64_t i = 0; i < nx; ++i)
            quantize_activations(form, x + i * x_stride, ncols, xqs + i * (ncols + 32),
                                 xd + i * nb, xsum + i * nb);
    }
    quant_many_args a = {n, form, products, first, row_bytes, nx, ncols, x_stride, x,
                         xqs, xd, xsum};
    run_weight_rows(total, ncols * (nx < GO_QMM_ROWS ? nx : GO_QMM_ROWS), quant_many_block, &a);
}

int ggmlopt_quant_matmul_many(int n, const ggmlopt_qproduct *products, int64_t nx,
                              int64_t ncols, const float *x, int64_t x_stride, int q8,
                              int8_t *xqs, float *xd, float *xsum) {
    int has[3] = {0, 0, 0};   /* products of each rounding form */
    if (n < 0 || n > GGMLOPT_QPRODUCTS_MAX) return -3;
    for (int m = 0; m < n; ++m) {
        if (ggmlopt_quant_row_bytes(products[m].type, ncols) < 0) return -1;
        has[q8 ? go_qtype_q8_form(products[m].type) : GO_Q8_NONE] = 1;
    }
    if (nx <= 0) return 0;
    if (ncols == 0) {
        for (int m = 0; m < n; ++m)
            zero_rows(nx, products[m].nout, products[m].y, products[m].y_stride);
        return 0;
    }
    if (!(has[GO_Q8_0] && has[GO_Q8_K])) {
        quant_many_job(n, products, nx, ncols, x, x_stride,
                       has[GO_Q8_K] ? GO_Q8_K : has[GO_Q8_0] ? GO_Q8_0 : GO_Q8_NONE, xqs, xd,
                       xsum);
        return 0;
    }
    /* both forms: x rounded one way, then the other, in the same scratch */
    ggmlopt_qproduct by_form[GGMLOPT_QPRODUCTS_MAX];
    int nk = 0, n0 = 0;
    for (int m = 0; m < n; ++m)
        if (go_qtype_q8_form(products[m].type) == GO_Q8_K) by_form[nk++] = products[m];
    for (int m = 0; m < n; ++m)
        if (go_qtype_q8_form(products[m].type) != GO_Q8_K) by_form[nk + n0++] = products[m];
    quant_many_job(nk, by_form, nx, ncols, x, x_stride, GO_Q8_K, xqs, xd, xsum);
    quant_many_job(n0, by_form + nk, nx, ncols, x, x_stride, GO_Q8_0, xqs, xd, xsum);
    return 0;
}

typedef struct {
    int type;
    int64_t ncols, row_bytes;
    const int32_t *ids;
    const uint8_t *src;
    float *dst;
} quant_gather_args;

static double dequantize_gather_block(const void *p, int64_t b, int64_t e) {
    const quant_gather_args *a = (const quant_gather_args *)p;
    for (int64_t i = b; i < e; ++i)
        kernels()->dequantize_rows(a->type, a->ids[i], a->ids[i] + 1, a->ncols, a->src,
                                   a->row_bytes, a->dst + i * a->ncols, a->ncols);
    return 0.0;
}
int ggmlopt_dequantize_gather(int type, int64_t n, const int32_t *ids, int64_t ncols,
                              const uint8_t *src, float *dst) {
    const int64_t row_bytes = ggmlopt_quant_row_bytes(type, ncols);
    if (row_bytes < 0) return -1;
    if (n <= 0 || ncols == 0) return 0;
    quant_gather_args a = {type, ncols, row_bytes, ids, src, dst};
    run_items(n, ncols, dequantize_gather_block, &a);
    return 0;
}

typedef struct {
    int type;
    int64_t ncols;
    const float *src;
    uint8_t *dst;
} quantize_k_args;

static double quantize_k_block(const void *p, int64_t b, int64_t e) {
    const quantize_k_args *a = (const quantize_k_args *)p;
    go_quantize_k_rows(a->type, b, e, a->ncols, a->src, a->dst);
    return 0.0;
}
int ggmlopt_quantize_rows_f32(int type, int64_t nrows, int64_t ncols, const float *src,
                              uint8_t *dst) {
    if (go_quantize_k_block_bytes(type) == 0 || ncols < 0 || ncols % 256 != 0) return -1;
    if (nrows <= 0 || ncols == 0) return 0;
    quantize_k_args a = {type, ncols, src, dst};
    /* the scale searches make a value cost about a hundred flops */
    run_items(nrows, ncols * 100, quantize_k_block, &a);
    return 0;
}

/* ---- float32 products (the GEMM engine "native") ---------------------------- */

/* below this many multiply-adds a product runs on the calling thread */
#define GO_GEMM_PARALLEL_MIN (1 << 20)

/* The packed panels' scratch, kept between calls: a fresh allocation of this
 * size is a fresh mapping often enough that its page faults cost a tenth of a
 * product.  A call that finds it taken (another thread's product) allocates
 * its own. */
static struct {
    pthread_mutex_t mu;
    float *buf;
    int64_t floats;
    int busy;
} gemm_cache = {.mu = PTHREAD_MUTEX_INITIALIZER};

static void gemm_scratch_free(void) {
    free_floats64(gemm_cache.buf);
    gemm_cache.buf = NULL;
    gemm_cache.floats = 0;
}

static float *gemm_scratch(int64_t floats, int *cached) {
    float *buf = NULL;
    pthread_mutex_lock(&gemm_cache.mu);
    if (!gemm_cache.busy) {
        static int registered = 0;
        if (!registered) registered = atexit(gemm_scratch_free) == 0;
        if (gemm_cache.floats < floats) {
            free_floats64(gemm_cache.buf);
            gemm_cache.buf = alloc_floats64(floats);
            gemm_cache.floats = gemm_cache.buf ? floats : 0;
        }
        if (gemm_cache.buf) {
            gemm_cache.busy = 1;
            buf = gemm_cache.buf;
            *cached = 1;
        }
    }
    pthread_mutex_unlock(&gemm_cache.mu);
    if (!buf) {
        buf = alloc_floats64(floats);
        *cached = 0;
    }
    return buf;
}

static void gemm_scratch_done(float *buf, int cached) {
    if (!cached) {
        free_floats64(buf);
        return;
    }
    pthread_mutex_lock(&gemm_cache.mu);
    gemm_cache.busy = 0;
    pthread_mutex_unlock(&gemm_cache.mu);
}

/* How a product's C is shared out among the threads: items of rows_per rows x
 * cols_per columns, col_groups of them across, each with a scratch of
 * split_work_floats (a column block's packed panels).  The columns split evenly (each
 * block packs its own panels), or with fewer panels than threads the rows too;
 * or the rows alone when A is over four times B's size, so that each thread
 * reads its part of A instead of all of it (on a Zen 4, 2 threads: float32
 * 2048 x 288 x 288 195 -> 220 GFLOP/s, bf16 365-380 -> 430), or when the
 * panels share out less evenly than the tiles (9 panels on 2 threads: 5 and
 * 4, where 15 and 15 of 30 tiles are even; a head's bf16 input gradient, 410 x
 * 288 x 32000, 314 -> 360 GFLOP/s).  The split changes no value: each is one
 * chain over k whatever the cut. */
typedef struct {
    int64_t col_groups, rows_per, cols_per, items;
} gemm_split;

/* the largest item's work, in panel-tiles, when panels x tiles split into
 * groups across and down (a panel's packing counted as one more tile) */
static int64_t split_load(int64_t panels, int64_t tiles, int64_t across, int64_t down) {
    return (panels + across - 1) / across * ((tiles + down - 1) / down + 1);
}

static gemm_split split_product(const ggmlopt_kernel_table *kt, int64_t m, int64_t n,
                                int64_t k) {
    const int64_t nr = kt->sgemm_panel_cols(), mr = kt->sgemm_tile_rows();
    const int64_t panels = (n + nr - 1) / nr, tiles = (m + mr - 1) / mr;
    const double madds = (double)m * (double)n * (double)k;
    const int64_t threads = madds < GO_GEMM_PARALLEL_MIN ? 1 : go_pool_threads();
    const int rows_first = tiles >= threads &&
                           (m > 4 * n || split_load(panels, tiles, 1, threads) <
                                             split_load(panels, tiles, threads, 1));
    const int64_t col_groups = rows_first ? 1 : panels < threads ? panels : threads;
    int64_t row_groups = rows_first ? threads
                         : panels < threads ? (threads < tiles ? threads : tiles) : 1;
    gemm_split sp;
    sp.cols_per = (panels + col_groups - 1) / col_groups * nr;
    sp.col_groups = (n + sp.cols_per - 1) / sp.cols_per;
    sp.rows_per = (tiles + row_groups - 1) / row_groups * mr;
    row_groups = (m + sp.rows_per - 1) / sp.rows_per;
    sp.items = row_groups * sp.col_groups;
    return sp;
}

/* an item's scratch, depth floats a packed column (a k chunk, or its bf16
 * pairs): its columns, or the kernels' widest block of them */
static int64_t split_work_floats(const gemm_split *sp, int64_t depth) {
    const int64_t widest = go_gemm_block_cols(depth);
    return (sp->cols_per < widest ? sp->cols_per : widest) * depth;
}

/* item it's rows [*r0, *r1) and columns [*j0, *j1) of an m x n product; 0 when empty */
static int split_item(const gemm_split *sp, int64_t m, int64_t n, int it, int64_t *r0,
                      int64_t *r1, int64_t *j0, int64_t *j1) {
    *r0 = (it / sp->col_groups) * sp->rows_per;
    *j0 = (it % sp->col_groups) * sp->cols_per;
    *r1 = *r0 + sp->rows_per < m ? *r0 + sp->rows_per : m;
    *j1 = *j0 + sp->cols_per < n ? *j0 + sp->cols_per : n;
    return *r0 < *r1 && *j0 < *j1;
}

/* The products with nothing to multiply: m or n zero (nothing), k zero (C
 * zeroed, or left as it is when accumulating).  1 when it was one of them. */
static int empty_product(int64_t m, int64_t n, int64_t k, float *c, int64_t ldc, int accumulate) {
    if (m == 0 || n == 0) return 1;
    if (k != 0) return 0;
    if (!accumulate)
        for (int64_t i = 0; i < m; ++i) memset(c + i * ldc, 0, (size_t)n * sizeof(float));
    return 1;
}

/* A product reads the kernel table once: its split (the path's panel and tile
 * sizes) and its blocks come from the same path, even when another thread
 * switches the path (kernels.use_simd) while it runs. */
typedef struct {
    go_gemm_args g;
    const ggmlopt_kernel_table *kt;
    gemm_split sp;
    int64_t work_floats;
    float *work;
} gemm_job;

static void gemm_item(void *p, int it) {
    const gemm_job *job = (const gemm_job *)p;
    int64_t r0, r1, j0, j1;
    if (split_item(&job->sp, job->g.m, job->g.n, it, &r0, &r1, &j0, &j1))
        job->kt->sgemm_block_f32(&job->g, r0, r1, j0, j1, job->work + it * job->work_floats);
}

int ggmlopt_sgemm_f32(int64_t m, int64_t n, int64_t k, const float *a, int64_t a_row,
                      int64_t a_col, const float *b, int64_t b_row, int64_t b_col, float *c,
                      int64_t ldc, int accumulate) {
    if (m < 0 || n < 0 || k < 0 || ldc < n || a_row < 0 || a_col < 0 || b_row < 0 || b_col < 0)
        return -1;
    if (a_col != 1 && a_row != 1) return -1;
    if (empty_product(m, n, k, c, ldc, accumulate)) return 0;
    gemm_job job;
    job.kt = kernels();
    job.sp = split_product(job.kt, m, n, k);
    job.work_floats = split_work_floats(&job.sp, go_gemm_kc(k));
    int cached = 0;
    job.work = gemm_scratch(job.sp.items * job.work_floats, &cached);
    if (!job.work) return -2;
    job.g = (go_gemm_args){m, n, k, a, a_row, a_col, b, b_row, b_col, c, ldc, accumulate != 0};
    if (job.sp.items > 1)
        go_pool_for((int)job.sp.items, gemm_item, &job);
    else
        gemm_item(&job, 0);
    gemm_scratch_done(job.work, cached);
    return 0;
}

/* ---- bfloat16 products ------------------------------------------------------- */

typedef void (*bgemm_block_fn)(const go_gemm_bf16_args *g, int64_t r0, int64_t r1, int64_t j0,
                               int64_t j1, float *work);

/* the active path's bf16 blocks: vdpbf16ps on the avx512 path where the CPU
 * has it, else the path's own two FMAs a pair */
static bgemm_block_fn bgemm_block(const ggmlopt_kernel_table *kt) {
#if defined(__x86_64__) || defined(_M_X64)
    if (kt == &ggmlopt_kernels_avx512 && cpu_avx512_bf16) return ggmlopt_gemm_block_bf16_avx512bf16;
#endif
    return kt->gemm_block_bf16;
}

int ggmlopt_gemm_bf16_instruction(void) {
#if defined(__x86_64__) || defined(_M_X64)
    return bgemm_block(kernels()) == ggmlopt_gemm_block_bf16_avx512bf16;
#else
    return 0;
#endif
}

/* A product's C written around the caches: a fresh C (not accumulated) on whole
 * cache lines that the last-level cache could not hold anyway (at least
 * GO_STREAM_C_BYTES).  Through the caches each store first reads its line from
 * memory: a head chunk's 52 MB of logits were read once before being written
 * and once after, by the loss.  Around them (Zen 4, 32 MB L3): the 410 x 288 x
 * 32000 bf16 product 19.7 -> 18.8 ms, the stories15M bf16 step 1-3% less. */
#define GO_STREAM_C_BYTES ((int64_t)32 << 20)
static _Atomic int64_t stream_c_bytes;

/* the level-3 cache of CPU 0 as Linux describes it ("32768K"), 0 where unknown;
 * not glibc's sysconf, which on a Zen 4 VM sums the host's ten 32 MB caches */
static int64_t l3_cache_bytes(void) {
    FILE *f = fopen("/sys/devices/system/cpu/cpu0/cache/index3/size", "r");
    if (!f) return 0;
    long long size = 0;
    char unit = 0;
    const int got = fscanf(f, "%lld%c", &size, &unit);
    fclose(f);
    if (got < 1 || size <= 0) return 0;
    return unit == 'K' ? size << 10 : unit == 'M' ? size << 20 : size;
}

static int64_t stream_c_min_bytes(void) {
    int64_t bytes = atomic_load_explicit(&stream_c_bytes, memory_order_relaxed);
    if (bytes == 0) {
        const int64_t l3 = l3_cache_bytes();
        bytes = l3 > GO_STREAM_C_BYTES ? l3 : GO_STREAM_C_BYTES;
        atomic_store_explicit(&stream_c_bytes, bytes, memory_order_relaxed);
    }
    return bytes;
}

static int stream_c(int64_t m, int64_t n, const float *c, int64_t ldc, int accumulate) {
    return !accumulate && (uintptr_t)c % 64 == 0 && (ldc * (int64_t)sizeof(float)) % 64 == 0 &&
           m * n * (int64_t)sizeof(float) >= stream_c_min_bytes();
}

typedef struct {
    go_gemm_bf16_args g;
    bgemm_block_fn block;
    gemm_split sp;
    int64_t work_floats;
    float *work;
} bgemm_job;

static void bgemm_item(void *p, int it) {
    const bgemm_job *job = (const bgemm_job *)p;
    int64_t r0, r1, j0, j1;
    if (split_item(&job->sp, job->g.m, job->g.n, it, &r0, &r1, &j0, &j1))
        job->block(&job->g, r0, r1, j0, j1, job->work + it * job->work_floats);
}

int ggmlopt_gemm_bf16(int64_t m, int64_t n, int64_t k, const uint16_t *a, int64_t a_row,
                      int64_t a_col, const uint16_t *b, int64_t b_row, int64_t b_col, float *c,
                      int64_t ldc, int accumulate) {
    if (m < 0 || n < 0 || k < 0 || ldc < n || a_row < 0 || a_col < 0 || b_row < 0 || b_col < 0)
        return -1;
    if (a_col != 1 && a_row != 1) return -1;
    if (b_col != 1 && b_row != 1 && k > 1) return -1;
    if (empty_product(m, n, k, c, ldc, accumulate)) return 0;
    /* the tiles and panels of the float32 products: split the same way */
    bgemm_job job;
    const ggmlopt_kernel_table *kt = kernels();   /* once: the split's path is the blocks' */
    job.block = bgemm_block(kt);
    job.sp = split_product(kt, m, n, k);
    job.work_floats = split_work_floats(&job.sp, go_gemm_bf16_kc(k) / 2);
    /* a packed A once per k chunk, in front of each item's panels */
    if (!go_gemm_bf16_a_direct(a_row, a_col))
        job.work_floats += go_gemm_bf16_a_floats(job.sp.rows_per, k);
    int cached = 0;
    job.work = gemm_scratch(job.sp.items * job.work_floats, &cached);
    if (!job.work) return -2;
    job.g = (go_gemm_bf16_args){m, n, k, a, a_row, a_col, b, b_row, b_col, c, ldc, accumulate != 0,
                                stream_c(m, n, c, ldc, accumulate), 1};
    if (job.sp.items > 1)
        go_pool_for((int)job.sp.items, bgemm_item, &job);
    else
        bgemm_item(&job, 0);
    gemm_scratch_done(job.work, cached);
    return 0;
}
