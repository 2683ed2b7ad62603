/* A super-block's (or half's) 8 integer scales for the scalar and NEON
 * mappings, which take each by index (simd/x86_int8.h keeps them in a vector):
 * from 8 signed bytes less bias, or from 8 bytes' low nibbles. */
#ifndef GGMLOPT_SIMD_K_SCALES_H
#define GGMLOPT_SIMD_K_SCALES_H

#include <stdint.h>

typedef struct {
    int s[8];
} go_ksc;
static inline go_ksc go_ksc_i8(const int8_t *sc, int bias) {
    go_ksc k;
    for (int i = 0; i < 8; ++i) k.s[i] = sc[i] - bias;
    return k;
}
static inline go_ksc go_ksc_low_nibbles(const uint8_t *b) {
    go_ksc k;
    for (int i = 0; i < 8; ++i) k.s[i] = b[i] & 15;
    return k;
}

#endif
