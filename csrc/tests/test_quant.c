/*
 * The GGUF block-type kernels (kernels/quant.inc): dequantization of every type
 * bit-identical to a reference decoder written here from ggml's block layouts
 * (ggml-quants.c dequantize_row_*), and the few-rows product within float32
 * rounding of a float64 product of the decoded weights.  First one dispatch
 * table at a time (test_quant_kernels), then the public functions on every
 * path this CPU runs, on 1 and 2 threads, with their errors (test_quant_public).
 *
 * Bound of the product: a dot product of n float terms accumulated with fused
 * multiply-adds in any order is within gamma_n * sum |x w| of the exact one
 * (gamma_n = n u / (1 - n u), u = 2^-24), and the lane sum's conversion to
 * float adds a rounding of the result.
 */
#include "harness.h"

#define U32 (1.0 / 16777216.0)
/* a finite float no kernel writes by chance, so a check on it is exact */
#define SENTINEL_BITS 0x7f7fdeadu

typedef struct {
    int type; /* ggml's enum ggml_type, written out (not kernel_table.h's) */
    const char *name;
    int64_t block, bytes; /* values and bytes per block, from ggml's block structs */
    int nscales, scale_off[2]; /* byte offsets of the f16 scales in a block */
    /* row lengths: one block, a few (a multiple of GO_QMM_CHUNK for the K
     * types), and more than one chunk but not a multiple of it */
    int64_t ncols[3];
} qtype;

static const qtype TYPES[] = {
    {0, "F32", 1, 4, 0, {0, 0}, {1, 17, 613}},
    {1, "F16", 1, 2, 0, {0, 0}, {1, 17, 613}},
    {30, "BF16", 1, 2, 0, {0, 0}, {1, 17, 613}},
    {2, "Q4_0", 32, 18, 1, {0, 0}, {32, 96, 608}},
    {3, "Q4_1", 32, 20, 2, {0, 2}, {32, 96, 608}},
    {6, "Q5_0", 32, 22, 1, {0, 0}, {32, 96, 608}},
    {7, "Q5_1", 32, 24, 2, {0, 2}, {32, 96, 608}},
    {8, "Q8_0", 32, 34, 1, {0, 0}, {32, 96, 608}},
    {12, "Q4_K", 256, 144, 2, {0, 2}, {256, 512, 768}},
    {13, "Q5_K", 256, 176, 2, {0, 2}, {256, 512, 768}},
    {14, "Q6_K", 256, 210, 1, {208, 0}, {256, 512, 768}},
    {10, "Q2_K", 256, 84, 2, {80, 82}, {256, 512, 768}},
    {11, "Q3_K", 256, 110, 1, {108, 0}, {256, 512, 768}},
    {20, "IQ4_NL", 32, 18, 1, {0, 0}, {32, 96, 608}},
    {23, "IQ4_XS", 256, 136, 1, {0, 0}, {256, 512, 768}},
};
#define NTYPES ((int)(sizeof TYPES / sizeof TYPES[0]))

/* GO_QMM_ROWS is 8: one row, a partial group, one group, a group and one, two and one */
static const int64_t NX[] = {1, 3, 8, 9, 17};
#define NNX ((int)(sizeof NX / sizeof NX[0]))

static int64_t row_bytes_of(const qtype *t, int64_t ncols) { return ncols / t->block * t->bytes; }

