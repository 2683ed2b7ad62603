/* SIMD mapping for x86-64 with AVX-512 F/BW/DQ/VL, FMA and F16C: 16 floats a
 * register.  The same algorithms as simd/avx2.h, lane for lane; comparisons go
 * to mask registers, which also make partial loads and stores single masked
 * instructions (no mask table, no blend). */
#ifndef GGMLOPT_SIMD_AVX512_H
#define GGMLOPT_SIMD_AVX512_H

#include <immintrin.h>
#include "simd/scalar_math.h"

#define GO_FN(name) name##_avx512
#define GO_EPR 16

typedef __m512 go_vf;
typedef struct { __m512d lo, hi; } go_dacc;

#define go_vload(p) _mm512_loadu_ps(p)
#define go_vstore(p, v) _mm512_storeu_ps((p), (v))
/* a store around the caches (p on a whole vector's alignment): go_vstream_done()
 * after the last, before another thread reads what they wrote */
#define go_vstream(p, v) _mm512_stream_ps((p), (v))
#define go_vstream_done() _mm_sfence()
#define go_vset1(x) _mm512_set1_ps(x)
#define go_vadd(a, b) _mm512_add_ps((a), (b))
#define go_vsub(a, b) _mm512_sub_ps((a), (b))
#define go_vmul(a, b) _mm512_mul_ps((a), (b))
#define go_vdiv(a, b) _mm512_div_ps((a), (b))
#define go_vfma(a, b, c) _mm512_fmadd_ps((a), (b), (c))
#define go_vsqrt(a) _mm512_sqrt_ps(a)
/* 1/a within 1 ulp: the 14-bit estimate and one Newton step (see avx2.h: the
 * divide unit is shared with the square root) */
static inline __m512 go_vrecip(__m512 a) {
    const __m512 r = _mm512_rcp14_ps(a);
    return _mm512_mul_ps(r, _mm512_fnmadd_ps(a, r, _mm512_set1_ps(2.0f)));
}
/* vmaxps returns its second operand when either is NaN: a NaN in a yields b */
#define go_vmax(a, b) _mm512_max_ps((a), (b))
/* x > 0 ? x : 0 with NaN kept, -0 made +0 (as avx2.h) */
#define go_vrelu(x) \
    _mm512_add_ps(_mm512_max_ps(_mm512_setzero_ps(), (x)), _mm512_setzero_ps())
/* b where a != 0 (NaN counts as nonzero), else 0 */
#define go_vmask_nonzero(a, b) \
    _mm512_maskz_mov_ps(_mm512_cmp_ps_mask((a), _mm512_setzero_ps(), _CMP_NEQ_UQ), (b))
#define go_vany_eq(v, s) (_mm512_cmp_ps_mask((v), (s), _CMP_EQ_OQ) != 0)
/* index of the last lane of v equal to s, -1 for none */
static inline int go_vlast_eq(__m512 v, __m512 s) {
    const unsigned m = (unsigned)_mm512_cmp_ps_mask(v, s, _CMP_EQ_OQ);
    return m ? 31 - __builtin_clz(m) : -1;
}

/* the two 8-float halves of v, widened to double */
#define GO_LO_PD(v) _mm512_cvtps_pd(_mm512_castps512_ps256(v))
#define GO_HI_PD(v) _mm512_cvtps_pd(_mm512_extractf32x8_ps((v), 1))

static inline double go_reduce_pd(__m512d d) {
    const __m256d q = _mm256_add_pd(_mm512_castpd512_pd256(d), _mm512_extractf64x4_pd(d, 1));
    const __m128d s = _mm_add_pd(_mm256_castpd256_pd128(q), _mm256_extractf128_pd(q, 1));
    return _mm_cvtsd_f64(_mm_add_sd(s, _mm_unpackhi_pd(s, s)));
}

static inline double go_vreduce_add(__m512 v) {
    return go_reduce_pd(_mm512_add_pd(GO_LO_PD(v), GO_HI_PD(v)));
}

static inline float go_vreduce_max(__m512 v) {
    const __m256 h = _mm256_max_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1));
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_shuffle_ps(m, m, 1));
    return _mm_cvtss_f32(m);
}

static inline go_dacc go_dacc_zero(void) {
    go_dacc a = {_mm512_setzero_pd(), _mm512_setzero_pd()};
    return a;
}
static inline go_dacc go_dacc_add(go_dacc acc, __m512 v) {
    acc.lo = _mm512_add_pd(acc.lo, GO_LO_PD(v));
    acc.hi = _mm512_add_pd(acc.hi, GO_HI_PD(v));
    return acc;
}
static inline go_dacc go_dacc_add_sq(go_dacc acc, __m512 v) {
    const __m512d lo = GO_LO_PD(v), hi = GO_HI_PD(v);
    acc.lo = _mm512_fmadd_pd(lo, lo, acc.lo);
    acc.hi = _mm512_fmadd_pd(hi, hi, acc.hi);
    return acc;
}
static inline double go_dacc_reduce(go_dacc acc) { return go_reduce_pd(_mm512_add_pd(acc.lo, acc.hi)); }

