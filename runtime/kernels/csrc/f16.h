/* One float16 value to float and back (round to nearest even, as numpy's astype and torch's conversion;
 * infinities and NaNs kept). */
#ifndef PRESCIENT_F16_H
#define PRESCIENT_F16_H

#include <stdint.h>
#include <string.h>

static inline float f16_to_f32(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, mant = h & 0x3ff;
    uint32_t bits;
    if (exp == 0x1f) {
        bits = sign | 0x7f800000u | (mant << 13);
    } else if (exp != 0) {
        bits = sign | ((exp + 112) << 23) | (mant << 13);
    } else if (mant == 0) {
        bits = sign;
    } else { /* subnormal: m * 2^-24 */
        const float f = (float)mant * 5.9604644775390625e-8f;
        memcpy(&bits, &f, sizeof bits);
        bits |= sign;
    }
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* float32 to float16, to nearest even (as numpy's astype and torch's conversion), infinities and NaNs kept */
static inline uint16_t f32_to_f16(float f) {
    uint32_t x;
    memcpy(&x, &f, sizeof x);
    const uint16_t sign = (uint16_t)((x >> 16) & 0x8000);
    const uint32_t ax = x & 0x7fffffffu;
    if (ax > 0x7f800000u) return sign | 0x7e00 | (uint16_t)((ax >> 13) & 0x3ff);
    if (ax >= 0x477ff000u) return sign | 0x7c00; /* 65520 and up round to infinity */
    if (ax < 0x38800000u) {                      /* below 2^-14: a subnormal, m 2^-24 */
        float v;
        memcpy(&v, &ax, sizeof v);
        volatile float t = v * 16777216.0f + 8388608.0f; /* the addition rounds to an integer, to nearest even */
        return sign | (uint16_t)(t - 8388608.0f);
    }
    const uint32_t r = ax + 0xfffu + ((ax >> 13) & 1u);
    return sign | (uint16_t)((r - (112u << 23)) >> 13);
}

#endif
