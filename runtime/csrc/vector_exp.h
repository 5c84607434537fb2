/* What the C kernels share for 16 floats at a time (GCC vector extensions: AVX-512, two AVX2 halves, or NEON):
 * the vector types, a horizontal sum and exp. */
#ifndef PRESCIENT_VECTOR_EXP_H
#define PRESCIENT_VECTOR_EXP_H

#include <stdint.h>

#define W 16

typedef float vf __attribute__((vector_size(4 * W), aligned(4)));
typedef int32_t vi __attribute__((vector_size(4 * W), aligned(4)));
typedef uint32_t vu __attribute__((vector_size(4 * W), aligned(4)));

static inline float hsum(vf v) {
    float s = 0.f;
    for (int i = 0; i < W; i++) s += v[i];
    return s;
}

/* exp(x), x clamped to [-87, 88]: 2^n e^f with n = round(x / ln 2), |f| <= ln 2 / 2, e^f by its Taylor
 * polynomial to degree 7; relative error ~1e-7 (the float32 path's tests allow 1e-5). */
static inline vf vexp(vf x) {
    const vf lo = (vf){0} - 87.f, hi = (vf){0} + 88.f;
    const vi under = x < lo, over = x > hi;
    x = (vf)((under & (vi)lo) | (over & (vi)hi) | (~(under | over) & (vi)x));
    const vf shifter = (vf){0} + 12582912.f; /* 1.5 x 2^23: adding it rounds to an integer */
    const vf r = x * 1.44269504088896341f + shifter;
    const vi n = (vi)r - (vi)shifter;
    const vf f = x - (r - shifter) * 0.69314718055994531f;
    vf p = (vf){0} + 1.f / 5040.f;
    p = p * f + 1.f / 720.f;
    p = p * f + 1.f / 120.f;
    p = p * f + 1.f / 24.f;
    p = p * f + 1.f / 6.f;
    p = p * f + 0.5f;
    p = p * f + 1.f;
    p = p * f + 1.f;
    return p * (vf)((n + 127) << 23);
}

#endif