static float bits_f32(uint32_t u) {
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static float *sentinel_f32(int64_t n) {
    float *p = th_alloc(4, n, 0);
    for (int64_t i = 0; i < n; ++i) p[i] = bits_f32(SENTINEL_BITS);
    return p;
}

/* ---- the reference decoder -------------------------------------------------- */

/* GGUF is little-endian; read byte by byte so nothing depends on the host */
static uint32_t le16(const uint8_t *p) { return (uint32_t)p[0] | (uint32_t)p[1] << 8; }
static uint32_t le32(const uint8_t *p) { return le16(p) | le16(p + 2) << 16; }
/* every f16 is exactly a float */
static float f16_at(const uint8_t *p) { return (float)th_f16_to_double((uint16_t)le16(p)); }

/* v rounded to the nearest f16 value, ties to even (v within f16's range) */
static double f16_round(double v) {
    if (v == 0.0 || !isfinite(v)) return v;
    int e;
    frexp(fabs(v), &e);
    const int ex = e - 1 < -14 ? -14 : e - 1;   /* subnormals: the quantum of 2^-24 */
    const double ulp = ldexp(1.0, ex - 10);
    return copysign(nearbyint(fabs(v) / ulp) * ulp, v);
}

/* The 8 sub-block scales and mins of a Q4_K/Q5_K super-block from its 12 bytes:
 * bytes 0-3 (4-7) hold scale (min) 0-3 in their low 6 bits and the top 2 bits
 * of scale (min) 4-7 in their high 2 bits; bytes 8-11 the low 4 bits of scale
 * 4-7 (low nibble) and of min 4-7 (high nibble). */
static void k_scales_mins(const uint8_t *s, int sc[8], int mn[8]) {
    for (int j = 0; j < 4; ++j) {
        sc[j] = s[j] & 63;
        mn[j] = s[j + 4] & 63;
        sc[j + 4] = (s[j + 8] & 15) | (s[j] >> 6) << 4;
        mn[j + 4] = (s[j + 8] >> 4) | (s[j + 4] >> 6) << 4;
    }
}

/* One block of a quantized type into y, with ggml's float operations (each
 * scale-times-quant product is exact, so only the final add or subtract rounds). */
static void ref_block(int type, const uint8_t *b, float *y) {
    switch (type) {
    case 2: { /* Q4_0: d | qs[16]; value j in the low nibble of qs[j], j + 16 in the high */
        const float d = f16_at(b);
        for (int j = 0; j < 32; ++j) {
            const int q = j < 16 ? b[2 + j] & 15 : b[2 + j - 16] >> 4;
            y[j] = (float)(q - 8) * d;
        }
        break;
    }
    case 3: { /* Q4_1: d, m | qs[16]: y = q d + m */
        const float d = f16_at(b), m = f16_at(b + 2);
        for (int j = 0; j < 32; ++j) {
            const int q = j < 16 ? b[4 + j] & 15 : b[4 + j - 16] >> 4;
            y[j] = (float)q * d + m;
        }
        break;
    }
    case 6: { /* Q5_0: d | qh (bit j: fifth bit of value j) | qs[16]: y = (q - 16) d */
        const float d = f16_at(b);
        const uint32_t qh = le32(b + 2);
        for (int j = 0; j < 32; ++j) {
            const int lo = j < 16 ? b[6 + j] & 15 : b[6 + j - 16] >> 4;
            const int q = lo | (int)((qh >> j) & 1) << 4;
            y[j] = (float)(q - 16) * d;
        }
        break;
    }
    case 7: { /* Q5_1: d, m | qh | qs[16]: y = q d + m */
        const float d = f16_at(b), m = f16_at(b + 2);
        const uint32_t qh = le32(b + 4);
        for (int j = 0; j < 32; ++j) {
            const int lo = j < 16 ? b[8 + j] & 15 : b[8 + j - 16] >> 4;
            const int q = lo | (int)((qh >> j) & 1) << 4;
            y[j] = (float)q * d + m;
        }
        break;
    }
    case 8: { /* Q8_0: d | int8 qs[32] */
        const float d = f16_at(b);
        for (int j = 0; j < 32; ++j) y[j] = (float)(int8_t)b[2 + j] * d;
        break;
    }
    case 12:
    case 13: { /* Q4_K, Q5_K: d, dmin | scales[12] | (Q5_K: qh[32]) | qs[128]; sub-block
                * s of 32 in the low (s even) or high nibbles of qs[32 (s / 2) ...], its
                * fifth bits bit s of qh[0..31]: y = (d sc) q - dmin m */
        const float d = f16_at(b), dmin = f16_at(b + 2);
        int sc[8], mn[8];
        k_scales_mins(b + 4, sc, mn);
        const uint8_t *qh = b + 16, *qs = b + (type == 13 ? 48 : 16);
        for (int s = 0; s < 8; ++s) {
            const float ds = d * (float)sc[s], ms = dmin * (float)mn[s];
            for (int l = 0; l < 32; ++l) {
                const uint8_t byte = qs[32 * (s / 2) + l];
                int q = s % 2 ? byte >> 4 : byte & 15;
                if (type == 13) q |= ((qh[l] >> s) & 1) << 4;
                y[32 * s + l] = ds * (float)q - ms;
            }
        }
        break;
    }
    case 14: { /* Q6_K: ql[128] | qh[64] | int8 scales[16] | d.  In each half of 128
                * values, quarter c (32 values, l = 0..31): low 4 bits in ql[64 h + l +
                * 32 (c % 2)] (low nibble for c < 2), high 2 bits at bit 2c of
                * qh[32 h + l], scale 8 h + l / 16 + 2c: y = (d sc) (q - 32) */
        const uint8_t *ql = b, *qh = b + 128;
        const int8_t *sc = (const int8_t *)(b + 192);
        const float d = f16_at(b + 208);
        for (int v = 0; v < 256; ++v) {
            const int h = v / 128, c = (v % 128) / 32, l = v % 32;
            const uint8_t lo = ql[64 * h + l + 32 * (c % 2)];
            const int q = (c < 2 ? lo & 15 : lo >> 4) | ((qh[32 * h + l] >> (2 * c)) & 3) << 4;
            y[v] = d * (float)sc[8 * h + l / 16 + 2 * c] * (float)(q - 32);
        }
        break;
    }
    case 10: { /* Q2_K: scales[16] (scale | min << 4) | qs[64] | d, dmin.  Value v:
                * half h = v / 128, quarter c = (v % 128) / 32, l = v % 32; two bits at
                * 2c of qs[32 h + l], sub-block 8 h + 2 c + l / 16: y = (d sc) q - dmin m */
        const float d = f16_at(b + 80), dmin = f16_at(b + 82);
        for (int v = 0; v < 256; ++v) {
            const int h = v / 128, c = (v % 128) / 32, l = v % 32;
            const int q = (b[16 + 32 * h + l] >> (2 * c)) & 3;
            const uint8_t sm = b[8 * h + 2 * c + l / 16];
            y[v] = d * (float)(sm & 15) * (float)q - dmin * (float)(sm >> 4);
        }
        break;
    }
    case 11: { /* Q3_K: hmask[32] | qs[64] | scales[12] | d.  Value v as Q2_K's, its
                * third bit bit 4 h + c of hmask[l] (clear: q - 4); the 16 six-bit
                * scales: low four bits in the nibbles of bytes 0..7 (scale i < 8 the
                * low nibble of byte i, i >= 8 the high of byte i - 8), high two bits
                * bits 2 (i / 4) of byte 8 + i % 4 */
        const float d = f16_at(b + 108);
        const uint8_t *raw = b + 96;
        for (int v = 0; v < 256; ++v) {
            const int h = v / 128, c = (v % 128) / 32, l = v % 32, i = 8 * h + 2 * c + l / 16;
            const int low = i < 8 ? raw[i] & 15 : raw[i - 8] >> 4;
            const int sc = (low | ((raw[8 + i % 4] >> (2 * (i / 4))) & 3) << 4) - 32;
            int q = (b[32 + 32 * h + l] >> (2 * c)) & 3;
            if (!((b[l] >> (4 * h + c)) & 1)) q -= 4;
            y[v] = d * (float)sc * (float)q;
        }
        break;
    }
    case 20:
    case 23: { /* IQ4_NL: d | qs[16]; IQ4_XS: d | scales_h | scales_l[4] | qs[128], sub-block
                * s of 32 scaled by its six-bit ls - 32 (four bits in a nibble of scales_l,
                * two from scales_h).  Value l of a block of 32 in the low (l < 16) or high
                * nibble of qs[l % 16], mapped through the non-linear grid */
        static const int grid[16] = {-127, -104, -83, -65, -49, -35, -22, -10,
                                     1,    13,   25,  38,  53,  69,  89,  113};
        const float d = f16_at(b);
        const int nsub = type == 20 ? 1 : 8;
        for (int sb = 0; sb < nsub; ++sb) {
            float dl = d;
            const uint8_t *qs = b + 2 + 16 * sb;
            if (type == 23) {
                const int ls = ((b[4 + sb / 2] >> (4 * (sb % 2))) & 15) |
                               (int)((le16(b + 2) >> (2 * sb)) & 3) << 4;
                dl = d * (float)(ls - 32);
                qs = b + 8 + 16 * sb;
            }
            for (int l = 0; l < 32; ++l)
                y[32 * sb + l] = dl * (float)grid[l < 16 ? qs[l] & 15 : qs[l - 16] >> 4];
        }
        break;
    }
    default: abort(); /* only the types of TYPES */
    }
}

/* One row of ncols values into y. */
static void ref_row(const qtype *t, const uint8_t *row, int64_t ncols, float *y) {
    for (int64_t j = 0; j < ncols; ++j) {
        switch (t->type) {
        case 0: y[j] = bits_f32(le32(row + 4 * j)); break;
        case 1: y[j] = f16_at(row + 2 * j); break;
        case 30: y[j] = bits_f32(le16(row + 2 * j) << 16); break;
        default:
            if (j % t->block == 0) ref_block(t->type, row + j / t->block * t->bytes, y + j);
            break;
        }
    }
}

/* ---- random rows ------------------------------------------------------------ */

/* a random finite f16 with its biased exponent in [elo, ehi] (at most 30) */
static uint16_t rand_f16(int elo, int ehi) {
    return (uint16_t)((th_next() & 0x83ffu) | (uint64_t)th_randint(elo, ehi + 1) << 10);
}

static void put16(uint8_t *p, uint32_t v) {
    p[0] = (uint8_t)v;
    p[1] = (uint8_t)(v >> 8);
}

/* nrows rows of ncols values of type t, placed off bytes into their block (odd
 * offsets: the kernels may not assume any alignment).  Quantized types: every
 * byte random, then the f16 scales finite (a random NaN scale would only test
 * NaN payloads), of any magnitude when wide (for dequantization) or in
 * [2^-5, 4) for the product.  Plain types: any bits when wide, else values in
 * (-1, 1). */
static uint8_t *rand_rows(const qtype *t, int64_t nrows, int64_t ncols, int wide, int off) {
    const int64_t rb = row_bytes_of(t, ncols), n = nrows * rb;
    uint8_t *p = th_alloc(1, n, off);
    for (int64_t i = 0; i < n; ++i) p[i] = (uint8_t)(th_next() >> 56);
    if (t->block == 1) {
        if (wide) return p;
        for (int64_t i = 0; i < nrows * ncols; ++i) {
            const float v = th_uniform(-1.0f, 1.0f);
            uint32_t u;
            memcpy(&u, &v, 4);
            if (t->type == 0) {
                memcpy(p + 4 * i, &v, 4);
            } else if (t->type == 1) {
                put16(p + 2 * i, rand_f16(10, 14));
            } else {
                put16(p + 2 * i, u >> 16);
            }
        }
        return p;
    }
    for (int64_t b = 0; b < n / t->bytes; ++b)
        for (int s = 0; s < t->nscales; ++s)
            put16(p + b * t->bytes + t->scale_off[s], wide ? rand_f16(0, 30) : rand_f16(10, 16));
    return p;
}

/* ---- checks ------------------------------------------------------------------- */

/* Rows [r0, nrows) of src into dst rows of stride floats (the last row ending
 * where its allocation ends), through table k or, k NULL, the public function:
 * every value the reference's bits (want: all nrows rows), the padding kept. */
static void check_dequant(const ggmlopt_kernel_table *k, const qtype *t, const uint8_t *src,
                          const float *want, int64_t nrows, int64_t r0, int64_t ncols,
                          int64_t stride, const char *ctx) {
    const int64_t nr = nrows - r0, rb = row_bytes_of(t, ncols);
    float *dst = sentinel_f32((nr - 1) * stride + ncols);
    const uint8_t *src0 = th_dup(src, 1, nrows * rb);
    if (k) {
        k->dequantize_rows(t->type, r0, nrows, ncols, src, rb, dst, stride);
    } else {
        const int rc = ggmlopt_dequantize_rows(t->type, r0, nrows, ncols, src, dst, stride);
        th_check(rc == 0, "%s: return code %d", ctx, rc);
    }
    th_miss m = TH_MISS_INIT;
    for (int64_t r = 0; r < nr; ++r) {
        for (int64_t j = 0; j < ncols; ++j)
            th_expect_bits(&m, "value", r * stride + j, dst[r * stride + j],
                           want[(r0 + r) * ncols + j]);
        if (r + 1 < nr)
            for (int64_t j = ncols; j < stride; ++j)
                th_expect_bits(&m, "padding (written)", r * stride + j, dst[r * stride + j],
                               bits_f32(SENTINEL_BITS));
    }
    th_check(memcmp(src, src0, (size_t)(nrows * rb)) == 0, "%s: src changed", ctx);
    th_report(&m, ctx);
}

typedef struct {
    int64_t nx, ncols, nout, xs, ys;
    const float *x;
    const uint8_t *w;
    double *want, *tol; /* nx * nout */
} mm_case;

/* x (nx rows of xs floats, values in (-1, 1), the last row ending where its
 * allocation ends), w of nout rows, and the float64 product with its bound. */
static void mm_setup(mm_case *c, const qtype *t, int64_t nx, int64_t ncols, int64_t nout) {
    c->nx = nx;
    c->ncols = ncols;
    c->nout = nout;
    c->xs = ncols + 5;
    c->ys = nout + 3;
    c->x = th_rand_f32((nx - 1) * c->xs + ncols, 1, -1.0f, 1.0f);
    c->w = rand_rows(t, nout, ncols, 0, 1);
    float *wf = th_alloc(4, nout * ncols, 0);
    for (int64_t j = 0; j < nout; ++j) ref_row(t, c->w + j * row_bytes_of(t, ncols), ncols, wf + j * ncols);
    c->want = th_alloc(8, nx * nout, 0);
    c->tol = th_alloc(8, nx * nout, 0);
    const double g = (double)ncols * U32 / (1.0 - (double)ncols * U32);
    for (int64_t i = 0; i < nx; ++i)
        for (int64_t j = 0; j < nout; ++j) {
            double s = 0.0, a = 0.0;
            for (int64_t k = 0; k < ncols; ++k) {
                const double p = (double)c->x[i * c->xs + k] * wf[j * ncols + k];
                s += p;
                a += fabs(p);
            }
            c->want[i * nout + j] = s;
            /* the final rounding is of the computed sum, within g a of s */
            c->tol[i * nout + j] = g * a + U32 * (fabs(s) + g * a);
        }
}

/* Weight rows [j0, j1) of the product through table k or, k NULL (then
 * [0, nout)), the public function, into y of rows ys floats apart: within the
 * bound, every other element kept.  Returns y. */
static float *check_matmul(const ggmlopt_kernel_table *k, const qtype *t, const mm_case *c,
                           int64_t j0, int64_t j1, const char *ctx) {
    float *y = sentinel_f32((c->nx - 1) * c->ys + c->nout);
    if (k) {
        k->quant_matmul_rows(t->type, c->nx, c->ncols, c->x, c->xs, c->w,
                             row_bytes_of(t, c->ncols), j0, j1, y, c->ys);
    } else {
        const int rc = ggmlopt_quant_matmul_f32(t->type, c->nx, c->ncols, c->x, c->xs, c->nout,
                                                c->w, y, c->ys);
        th_check(rc == 0, "%s: return code %d", ctx, rc);
    }
    th_miss m = TH_MISS_INIT;
    for (int64_t i = 0; i < c->nx; ++i) {
        const int64_t end = i + 1 < c->nx ? c->ys : c->nout;
        for (int64_t j = 0; j < end; ++j) {
            if (j >= j0 && j < j1) {
                th_expect(&m, "y", i * c->ys + j, y[i * c->ys + j], c->want[i * c->nout + j],
                          c->tol[i * c->nout + j]);
            } else {
                th_expect_bits(&m, "y outside the rows (written)", i * c->ys + j,
                               y[i * c->ys + j], bits_f32(SENTINEL_BITS));
            }
        }
    }
    th_report(&m, ctx);
    return y;
}

/* ggml's quantize_row_q8_K_ref, written out here apart from the library's:
 * per 256 values the first of largest magnitude, iscale = -127 / it, quants
 * rounded to nearest, ties to even (at most 127), scale 1 / iscale, sums of 16 */
static void ref_q8_k(const float *x, int64_t n, int8_t *qs, float *d, int16_t *sums) {
    for (int64_t i = 0; i < n / 256; ++i) {
        float max = 0.0f, amax = 0.0f;
        for (int j = 0; j < 256; ++j)
            if (fabsf(x[i * 256 + j]) > amax) {
                amax = fabsf(x[i * 256 + j]);
                max = x[i * 256 + j];
            }
        const float iscale = amax != 0.0f ? -127.0f / max : 0.0f;
        for (int j = 0; j < 256; ++j) {
            const float r = nearbyintf(iscale * x[i * 256 + j]);
            qs[i * 256 + j] = (int8_t)(r < 127.0f ? r : 127.0f);
        }
        d[i] = amax != 0.0f ? 1.0f / iscale : 0.0f;
        for (int k = 0; k < 16; ++k) {
            int s = 0;
            for (int j = 0; j < 16; ++j) s += qs[i * 256 + 16 * k + j];
            sums[i * 16 + k] = (int16_t)s;
        }
    }
}

/* The integer product of table k for a weight whose rounding form is Q8_0
 * (Q8_0, Q4_0, Q5_0, Q4_1, Q5_1, IQ4_NL: quant_dot_q8_rows, x rounded by the
 * public, portable ggmlopt_quantize_q8_0_row, its bytes checked against
 * gguf-py in tests/test_kernels_quant_q8.py; the 32 quants past the row
 * random, as an odd last block reads them unscaled) or Q8_K (Q2_K .. Q6_K, IQ4_XS:
 * quant_dot_q8k_rows, x rounded by ggmlopt_quantize_q8_k_row, checked here
 * against ref_q8_k): weight rows [2, 9) of 11 within float32 rounding of the
 * float64 product of the decoded weights and the rounded x: each block's
 * integer dot is exact (a K super-block's whole sum), its scale product rounds
 * once at most, the accumulation takes nblocks / 2 + 8 roundings at most (a
 * Q4_K, Q5_K or Q2_K value's two parts, d sc q and dmin m, and a Q4_1 or Q5_1
 * value's, d q and m, summed apart: the bound takes both); rows outside
 * untouched.  The other form's kernel refuses the
 * type (returns 0, writes nothing). */
/* the types llama.cpp multiplies with rounded activations, as ggmlopt does:
 * all block types here (Q4_0 .. Q8_0, IQ4_NL, the 256-value ones) */
static int has_integer_dot(const qtype *t) {
    return t->block >= 32;
}

static void check_q8_dot(const ggmlopt_kernel_table *k, const qtype *t, int64_t ncols,
                         const char *ctx) {
    const int64_t nout = 11, nb = ncols / 32, rb = row_bytes_of(t, ncols);
    const int k_form = t->block == 256;   /* Q2_K .. Q6_K, IQ4_XS */
    const uint8_t *w = rand_rows(t, nout, ncols, 0, 3);
    const float *x = th_rand_f32(ncols, 1, -2.0f, 2.0f);
    int8_t *xq = th_alloc(1, ncols + 32, 1);
    float *xd = th_alloc(4, nb, 0), *xs = th_alloc(4, nb, 1);
    float *wf = th_alloc(4, ncols, 0);
    float *y = sentinel_f32(nout), *other = sentinel_f32(nout);
    int rc, rc_other;
    if (k_form) {
        int16_t *sums = (int16_t *)(void *)xs;
        ggmlopt_quantize_q8_k_row(x, ncols, xq, xd, sums);
        int8_t *want_q = th_alloc(1, ncols, 0);
        float *want_d = th_alloc(4, ncols / 256, 0);
        int16_t *want_s = th_alloc(2, ncols / 16, 0);
        ref_q8_k(x, ncols, want_q, want_d, want_s);
        th_check(memcmp(want_q, xq, (size_t)ncols) == 0 &&
                 memcmp(want_d, xd, (size_t)(ncols / 256) * 4) == 0 &&
                 memcmp(want_s, sums, (size_t)(ncols / 16) * 2) == 0,
                 "%s: ggmlopt_quantize_q8_k_row differs from ggml's rounding", ctx);
        rc = k->quant_dot_q8k_rows(t->type, ncols, xq, xd, sums, w, rb, 2, 9, y);
        rc_other = k->quant_dot_q8_rows(t->type, ncols, xq, xd, xs, w, rb, 2, 9, other);
    } else {
        ggmlopt_quantize_q8_0_row(x, ncols, xq, xd, xs);
        for (int i = 0; i < 32; ++i) xq[ncols + i] = (int8_t)(th_next() >> 56);
        for (int64_t b = 0; b < nb; ++b) {   /* Q8_1's s: f16(d * the sum of quants) */
            int32_t sum = 0;
            float amax = 0.0f;
            for (int i = 0; i < 32; ++i) sum += xq[b * 32 + i];
            /* (one loop of both, with fmaxf, stops GCC 12's aarch64 vectorizer) */
            for (int i = 0; i < 32; ++i)
                if (fabsf(x[b * 32 + i]) > amax) amax = fabsf(x[b * 32 + i]);
            const double want = f16_round((double)(amax / 127.0f * (float)sum));
            th_check(xs[b] == (float)want, "%s: block %lld's s %g, want %g", ctx, (long long)b,
                     (double)xs[b], want);
        }
        rc = k->quant_dot_q8_rows(t->type, ncols, xq, xd, xs, w, rb, 2, 9, y);
        rc_other = k->quant_dot_q8k_rows(t->type, ncols, xq, xd, (const int16_t *)(void *)xs, w,
                                         rb, 2, 9, other);
    }
    th_check(rc == 1 && rc_other == 0, "%s: return codes %d, %d from the other form", ctx, rc,
             rc_other);
    const double m = (double)(nb / 2 + 9), g = m * U32 / (1.0 - m * U32);
    th_miss miss = TH_MISS_INIT;
    for (int64_t j = 0; j < nout; ++j) {
        th_expect_bits(&miss, "y of the other form's kernel (written)", j, other[j],
                       bits_f32(SENTINEL_BITS));
        if (j < 2 || j >= 9) {
            th_expect_bits(&miss, "y outside the rows (written)", j, y[j], bits_f32(SENTINEL_BITS));
            continue;
        }
        ref_row(t, w + j * rb, ncols, wf);
        double s = 0.0, a = 0.0;
        for (int64_t i = 0; i < ncols; ++i) {
            const double xi = (double)xq[i] * xd[k_form ? i / 256 : i / 32],
                         p = (double)wf[i] * xi;
            s += p;
            a += fabs(p);
            if (t->type == 12 || t->type == 13) {   /* Q4_K, Q5_K: dmin * m of value i's sub-block */
                const uint8_t *blk = w + j * rb + (i / 256) * t->bytes;
                int sc[8], mn[8];
                k_scales_mins(blk + 4, sc, mn);
                a += 2.0 * fabs(f16_at(blk + 2)) * mn[(i % 256) / 32] * fabs(xi);
            }
            if (t->type == 3 || t->type == 7)   /* Q4_1, Q5_1: m of value i's block */
                a += 2.0 * fabs(f16_at(w + j * rb + (i / 32) * t->bytes + 2)) * fabs(xi);
            if (t->type == 10) {   /* Q2_K: dmin * m, m the high nibble of its 16 values' byte */
                const uint8_t *blk = w + j * rb + (i / 256) * t->bytes;
                a += 2.0 * fabs(f16_at(blk + 82)) * (blk[(i % 256) / 16] >> 4) * fabs(xi);
            }
        }
        if (t->type == 3 || t->type == 7) {
            /* a Q4_1 or Q5_1 block's m multiplies Q8_1's s, not the rounded
             * values' sum (d16 times the sum of quants) */
            for (int64_t b = 0; b < nb; ++b) {
                double sum = 0.0;
                for (int i = 0; i < 32; ++i) sum += xq[b * 32 + i];
                const double m = f16_at(w + j * rb + b * t->bytes + 2);
                s += m * ((double)xs[b] - (double)xd[b] * sum);
                a += 2.0 * fabs(m) * fabs((double)xs[b]);
            }
        }
        th_expect(&miss, "y", j, y[j], s, g * a + U32 * fabs(s));
    }
    th_report(&miss, ctx);
}

static void check_q8_dot_refuses(const ggmlopt_kernel_table *k, const qtype *t) {
    const int64_t ncols = t->ncols[0];
    const uint8_t *w = rand_rows(t, 2, ncols, 0, 0);
    int8_t *xq = th_alloc(1, ncols + 32, 0);
    float *xd = th_alloc(4, ncols / 32 + 1, 0);
    memset(xq, 0, (size_t)(ncols + 32));
    for (int64_t i = 0; i <= ncols / 32; ++i) xd[i] = 1.0f;
    float *y = sentinel_f32(2);
    const int rc = k->quant_dot_q8_rows(t->type, ncols, xq, xd, xd, w, row_bytes_of(t, ncols), 0,
                                        2, y) +
                   k->quant_dot_q8k_rows(t->type, ncols, xq, xd, (const int16_t *)(void *)xd, w,
                                         row_bytes_of(t, ncols), 0, 2, y);
    th_miss m = TH_MISS_INIT;
    for (int j = 0; j < 2; ++j) th_expect_bits(&m, "y of a refused type", j, y[j], bits_f32(SENTINEL_BITS));
    char ctx[96];
    snprintf(ctx, sizeof ctx, "quant_dot_q8_rows[%s] %s (refused: %d)", k->name, t->name, rc);
    th_report(&m, ctx);
    th_check(rc == 0, "%s", ctx);
}

/* ---- one dispatch table --------------------------------------------------------- */

void test_quant_kernels(const ggmlopt_kernel_table *k) {
    th_set_stage("quantized kernels, table %s", k->name);
    char ctx[160];
    for (int ti = 0; ti < NTYPES; ++ti) {
        const qtype *t = &TYPES[ti];
        th_seed(0x9a47ULL ^ (uint64_t)t->type << 16);
        for (int ci = 0; ci < 3; ++ci) {
            const int64_t ncols = t->ncols[ci], nrows = 5, r0 = 2;
            const uint8_t *src = rand_rows(t, nrows, ncols, 1, 1);
            float *want = th_alloc(4, nrows * ncols, 0);
            for (int64_t r = 0; r < nrows; ++r)
                ref_row(t, src + r * row_bytes_of(t, ncols), ncols, want + r * ncols);
            snprintf(ctx, sizeof ctx, "dequantize_rows[%s] %s rows [2, 5) ncols=%lld stride=+3",
                     k->name, t->name, (long long)ncols);
            check_dequant(k, t, src, want, nrows, r0, ncols, ncols + 3, ctx);
            /* an empty range writes nothing */
            float *none = sentinel_f32(4);
            k->dequantize_rows(t->type, 3, 3, ncols, src, row_bytes_of(t, ncols), none, ncols);
            th_miss m = TH_MISS_INIT;
            for (int i = 0; i < 4; ++i)
                th_expect_bits(&m, "dst of rows [3, 3)", i, none[i], bits_f32(SENTINEL_BITS));
            th_report(&m, ctx);
        }
        for (int ci = 0; ci < 3; ci += 2) {
            for (int xi = 0; xi < NNX; ++xi) {
                mm_case c;
                mm_setup(&c, t, NX[xi], t->ncols[ci], 11);
                snprintf(ctx, sizeof ctx,
                         "quant_matmul_rows[%s] %s nx=%lld ncols=%lld weight rows [2, 9) of 11",
                         k->name, t->name, (long long)c.nx, (long long)c.ncols);
                check_matmul(k, t, &c, 2, 9, ctx);
            }
        }
        if (has_integer_dot(t)) {
            static const int64_t widths[] = {32, 64, 96, 160, 608, 256, 512, 768, 1280, 2560};
            const int k_type = t->block == 256;
            for (int wi = k_type ? 5 : 0; wi < (k_type ? 10 : 5); ++wi) {
                snprintf(ctx, sizeof ctx, "integer dot rows[%s] %s ncols=%lld rows [2, 9) of 11",
                         k->name, t->name, (long long)widths[wi]);
                check_q8_dot(k, t, widths[wi], ctx);
            }
        } else {   /* F32, F16, BF16: no integer products */
            check_q8_dot_refuses(k, t);
        }
        th_release_all();
    }
}

/* ---- the public functions ------------------------------------------------------- */

static int supported_paths(const char **names) {
    int n = 0;
    for (int p = 0; p < ggmlopt_simd_count(); ++p)
        if (ggmlopt_simd_supported(p)) names[n++] = ggmlopt_simd_name(p);
    return n;
}

static int select_path(const char *path) {
    const int rc = ggmlopt_simd_select(path);
    th_check(rc == 0 && strcmp(ggmlopt_simd_active(), path) == 0, "select(\"%s\") = %d, active %s",
             path, rc, ggmlopt_simd_active());
    return rc == 0;
}

/* dst rows ids[i] of src: the reference rows' bits */
static void check_gather(const qtype *t, const uint8_t *src, const float *want, int64_t ncols,
                         const char *ctx) {
    static const int32_t ids[] = {4, 0, 4, 10, 7, 1, 4};
    const int64_t n = (int64_t)(sizeof ids / sizeof ids[0]);
    float *dst = sentinel_f32(n * ncols);
    const int rc = ggmlopt_dequantize_gather(t->type, n, th_dup(ids, 4, n), ncols, src, dst);
    th_check(rc == 0, "%s: return code %d", ctx, rc);
    th_miss m = TH_MISS_INIT;
    for (int64_t i = 0; i < n; ++i)
        for (int64_t j = 0; j < ncols; ++j)
            th_expect_bits(&m, "value", i * ncols + j, dst[i * ncols + j], want[ids[i] * ncols + j]);
    th_report(&m, ctx);
}

/* Enough rows and columns that two threads split them (the dispatcher's blocks
 * are some 4096 values, threads join from 65536), from an awkward first row. */
static void public_type(const qtype *t, const char **paths, int npaths) {
    char ctx[160];
    const int64_t ncols = t->ncols[2], nrows = 120, r0 = 7;
    const uint8_t *src = rand_rows(t, nrows, ncols, 1, 1);
    float *want = th_alloc(4, nrows * ncols, 0);
    for (int64_t r = 0; r < nrows; ++r)
        ref_row(t, src + r * row_bytes_of(t, ncols), ncols, want + r * ncols);
    mm_case cases[NNX];
    for (int xi = 0; xi < NNX; ++xi) mm_setup(&cases[xi], t, NX[xi], ncols, 120);
    for (int p = 0; p < npaths; ++p) {
        if (!select_path(paths[p])) continue;
        float *first[NNX];
        for (int threads = 1; threads <= 2; ++threads) {
            ggmlopt_set_num_threads(threads);
            th_set_stage("quantized public API %s [%s, %d threads]", t->name, paths[p], threads);
            snprintf(ctx, sizeof ctx,
                     "ggmlopt_dequantize_rows %s [%s, %d threads] rows [7, 120) ncols=%lld "
                     "stride=+3",
                     t->name, paths[p], threads, (long long)ncols);
            check_dequant(NULL, t, src, want, nrows, r0, ncols, ncols + 3, ctx);
            snprintf(ctx, sizeof ctx, "ggmlopt_dequantize_gather %s [%s, %d threads]", t->name,
                     paths[p], threads);
            check_gather(t, src, want, ncols, ctx);
            for (int xi = 0; xi < NNX; ++xi) {
                const mm_case *c = &cases[xi];
                snprintf(ctx, sizeof ctx,
                         "ggmlopt_quant_matmul_f32 %s [%s, %d threads] nx=%lld ncols=%lld "
                         "nout=120 x_stride=+5 y_stride=+3",
                         t->name, paths[p], threads, (long long)c->nx, (long long)ncols);
                float *y = check_matmul(NULL, t, c, 0, c->nout, ctx);
                if (threads == 1) {
                    first[xi] = y;
                    continue;
                }
                /* a weight row's dot products do not depend on the split */
                th_miss m = TH_MISS_INIT;
                for (int64_t i = 0; i < c->nx; ++i)
                    for (int64_t j = 0; j < c->nout; ++j)
                        th_expect_bits(&m, "2 threads vs 1", i * c->ys + j, y[i * c->ys + j],
                                       first[xi][i * c->ys + j]);
                th_report(&m, ctx);
            }
        }
    }
}

/* ncols 0: row_bytes 0, nothing dequantized, a product of zeros */
static void public_empty(void) {
    th_set_stage("quantized public API, empty shapes");
    for (int ti = 0; ti < NTYPES; ++ti) {
        const qtype *t = &TYPES[ti];
        const int64_t rb = ggmlopt_quant_row_bytes(t->type, 0);
        float *dst = sentinel_f32(6), *y = sentinel_f32(2 * 4 + 3);
        const float *x = th_rand_f32(4, 0, -1.0f, 1.0f);
        const uint8_t *w = th_alloc(1, 1, 0);
        const int rd = ggmlopt_dequantize_rows(t->type, 0, 3, 0, w, dst, 2);
        const int re = ggmlopt_dequantize_rows(t->type, 2, 2, t->block, w, dst, 2);
        const int rm = ggmlopt_quant_matmul_f32(t->type, 3, 0, x, 0, 3, w, y, 4);
        const int rn = ggmlopt_quant_matmul_f32(t->type, 0, t->block, x, t->block, 3, w, y, 4);
        th_check(rb == 0 && rd == 0 && re == 0 && rm == 0 && rn == 0,
                 "%s empty shapes: row_bytes(0) = %lld, dequantize %d %d, matmul %d %d", t->name,
                 (long long)rb, rd, re, rm, rn);
        th_miss m = TH_MISS_INIT;
        for (int i = 0; i < 6; ++i)
            th_expect_bits(&m, "dst of an empty dequantization", i, dst[i], bits_f32(SENTINEL_BITS));
        for (int i = 0; i < 11; ++i)
            th_expect_bits(&m, "y of ncols=0", i, y[i], i % 4 < 3 ? 0.0f : bits_f32(SENTINEL_BITS));
        char ctx[96];
        snprintf(ctx, sizeof ctx, "quantized public API %s empty shapes", t->name);
        th_report(&m, ctx);
        th_release_all();
    }
}

/* Unknown types and widths that are not whole blocks: -1, nothing written. */
/* ggmlopt_quant_matmul_q8 on every path and 1 and 2 threads: each output the
 * table kernel's on the row's rounding, the same bits for any split; -2 and
 * nothing written for a type without integer products, -1 for a bad width */
static void public_q8(const char **paths, int npaths) {
    th_set_stage("quantized public API, Q8_0 and Q8_K activations");
    for (int ti = 0; ti < NTYPES; ++ti) {
        const qtype *t = &TYPES[ti];
        if (t->block < 32) continue;
        const int64_t ncols = t->ncols[2], nout = 300, nx = 2;
        const uint8_t *w = rand_rows(t, nout, ncols, 0, 1);
        const float *x = th_rand_f32(nx * (ncols + 5), 0, -1.0f, 1.0f);
        int8_t *xq = th_alloc(1, ncols + 32, 0);
        float *xd = th_alloc(4, ncols / 32, 0), *xs = th_alloc(4, ncols / 32, 0);
        const int q8 = has_integer_dot(t);
        float *first = NULL;
        for (int p = 0; p < npaths; ++p) {
            if (!select_path(paths[p])) continue;
            for (int threads = 1; threads <= 2; ++threads) {
                ggmlopt_set_num_threads(threads);
                float *y = sentinel_f32(nx * (nout + 3));
                const int rc = ggmlopt_quant_matmul_q8(t->type, nx, ncols, x, ncols + 5, nout, w,
                                                       y, nout + 3, xq, xd, xs);
                char ctx[128];
                snprintf(ctx, sizeof ctx, "ggmlopt_quant_matmul_q8 %s [%s, %d threads]", t->name,
                         paths[p], threads);
                th_check(rc == (q8 ? 0 : -2), "%s: return code %d", ctx, rc);
                th_miss m = TH_MISS_INIT;
                for (int64_t i = 0; i < nx * (nout + 3); ++i) {
                    const int pad = i % (nout + 3) >= nout;
                    if (!q8 || pad) {
                        th_expect_bits(&m, "y not to be written", i, y[i], bits_f32(SENTINEL_BITS));
                    } else if (first && threads == 2) {
                        th_expect_bits(&m, "2 threads vs 1", i, y[i], first[i]);
                    }
                }
                th_report(&m, ctx);
                if (threads == 1) first = y;
            }
            first = NULL;
        }
        th_check(ggmlopt_quant_matmul_q8(t->type, 1, ncols + 1, x, ncols, 1, w, xd, 1, xq, xd, xs) ==
                     -1,
                 "ggmlopt_quant_matmul_q8 %s: a width of part of a block not refused", t->name);
        th_release_all();
    }
}

static void public_errors(void) {
    th_set_stage("quantized public API, errors");
    /* ggml types these kernels do not read (removed Q4_2/Q4_3, Q8_1, Q8_K, the IQ
     * types but IQ4_NL and IQ4_XS, I8, F64, MXFP4, ...) and numbers that are no type */
    static const int bad_types[] = {-1, 4, 5, 9, 15, 16, 17, 18, 19, 21, 22, 24, 28, 29, 31,
                                    39, 1000};
    for (size_t b = 0; b < sizeof bad_types / sizeof bad_types[0]; ++b)
        for (int64_t ncols = 0; ncols <= 512; ncols += 256)
            th_check(ggmlopt_quant_row_bytes(bad_types[b], ncols) == -1,
                     "quant_row_bytes(type %d, %lld) = %lld, want -1", bad_types[b],
                     (long long)ncols, (long long)ggmlopt_quant_row_bytes(bad_types[b], ncols));
    for (int ti = 0; ti < NTYPES; ++ti) {
        const qtype *t = &TYPES[ti];
        for (int64_t nb = 0; nb <= 3; ++nb)
            th_check(ggmlopt_quant_row_bytes(t->type, nb * t->block) == nb * t->bytes,
                     "quant_row_bytes(%s, %lld) = %lld, want %lld", t->name,
                     (long long)(nb * t->block),
                     (long long)ggmlopt_quant_row_bytes(t->type, nb * t->block),
                     (long long)(nb * t->bytes));
        const int64_t bad_cols[] = {-t->block, -1, t->block / 2, t->block - 1, t->block + 1,
                                    3 * t->block + t->block / 2};
        for (size_t c = 0; c < sizeof bad_cols / sizeof bad_cols[0]; ++c) {
            /* a negative width or, for the block types, part of a block */
            if (bad_cols[c] >= 0 && bad_cols[c] % t->block == 0) continue;
            th_check(ggmlopt_quant_row_bytes(t->type, bad_cols[c]) == -1,
                     "quant_row_bytes(%s, %lld) = %lld, want -1", t->name, (long long)bad_cols[c],
                     (long long)ggmlopt_quant_row_bytes(t->type, bad_cols[c]));
        }
    }

    /* the other functions on those: big enough buffers that a call going ahead
     * anyway stays inside them, so the check sees its writes */
    const int64_t cap = 4 * 4 * 256;
    uint8_t *src = th_alloc(1, 4 * cap, 0);
    memset(src, 0, (size_t)(4 * cap));
    const float *x = th_rand_f32(cap, 0, -1.0f, 1.0f);
    static const int32_t ids[] = {0, 1};
    float *dst = sentinel_f32(cap);
    struct {
        int type;
        int64_t ncols;
    } bad[] = {{4, 32}, {9, 32}, {16, 256}, {1000, 32}, {-1, 32}, {2, 33}, {2, 16},
               {8, 48}, {12, 32}, {13, 255}, {14, 257}, {12, 512 + 32}, {0, -1}};
    for (size_t b = 0; b < sizeof bad / sizeof bad[0]; ++b) {
        const int type = bad[b].type;
        const int64_t ncols = bad[b].ncols;
        const int rd = ggmlopt_dequantize_rows(type, 1, 3, ncols, src, dst, 2 * 256 + 40);
        const int rm = ggmlopt_quant_matmul_f32(type, 3, ncols, x, 600, 4, src, dst, 8);
        const int rg = ggmlopt_dequantize_gather(type, 2, ids, ncols, src, dst);
        th_check(rd == -1 && rm == -1 && rg == -1,
                 "type %d ncols %lld: dequantize_rows %d, quant_matmul %d, gather %d, want -1",
                 type, (long long)ncols, rd, rm, rg);
    }
    th_miss m = TH_MISS_INIT;
    for (int64_t i = 0; i < cap; ++i)
        th_expect_bits(&m, "dst after refused calls", i, dst[i], bits_f32(SENTINEL_BITS));
    th_report(&m, "quantized public API: refused calls write nothing");
    th_release_all();
}

void test_quant_public(void) {
    const int threads_before = ggmlopt_get_num_threads();
    const char *paths[8];
    const int npaths = supported_paths(paths);
    for (int ti = 0; ti < NTYPES; ++ti) {
        th_seed(0x9a48ULL ^ (uint64_t)TYPES[ti].type << 16);
        public_type(&TYPES[ti], paths, npaths);
        th_release_all();
    }
    public_q8(paths, npaths);
    ggmlopt_simd_select(NULL);
    ggmlopt_set_num_threads(threads_before);
    public_empty();
    public_errors();
}

/* ---- quantization to the K types (quantize_k.c) ------------------------------
 * The bytes' equality with ggml's own quantizer is checked against llama.cpp's
 * library in tests/llamacpp; here, what any correct output satisfies: ggml's
 * reference ends by rounding each value to the grid its block's stored scales
 * define, so every decoded value is the grid point nearest to its input (its
 * neighbours on the grid are no closer), the bytes stop at the row's end, and
 * the threads do not change them. */

/* value i's grid: y = step * level - offset, level in 0..nmax */
static void k_grid(int type, const uint8_t *block, int i, double *step, double *offset,
                   int *nmax) {
    uint16_t h;
    if (type == 14) {   /* Q6_K: ql[128] qh[64] scales[16] d */
        memcpy(&h, block + 208, 2);
        *step = th_f16_to_double(h) * (int8_t)block[192 + i / 16];
        *offset = 32 * *step;
        *nmax = 63;
        return;
    }
    const uint8_t *q = block + 4;
    const int j = i / 32;
    int sc, m;
    if (j < 4) {
        sc = q[j] & 63;
        m = q[j + 4] & 63;
    } else {
        sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
        m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
    uint16_t hm;
    memcpy(&h, block, 2);
    memcpy(&hm, block + 2, 2);
    *step = th_f16_to_double(h) * sc;
    *offset = th_f16_to_double(hm) * m;
    *nmax = type == 12 ? 15 : 31;
}

static void quantize_type(int type, const char *name) {
    const int64_t nrows = 5, ncols = 768, bytes = ggmlopt_quant_row_bytes(type, ncols);
    const int64_t block_bytes = bytes / (ncols / 256);
    float *x = th_alloc(4, nrows * ncols, 1);
    for (int64_t r = 0; r < nrows; ++r) {
        const float scale = (float)pow(10.0, (double)th_uniform(-3.0f, 2.0f));
        for (int64_t c = 0; c < ncols; ++c) x[r * ncols + c] = th_uniform(-1.0f, 1.0f) * scale;
    }
    for (int64_t c = 0; c < 256; ++c) x[ncols + c] = fabsf(x[ncols + c]);   /* min 0 */
    for (int64_t c = 300; c < 340; ++c) x[2 * ncols + c] = 0.0f;            /* zeros */
    uint8_t *q1 = th_alloc(1, nrows * bytes, 0), *q2 = th_alloc(1, nrows * bytes, 3);
    float *y = th_alloc(4, nrows * ncols, 0);
    ggmlopt_set_num_threads(1);
    th_check(ggmlopt_quantize_rows_f32(type, nrows, ncols, x, q1) == 0, "%s quantize", name);
    ggmlopt_set_num_threads(2);
    th_check(ggmlopt_quantize_rows_f32(type, nrows, ncols, x, q2) == 0, "%s quantize", name);
    th_check(memcmp(q1, q2, (size_t)(nrows * bytes)) == 0, "%s: 1 and 2 threads differ", name);
    ggmlopt_dequantize_rows(type, 0, nrows, ncols, q1, y, ncols);
    int64_t bad = -1;
    for (int64_t i = 0; i < nrows * ncols && bad < 0; ++i) {
        const int64_t r = i / ncols, c = i % ncols;
        double step, offset;
        int nmax;
        k_grid(type, q1 + r * bytes + (c / 256) * block_bytes, (int)(c % 256), &step, &offset,
               &nmax);
        if (step == 0.0) continue;
        const double got = y[i], want = x[i], err = fabs(got - want);
        const double level = nearbyint((got + offset) / step);
        const double slack = 4.0 * U32 * (fabs(want) + fabs(offset));
        if (level < 0 || level > nmax) bad = i;
        for (int d = -1; d <= 1 && bad < 0; d += 2) {
            const double alt = level + d;
            if (alt >= 0 && alt <= nmax && err > fabs(alt * step - offset - want) + slack) bad = i;
        }
    }
    th_check(bad < 0, "%s: value %lld is not on the grid point nearest to it", name,
             (long long)bad);
}

void test_quantize_k(void) {
    const int threads_before = ggmlopt_get_num_threads();
    th_seed(0x51ab);
    quantize_type(12, "Q4_K");
    quantize_type(13, "Q5_K");
    quantize_type(14, "Q6_K");
    ggmlopt_set_num_threads(threads_before);
    /* refused: another type, a width that is not whole super-blocks; nothing written */
    float x[320] = {0};
    uint8_t dst[400];
    memset(dst, 0x5a, sizeof dst);
    th_check(ggmlopt_quantize_rows_f32(8, 1, 256, x, dst) == -1, "quantize refuses Q8_0");
    th_check(ggmlopt_quantize_rows_f32(12, 1, 320, x, dst) == -1, "quantize refuses 320 values");
    th_check(ggmlopt_quantize_rows_f32(12, 0, 256, x, dst) == 0, "quantize of no rows");
    int untouched = 1;
    for (size_t i = 0; i < sizeof dst; ++i) untouched &= dst[i] == 0x5a;
    th_check(untouched, "refused quantize calls write nothing");
    th_release_all();
}