/* exp(r) for a reduced argument r (about ln2/2 at most): 1 + r + r^2 * P(r), the
 * polynomial both exponentials below share */
static inline __m512 go_vexp_poly(__m512 r) {
    __m512 p = _mm512_set1_ps(GO_EXP_P0);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(GO_EXP_P1));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(GO_EXP_P2));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(GO_EXP_P3));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(GO_EXP_P4));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(GO_EXP_P5));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return p;
}

/* exp(x) for x <= 0 (see simd/avx2.h): go_expf_scalar's polynomial, 16 lanes,
 * n read from the low bits of x*log2(e) + 1.5*2^23.  Lanes below GO_EXP_LO (and
 * -inf) give 0; NaN stays NaN. */
static inline __m512 go_vexp_nonpos(__m512 x) {
    /* NaN lanes compare false: kept */
    const __mmask16 keep = _mm512_cmp_ps_mask(x, _mm512_set1_ps(GO_EXP_LO), _CMP_NLT_UQ);
    const __m512 t = _mm512_fmadd_ps(x, _mm512_set1_ps(GO_EXP_LOG2E), _mm512_set1_ps(GO_ROUND_MAGIC));
    const __m512 n = _mm512_sub_ps(t, _mm512_set1_ps(GO_ROUND_MAGIC));
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(GO_EXP_C1), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(GO_EXP_C2), r);
    const __m512 p = go_vexp_poly(r);
    /* bits(t) = bits(1.5*2^23) + n, so (bits(t) - bits(1.5*2^23) + 127) << 23 is 2^n */
    const __m512 pow2n = _mm512_castsi512_ps(_mm512_slli_epi32(
        _mm512_add_epi32(_mm512_castps_si512(t), _mm512_set1_epi32(127 - GO_ROUND_MAGIC_BITS)), 23));
    return _mm512_maskz_mul_ps(keep, p, pow2n);
}

/* The first n (0 < n < 16) lanes of p, the others set to fill; masked-off lanes
 * are neither read nor written, so nothing past p + n is touched. */
#define GO_LANES(n) ((__mmask16)((1u << (unsigned)(n)) - 1u))
#define go_vload_partial(p, n, fill) _mm512_mask_loadu_ps(_mm512_set1_ps(fill), GO_LANES(n), (p))
#define go_vstore_partial(p, v, n) _mm512_mask_storeu_ps((p), GO_LANES(n), (v))

/* lanes p[idx[0]], ..., p[idx[15]] for 16 int32 offsets */
#define go_vgather(p, idx) \
    _mm512_i32gather_ps(_mm512_loadu_si512((const void *)(idx)), (p), 4)

/* r[0..15] transposed in place (lane j of r[i] <-> lane i of r[j]): pairs, then
 * pairs of pairs, then 128-bit lanes twice; 64 shuffles for 256 values, where
 * a gather per row of a transposed panel costs 16 loads (kernels/gemm.inc) */
static inline void go_vtranspose(__m512 r[16]) {
    __m512 t[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {
        r[i] = _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(t[i]), _mm512_castps_pd(t[i + 2])));
        r[i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(t[i]), _mm512_castps_pd(t[i + 2])));
        r[i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(t[i + 1]), _mm512_castps_pd(t[i + 3])));
        r[i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(t[i + 1]), _mm512_castps_pd(t[i + 3])));
    }
    for (int i = 0; i < 4; ++i) {
        t[i] = _mm512_shuffle_f32x4(r[i], r[i + 4], 0x88);
        t[i + 4] = _mm512_shuffle_f32x4(r[i], r[i + 4], 0xdd);
        t[i + 8] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0x88);
        t[i + 12] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0xdd);
    }
    for (int i = 0; i < 8; ++i) {
        r[i] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0x88);
        r[i + 8] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0xdd);
    }
}

static inline __m512 go_vload_u8(const uint8_t *p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p)));
}
static inline __m512 go_vload_i8(const int8_t *p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
}
#include "simd/x86_bytes.h"
#include "simd/x86_int8.h"
/* v + 16 in the lanes whose bit (j0 + lane) of x is set: one masked add */
static inline __m512 go_vadd16_bits(__m512 v, uint32_t x, int j0) {
    return _mm512_mask_add_ps(v, (__mmask16)(x >> j0), v, _mm512_set1_ps(16.0f));
}
static inline __m512 go_vload_f16(const uint16_t *p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
}
/* bfloat16 is float32's upper half: widen, shift into place */
static inline __m512 go_vload_bf16(const uint16_t *p) {
    const __m512i u = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(u, 16));
}

/* bfloat16 pairs (kernels/gemm_bf16.inc): each lane holds two bf16 values, the
 * even one in its low half; a pair vector from 16 values of each of two rows,
 * and each half of a pair vector as float32 */
