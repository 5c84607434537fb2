/* One bfloat16 value to float and back (round to nearest even, as torch's conversion; a NaN stays a NaN). */
#ifndef PRESCIENT_BF16_H
#define PRESCIENT_BF16_H

#include <stdint.h>
#include <string.h>

static inline float bf16_to_f32(uint16_t v) {
    uint32_t bits = (uint32_t)v << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline uint16_t f32_to_bf16(float f) {
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x40); /* NaN stays NaN */
    bits += 0x7fffu + ((bits >> 16) & 1u);                                             /* to nearest even */
    return (uint16_t)(bits >> 16);
}

#endif
