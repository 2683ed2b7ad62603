/* Byte unpacking for the GGUF block decoders on x86-64 (SSE2 and SSSE3's byte
 * shuffle, which every AVX2 CPU has): shared by the AVX2 and AVX-512 mappings,
 * which include it. */
#ifndef GGMLOPT_SIMD_X86_BYTES_H
#define GGMLOPT_SIMD_X86_BYTES_H

#include <emmintrin.h>
#include <stdint.h>
#include <tmmintrin.h>

/* 16 bytes' low and high nibbles into lo[16] and hi[16] (one vector each: a
 * later vector load of them is forwarded from the store) */
static inline void go_nibbles16(const uint8_t *src, uint8_t *lo, uint8_t *hi) {
    const __m128i v = _mm_loadu_si128((const __m128i *)src), m = _mm_set1_epi8(15);
    _mm_storeu_si128((__m128i *)lo, _mm_and_si128(v, m));
    _mm_storeu_si128((__m128i *)hi, _mm_and_si128(_mm_srli_epi16(v, 4), m));
}
/* out[j] = (src[j] >> shift) & mask for 16 bytes (shift < 8: a 16-bit lane's
 * shift leaves each byte's own bits in its low bits) */
static inline void go_bitfield16(const uint8_t *src, int shift, uint8_t mask, uint8_t *out) {
    const __m128i v = _mm_loadu_si128((const __m128i *)src);
    const __m128i s = _mm_srl_epi16(v, _mm_cvtsi32_si128(shift));
    _mm_storeu_si128((__m128i *)out, _mm_and_si128(s, _mm_set1_epi8((char)mask)));
}

/* out[j] = lo[j] + 16 hi[j] - off for 16 bytes (hi[j] < 16): a value's bits
 * merged before its one conversion to float (Q5_K, Q6_K) */
static inline void go_merge16(const uint8_t *lo, const uint8_t *hi, int8_t off, int8_t *out) {
    const __m128i h = _mm_slli_epi16(_mm_loadu_si128((const __m128i *)hi), 4);
    const __m128i v = _mm_or_si128(_mm_loadu_si128((const __m128i *)lo), h);
    _mm_storeu_si128((__m128i *)out, _mm_sub_epi8(v, _mm_set1_epi8(off)));
}

/* out[j] = lo[j] + 4 hi[j] - off for 16 bytes (hi[j] < 64): Q3_K's two low bits
 * and its third */
static inline void go_merge16_2(const uint8_t *lo, const uint8_t *hi, int8_t off, int8_t *out) {
    const __m128i h = _mm_slli_epi16(_mm_loadu_si128((const __m128i *)hi), 2);
    const __m128i v = _mm_or_si128(_mm_loadu_si128((const __m128i *)lo), h);
    _mm_storeu_si128((__m128i *)out, _mm_sub_epi8(v, _mm_set1_epi8(off)));
}
/* lo[j] = grid[src[j] & 15], hi[j] = grid[src[j] >> 4] for 16 bytes: a 16-entry
 * table looked up by each nibble (IQ4_NL's and IQ4_XS's non-linear values), one
 * byte shuffle a vector */
static inline void go_grid16(const uint8_t *src, const int8_t *grid, int8_t *lo, int8_t *hi) {
    const __m128i t = _mm_loadu_si128((const __m128i *)grid), m = _mm_set1_epi8(15);
    const __m128i v = _mm_loadu_si128((const __m128i *)src);
    _mm_storeu_si128((__m128i *)lo, _mm_shuffle_epi8(t, _mm_and_si128(v, m)));
    _mm_storeu_si128((__m128i *)hi, _mm_shuffle_epi8(t, _mm_and_si128(_mm_srli_epi16(v, 4), m)));
}

#endif
