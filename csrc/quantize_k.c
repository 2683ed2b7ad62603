/*
 * Float32 rows to ggml's K block types (Q4_K, Q5_K, Q6_K), as llama-quantize
 * writes them without an importance matrix: ggml-quants.c's
 * quantize_row_q{4,5,6}_K_ref, operation for operation, so that a file ggmlopt
 * quantizes holds the bytes llama-quantize would write for the same weights.
 *
 * Why one scalar unit and not a kernel per SIMD path: the reference searches a
 * scale per sub-block with sums taken in one order; a vectorised sum, or a
 * multiply and add fused into one rounding, would move an ulp and now and then
 * flip a rounding decision, which is a different file.  This runs once per
 * export, threaded over rows by dispatch.c, and fused multiply-adds are turned
 * off for this file (aarch64's compilers would fuse them by default; ggml's
 * reference is built for the baseline x86-64, which has none).
 */
#if defined(__clang__)
#pragma STDC FP_CONTRACT OFF
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif

#include "quantize_k.h"

#include <float.h>
#include <math.h>
#include <string.h>

#define QK_K 256
/* a sub-block whose largest magnitude is below this quantizes to zeros */
#define GROUP_MAX_EPS 1e-15f

/* round to nearest, ties to even, for |f| <= 2^22: adding 1.5 * 2^23 leaves
 * the rounded integer in the mantissa's low bits */
static int nearest_int(float f) {
    float v = f + 12582912.f;
    int i;
    memcpy(&i, &v, sizeof i);
    return (i & 0x007fffff) - 0x00400000;
}

static uint32_t f32_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}