static inline __m512 go_vpair_bf16(const uint16_t *even, const uint16_t *odd) {
    const __m512i lo = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)even));
    const __m512i hi = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)odd));
    return _mm512_castsi512_ps(_mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
}
/* the pairs of 32 consecutive bf16 values of one row (p[2i], p[2i + 1] in lane i) */
static inline __m512 go_vload_bf16_pairs(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_loadu_si512((const void *)p));
}
static inline __m512 go_vbf16_even(__m512 v) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_castps_si512(v), 16));
}
static inline __m512 go_vbf16_odd(__m512 v) {
    return _mm512_castsi512_ps(
        _mm512_and_si512(_mm512_castps_si512(v), _mm512_set1_epi32((int)0xffff0000u)));
}

/* 16 floats to bfloat16 bits at p, as go_f32_to_bf16 rounds each (integer
 * arithmetic: vcvtneps2bf16 would flush subnormals and needs AVX512-BF16). */
static inline void go_vstore_bf16(uint16_t *p, __m512 v) {
    const __m512i u = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
    const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    r = _mm512_mask_or_epi32(r, nan, u, _mm512_set1_epi32(0x400000));
    _mm256_storeu_si256((__m256i *)p, _mm512_cvtepi32_epi16(_mm512_srli_epi32(r, 16)));
}

/* Equal entries among 16 int32 pairs. */
static inline int64_t go_count_eq_i32(const int32_t *a, const int32_t *b) {
    const __mmask16 eq = _mm512_cmpeq_epi32_mask(_mm512_loadu_si512((const void *)a),
                                                 _mm512_loadu_si512((const void *)b));
    return __builtin_popcount((unsigned)eq);
}

/* ---- for the activations (simd/vmath.h) ---- */

/* exp(x + lo) for x <= 0, |lo| <= 4: go_exp_sum_scalar's algorithm, 16 lanes */
static inline __m512 go_vexp_sum(__m512 x, __m512 lo) {
    /* vmaxps returns its second operand for a NaN: NaN lanes of x stay NaN */
    x = _mm512_max_ps(_mm512_set1_ps(GO_EXPS_MIN), x);
    const __m512 t = _mm512_fmadd_ps(_mm512_add_ps(x, lo), _mm512_set1_ps(GO_EXP_LOG2E),
                                     _mm512_set1_ps(GO_ROUND_MAGIC));
    const __m512 n = _mm512_sub_ps(t, _mm512_set1_ps(GO_ROUND_MAGIC));
    __m512 r = _mm512_add_ps(_mm512_fnmadd_ps(n, _mm512_set1_ps(GO_EXP_C1), x), lo);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(GO_EXP_C2), r);
    const __m512 p = go_vexp_poly(r);
    const __m512i ni = _mm512_sub_epi32(_mm512_castps_si512(t), _mm512_set1_epi32(GO_ROUND_MAGIC_BITS));
    const __m512i n1 = _mm512_srai_epi32(ni, 1);
    const __m512i n2 = _mm512_sub_epi32(ni, n1);
    const __m512i bias = _mm512_set1_epi32(127);
    const __m512 s1 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(n1, bias), 23));
    const __m512 s2 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(n2, bias), 23));
    return _mm512_mul_ps(_mm512_mul_ps(p, s1), s2);
}
#define go_vsplit_hi(x) \
    _mm512_and_ps((x), _mm512_castsi512_ps(_mm512_set1_epi32((int)0xFFFFF000u)))
#define go_vabs(x) _mm512_abs_ps(x)
/* |mag| with the sign bit of s: one bitwise select (vpternlogd a, b, c with
 * 0xD8 = c ? b : a bit by bit, c the sign mask) */
#define go_vcopysign(mag, s)                                                          \
    _mm512_castsi512_ps(_mm512_ternarylogic_epi32(                                    \
        _mm512_castps_si512(mag), _mm512_castps_si512(s), _mm512_set1_epi32(INT32_MIN), 0xD8))
/* vmaxps/vminps return the second operand for a NaN: x last keeps NaN lanes */
#define go_vclamp(x, lo, hi) _mm512_min_ps((hi), _mm512_max_ps((lo), (x)))
#define go_vsel_lt(a, b, x, y) \
    _mm512_mask_blend_ps(_mm512_cmp_ps_mask((a), (b), _CMP_LT_OQ), (y), (x))

/* even = p[0], p[2], ..., p[30], odd = p[1], ..., p[31]: the 32 floats at p split
 * by parity, each a two-source permute of the two loads */
#define GO_HAS_LOAD_PAIRS 1
static inline void go_vload_pairs(const float *p, __m512 *even, __m512 *odd) {
    const __m512 a = _mm512_loadu_ps(p), b = _mm512_loadu_ps(p + 16);
    const __m512i ie = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26,
                                         28, 30);
    *even = _mm512_permutex2var_ps(a, ie, b);
    *odd = _mm512_permutex2var_ps(a, _mm512_add_epi32(ie, _mm512_set1_epi32(1)), b);
}

#endif