static float bits_f32(uint32_t u) {
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* IEEE half from float, round to nearest even (ggml's software conversion,
 * the same bits F16C's gives for every input) */
static uint16_t f32_to_f16(float f) {
    const float scale_to_inf = 0x1.0p+112f, scale_to_zero = 0x1.0p-110f;
    float base = (fabsf(f) * scale_to_inf) * scale_to_zero;
    const uint32_t w = f32_bits(f), shl1_w = w + w, sign = w & 0x80000000u;
    uint32_t bias = shl1_w & 0xFF000000u;
    if (bias < 0x71000000u) bias = 0x71000000u;
    base = bits_f32((bias >> 1) + 0x07800000u) + base;
    const uint32_t bits = f32_bits(base);
    const uint32_t nonsign = ((bits >> 13) & 0x00007C00u) + (bits & 0x00000FFFu);
    return (uint16_t)((sign >> 16) | (shl1_w > 0xFF000000u ? 0x7E00u : nonsign));
}

/* IEEE half to float, exact */
static float f16_to_f32(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    const uint32_t exp = (h >> 10) & 0x1Fu, man = h & 0x3FFu;
    if (exp == 0x1F) return bits_f32(sign | 0x7F800000u | (man << 13));
    if (exp == 0) {   /* zero or subnormal: man * 2^-24, exact in float */
        const float v = (float)man * 0x1.0p-24f;
        return sign ? -v : v;
    }
    return bits_f32(sign | ((exp + 112) << 23) | (man << 13));
}

static void put_f16(uint8_t *p, float f) {
    const uint16_t h = f32_to_f16(f);
    memcpy(p, &h, 2);
}

static float get_f16(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return f16_to_f32(h);
}

static int clamp_int(int v, int lo, int hi) { return v < lo ? lo : v > hi ? hi : v; }

/* A sub-block's scale and minimum for levels 0..nmax (Q4_K, Q5_K): a first
 * guess from its range, then nstep + 1 candidate scales, each fitted by
 * weighted least squares; the one with the least weighted squared error wins.
 * L gets the levels; *neg_min the minimum's negation (>= 0). */
static float scale_min_search(int n, int nmax, const float *x, const float *weights, uint8_t *L,
                              float *neg_min, uint8_t *Laux, float rmin, float rdelta, int nstep) {
    float min = x[0], max = x[0];
    float sum_w = weights[0];
    float sum_x = sum_w * x[0];
    for (int i = 1; i < n; ++i) {
        if (x[i] < min) min = x[i];
        if (x[i] > max) max = x[i];
        const float w = weights[i];
        sum_w += w;
        sum_x += w * x[i];
    }
    if (min > 0) min = 0;
    if (max == min) {
        for (int i = 0; i < n; ++i) L[i] = 0;
        *neg_min = -min;
        return 0.f;
    }
    float iscale = nmax / (max - min);
    float scale = 1 / iscale;
    float best_error = 0;
    for (int i = 0; i < n; ++i) {
        const int l = nearest_int(iscale * (x[i] - min));
        L[i] = (uint8_t)clamp_int(l, 0, nmax);
        float diff = scale * L[i] + min - x[i];
        diff = diff * diff;
        best_error += weights[i] * diff;
    }
    for (int is = 0; is <= nstep; ++is) {
        iscale = (rmin + rdelta * is + nmax) / (max - min);
        float sum_l = 0, sum_l2 = 0, sum_xl = 0;
        for (int i = 0; i < n; ++i) {
            const int l = clamp_int(nearest_int(iscale * (x[i] - min)), 0, nmax);
            Laux[i] = (uint8_t)l;
            const float w = weights[i];
            sum_l += w * l;
            sum_l2 += w * l * l;
            sum_xl += w * l * x[i];
        }
        const float D = sum_w * sum_l2 - sum_l * sum_l;
        if (D > 0) {
            float this_scale = (sum_w * sum_xl - sum_x * sum_l) / D;
            float this_min = (sum_l2 * sum_x - sum_l * sum_xl) / D;
            if (this_min > 0) {
                this_min = 0;
                this_scale = sum_xl / sum_l2;
            }
            float cur_error = 0;
            for (int i = 0; i < n; ++i) {
                float diff = this_scale * Laux[i] + this_min - x[i];
                diff = diff * diff;
                cur_error += weights[i] * diff;
            }
            if (cur_error < best_error) {
                memcpy(L, Laux, (size_t)n);
                best_error = cur_error;
                scale = this_scale;
                min = this_min;
            }
        }
    }
    *neg_min = -min;
    return scale;
}

/* Q6_K's sub-block scale for symmetric levels -nmax..nmax-1 (weights x^2):
 * the range's scale, then 18 nearby ones, each refitted; L gets level + nmax. */
static float symmetric_scale_search(int n, int nmax, const float *x, int8_t *L) {
    float max = 0, amax = 0;
    for (int i = 0; i < n; ++i) {
        const float ax = fabsf(x[i]);
        if (ax > amax) {
            amax = ax;
            max = x[i];
        }
    }
    if (amax < GROUP_MAX_EPS) {
        for (int i = 0; i < n; ++i) L[i] = 0;
        return 0.f;
    }
    float iscale = -nmax / max;
    float sumlx = 0, suml2 = 0;
    for (int i = 0; i < n; ++i) {
        const int l = clamp_int(nearest_int(iscale * x[i]), -nmax, nmax - 1);
        L[i] = (int8_t)(l + nmax);
        const float w = x[i] * x[i];
        sumlx += w * x[i] * l;
        suml2 += w * l * l;
    }
    float scale = suml2 ? sumlx / suml2 : 0.0f;
    float best = scale * sumlx;
    for (int is = -9; is <= 9; ++is) {
        if (is == 0) continue;
        iscale = -(nmax + 0.1f * is) / max;
        sumlx = suml2 = 0;
        for (int i = 0; i < n; ++i) {
            const int l = clamp_int(nearest_int(iscale * x[i]), -nmax, nmax - 1);
            const float w = x[i] * x[i];
            sumlx += w * x[i] * l;
            suml2 += w * l * l;
        }
        if (suml2 > 0 && sumlx * sumlx > best * suml2) {
            for (int i = 0; i < n; ++i)
                L[i] = (int8_t)(nmax + clamp_int(nearest_int(iscale * x[i]), -nmax, nmax - 1));
            scale = sumlx / suml2;
            best = scale * sumlx;
        }
    }
    return scale;
}

/* a Q4_K/Q5_K sub-block j's 6-bit scale and minimum from the 12 packed bytes */
static void scale_min_k4(int j, const uint8_t *q, uint8_t *d, uint8_t *m) {
    if (j < 4) {
        *d = q[j] & 63;
        *m = q[j + 4] & 63;
    } else {
        *d = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
        *m = (q[j + 4] >> 4) | ((q[j - 0] >> 6) << 4);
    }
}

/* One super-block of Q4_K (nmax 15) or Q5_K (nmax 31): eight sub-blocks of 32,
 * each a 6-bit scale and minimum under the block's f16 d and dmin, then the
 * levels requantized against the stored scales.  Writes d, dmin, scales[12]
 * at b and the levels into L. */
static void k_scales_and_levels(const float *x, uint8_t *b, uint8_t L[QK_K], int nmax,
                                float rmin, int nstep) {
    float mins[QK_K / 32], scales[QK_K / 32], weights[32];
    uint8_t Laux[32];
    float max_scale = 0, max_min = 0;
    for (int j = 0; j < QK_K / 32; ++j) {
        float sum_x2 = 0;
        for (int l = 0; l < 32; ++l) sum_x2 += x[32 * j + l] * x[32 * j + l];
        const float av_x = sqrtf(sum_x2 / 32);
        for (int l = 0; l < 32; ++l) weights[l] = av_x + fabsf(x[32 * j + l]);
        scales[j] = scale_min_search(32, nmax, x + 32 * j, weights, L + 32 * j, &mins[j], Laux,
                                     rmin, 0.1f, nstep);
        if (scales[j] > max_scale) max_scale = scales[j];
        if (mins[j] > max_min) max_min = mins[j];
    }
    uint8_t *sc = b + 4;
    const float inv_scale = max_scale > 0 ? 63.f / max_scale : 0.f;
    const float inv_min = max_min > 0 ? 63.f / max_min : 0.f;
    for (int j = 0; j < QK_K / 32; ++j) {
        uint8_t ls = (uint8_t)nearest_int(inv_scale * scales[j]);
        uint8_t lm = (uint8_t)nearest_int(inv_min * mins[j]);
        if (ls > 63) ls = 63;
        if (lm > 63) lm = 63;
        if (j < 4) {
            sc[j] = ls;
            sc[j + 4] = lm;
        } else {
            sc[j + 4] = (uint8_t)((ls & 0xF) | ((lm & 0xF) << 4));
            sc[j - 4] |= (uint8_t)((ls >> 4) << 6);
            sc[j - 0] |= (uint8_t)((lm >> 4) << 6);
        }
    }
    put_f16(b, max_scale / 63.f);
    put_f16(b + 2, max_min / 63.f);
    const float d_all = get_f16(b), dmin_all = get_f16(b + 2);
    for (int j = 0; j < QK_K / 32; ++j) {
        uint8_t s, m;
        scale_min_k4(j, sc, &s, &m);
        const float d = d_all * s;
        if (!d) continue;
        const float dm = dmin_all * m;
        for (int i = 0; i < 32; ++i)
            L[32 * j + i] = (uint8_t)clamp_int(nearest_int((x[32 * j + i] + dm) / d), 0, nmax);
    }
}

/* Q4_K: d, dmin (f16) | scales[12] | qs[128]: values j and j + 32 of each 64 in
 * one byte's low and high nibble */
static void quantize_block_q4_k(const float *x, uint8_t *b) {
    uint8_t L[QK_K];
    k_scales_and_levels(x, b, L, 15, -1.f, 20);
    uint8_t *q = b + 16;
    for (int j = 0; j < QK_K; j += 64) {
        for (int l = 0; l < 32; ++l) q[l] = (uint8_t)(L[j + l] | (L[j + l + 32] << 4));
        q += 32;
    }
}

/* Q5_K: d, dmin | scales[12] | qh[32]: the fifth bits | qs[128] as Q4_K's */
static void quantize_block_q5_k(const float *x, uint8_t *b) {
    uint8_t L[QK_K];
    k_scales_and_levels(x, b, L, 31, -0.5f, 15);
    uint8_t *qh = b + 16, *ql = b + 48;
    memset(qh, 0, QK_K / 8);
    uint8_t m1 = 1, m2 = 2;
    for (int n = 0; n < QK_K; n += 64) {
        for (int j = 0; j < 32; ++j) {
            int l1 = L[n + j], l2 = L[n + j + 32];
            if (l1 > 15) {
                l1 -= 16;
                qh[j] |= m1;
            }
            if (l2 > 15) {
                l2 -= 16;
                qh[j] |= m2;
            }
            ql[j] = (uint8_t)(l1 | (l2 << 4));
        }
        m1 = (uint8_t)(m1 << 2);
        m2 = (uint8_t)(m2 << 2);
        ql += 32;
    }
}

/* Q6_K: ql[128] (low 4 bits) | qh[64] (high 2 bits) | scales[16] (int8) | d (f16) */
static void quantize_block_q6_k(const float *x, uint8_t *b) {
    int8_t L[QK_K];
    float scales[QK_K / 16];
    float max_scale = 0, max_abs_scale = 0;
    for (int ib = 0; ib < QK_K / 16; ++ib) {
        const float scale = symmetric_scale_search(16, 32, x + 16 * ib, L + 16 * ib);
        scales[ib] = scale;
        if (fabsf(scale) > max_abs_scale) {
            max_abs_scale = fabsf(scale);
            max_scale = scale;
        }
    }
    uint8_t *ql = b, *qh = b + 128, *sc = b + 192, *dp = b + 208;
    if (max_abs_scale < GROUP_MAX_EPS) {
        memset(b, 0, 210);
        return;
    }
    const float iscale = -128.f / max_scale;
    put_f16(dp, 1 / iscale);
    for (int ib = 0; ib < QK_K / 16; ++ib) {
        const int s = nearest_int(iscale * scales[ib]);
        sc[ib] = (uint8_t)(int8_t)(s < 127 ? s : 127);
    }
    const float d_all = get_f16(dp);
    for (int j = 0; j < QK_K / 16; ++j) {
        const float d = d_all * (int8_t)sc[j];
        if (!d) continue;
        for (int i = 0; i < 16; ++i)
            L[16 * j + i] = (int8_t)(clamp_int(nearest_int(x[16 * j + i] / d), -32, 31) + 32);
    }
    for (int j = 0; j < QK_K; j += 128) {
        for (int l = 0; l < 32; ++l) {
            const uint8_t q1 = L[j + l] & 0xF, q2 = L[j + l + 32] & 0xF;
            const uint8_t q3 = L[j + l + 64] & 0xF, q4 = L[j + l + 96] & 0xF;
            ql[l] = (uint8_t)(q1 | (q3 << 4));
            ql[l + 32] = (uint8_t)(q2 | (q4 << 4));
            qh[l] = (uint8_t)((L[j + l] >> 4) | ((L[j + l + 32] >> 4) << 2) |
                              ((L[j + l + 64] >> 4) << 4) | ((L[j + l + 96] >> 4) << 6));
        }
        ql += 64;
        qh += 32;
    }
}

int64_t go_quantize_k_block_bytes(int type) {
    switch (type) {
        case GO_QK_Q4_K: return 144;
        case GO_QK_Q5_K: return 176;
        case GO_QK_Q6_K: return 210;
        default: return 0;
    }
}

void go_quantize_k_rows(int type, int64_t r0, int64_t r1, int64_t ncols, const float *src,
                        uint8_t *dst) {
    const int64_t nb = ncols / QK_K, block_bytes = go_quantize_k_block_bytes(type);
    void (*block)(const float *, uint8_t *) =
        type == GO_QK_Q4_K ? quantize_block_q4_k
        : type == GO_QK_Q5_K ? quantize_block_q5_k : quantize_block_q6_k;
    for (int64_t r = r0; r < r1; ++r)
        for (int64_t i = 0; i < nb; ++i)
            block(src + r * ncols + i * QK_K, dst + (r * nb + i) * block_bytes);
}

/* Activations rounded to Q8_0 blocks as llama.cpp's x86 code rounds them
 * (quantize_row_q8_0 / q8_1 on AVX, AVX2 and AVX-512; NEON's rounds as well,
 * ggml's scalar _ref halves away from zero): per 32 values d = amax / 127,
 * each quant x * (127 / amax) rounded to the nearest integer, halves to even,
 * and the scale as the f16 the block stores (what the integer dot products
 * multiply by).  sums (when wanted) gets Q8_1's s, f16(d * the block's sum of
 * quants) with d unrounded, which a Q4_1 or Q5_1 block's m multiplies.  A
 * block holding a non-finite value gets a NaN scale and sum and zero quants:
 * its products are NaN, as the float product's would be non-finite, and no NaN
 * is converted to an integer. */
void go_quantize_q8_0_row(const float *x, int64_t n, int8_t *qs, float *scales, float *sums) {
    for (int64_t i = 0; i < n / 32; ++i) {
        const float *v = x + i * 32;
        float amax = 0.0f;
        int finite = 1;
        for (int j = 0; j < 32; ++j) {
            const float a = fabsf(v[j]);
            if (!(a <= FLT_MAX)) finite = 0;
            else if (a > amax) amax = a;
        }
        const float d = amax / 127.0f;
        const float id = amax != 0.0f ? 127.0f / amax : 0.0f;
        scales[i] = finite ? f16_to_f32(f32_to_f16(d)) : NAN;
        int32_t sum = 0;
        for (int j = 0; j < 32; ++j) {
            /* nearbyintf: the current rounding mode, to nearest with ties to even */
            qs[i * 32 + j] = finite ? (int8_t)nearbyintf(v[j] * id) : 0;
            sum += qs[i * 32 + j];
        }
        if (sums) sums[i] = finite ? f16_to_f32(f32_to_f16(d * (float)sum)) : NAN;
    }
}

/* ggml's quantize_row_q8_K_ref: per 256 values the one of largest magnitude,
 * max (the first such, with its sign), iscale = -127 / max, each quant
 * nearest(iscale * x) (at most 127), the scale 1 / iscale.  A block of zeros
 * gets a zero scale; a block holding a non-finite value a NaN scale and zero
 * quants (no NaN is converted to an integer). */
void go_quantize_q8_k_row(const float *x, int64_t n, int8_t *qs, float *scales, int16_t *sums) {
    for (int64_t i = 0; i < n / 256; ++i) {
        const float *v = x + i * 256;
        int8_t *q = qs + i * 256;
        float max = 0.0f, amax = 0.0f;
        int finite = 1;
        for (int j = 0; j < 256; ++j) {
            const float a = fabsf(v[j]);
            if (!(a <= FLT_MAX)) finite = 0;
            else if (a > amax) {
                amax = a;
                max = v[j];
            }
        }
        if (!finite || amax == 0.0f) {
            memset(q, 0, 256);
            scales[i] = finite ? 0.0f : NAN;
        } else {
            const float iscale = -127.0f / max;
            for (int j = 0; j < 256; ++j) {
                const int r = nearest_int(iscale * v[j]);
                q[j] = (int8_t)(r < 127 ? r : 127);
            }
            scales[i] = 1.0f / iscale;
        }
        for (int j = 0; j < 16; ++j) {
            int32_t sum = 0;
            for (int l = 0; l < 16; ++l) sum += q[16 * j + l];
            sums[i * 16 + j] = (int16_t)sum;
        }
    }
}
