/* What the C kernels share for one register of floats at a time (GCC vector extensions): the vector types, a
 * horizontal sum, exp and log, bfloat16 rounding and SiLU(gate) x up; and how many OpenMP threads a call is
 * worth.
 *
 * W, the lanes of a vector, is the width of the registers the build targets (its -march): 16 with AVX-512,
 * 8 with AVX/AVX2, 4 otherwise (SSE2 on x86-64, NEON on aarch64, or any other target's lowering). A vector type
 * wider than the target's registers is lowered by GCC into register-sized pieces, and the kernels' fully
 * unrolled accumulator arrays then grow past what its register allocator and scheduler handle in reasonable
 * time (paged_attention.c with 16-lane vectors did not compile in 20 minutes at -O3 -march=x86-64-v3).
 * ACC_REGS is how many vector accumulators a kernel may keep live: about three quarters of the registers. */
#ifndef PRESCIENT_VECTOR_EXP_H
#define PRESCIENT_VECTOR_EXP_H

#include <stdint.h>

#if defined(__AVX512F__)
#define W 16
#elif defined(__AVX__)
#define W 8
#else
#define W 4
#endif
#if defined(__AVX512F__) || defined(__aarch64__)
#define ACC_REGS 24 /* 32 vector registers */
#else
#define ACC_REGS 12 /* 16 vector registers */
#endif
/* Below this many elements a call runs on the caller's thread alone; above it the rows are shared over the
 * threads (one row stays on one thread; SiLU x up counts its elements weighted by SILU_COST). Chosen so that a
 * decode step's layer ops at 32 sequences of this model already run on every thread
 * (`python -m tests.bench engine`, decode x32). */
#define PARALLEL_MIN_ELEMS 8192

static inline int threads_for(int64_t elems, int num_threads) {
    return elems >= PARALLEL_MIN_ELEMS && num_threads > 1 ? num_threads : 1;
}

typedef float vf __attribute__((vector_size(4 * W), aligned(4)));
typedef int32_t vi __attribute__((vector_size(4 * W), aligned(4)));
typedef uint32_t vu __attribute__((vector_size(4 * W), aligned(4)));

static inline float hsum(vf v) {
    float s = 0.f;
    for (int i = 0; i < W; i++) s += v[i];
    return s;
}

/* e^f for |f| <= ln 2 by its Taylor polynomial to degree 7 (Horner): the exp kernels' shared core. */
static inline vf vexp_taylor(vf f) {
    vf p = (vf){0} + 1.f / 5040.f;
    p = p * f + 1.f / 720.f;
    p = p * f + 1.f / 120.f;
    p = p * f + 1.f / 24.f;
    p = p * f + 1.f / 6.f;
    p = p * f + 0.5f;
    p = p * f + 1.f;
    p = p * f + 1.f;
    return p;
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
    return vexp_taylor(f) * (vf)((n + 127) << 23);
}

/* log(x) for finite x > 0, W at a time: x = m 2^e with m in [sqrt(1/2), sqrt(2)), log(m) by Cephes' logf
 * polynomial; relative error ~1e-7. */
static inline vf vlog(vf x) {
    const vu bits = (vu)x;
    vi e = (vi)((bits >> 23) & 0xffu) - 126;
    vf m = (vf)((bits & 0x807fffffu) | 0x3f000000u); /* in [0.5, 1) */
    const vi small = m < 0.707106781186547524f;
    e -= small & 1;
    m = (vf)(((vi)(m + m) & small) | ((vi)m & ~small)) - 1.f;
    const vf z = m * m;
    vf y = (vf){0} + 7.0376836292e-2f;
    y = y * m - 1.1514610310e-1f;
    y = y * m + 1.1676998740e-1f;
    y = y * m - 1.2420140846e-1f;
    y = y * m + 1.4249322787e-1f;
    y = y * m - 1.6668057665e-1f;
    y = y * m + 2.0000714765e-1f;
    y = y * m - 2.4999993993e-1f;
    y = y * m + 3.3333331174e-1f;
    y = y * m * z;
    const vf ef = __builtin_convertvector(e, vf);
    y += ef * -2.12194440e-4f;
    y += z * -0.5f;
    return m + y + ef * 0.693359375f;
}

/* W bfloat16 widened to floats, and W floats' top halves narrowed to bfloat16 bits (the caller rounds first).
 * On x86 in intrinsics: with AVX-512 one zero-extend and one narrowing move, where GCC 12 (-march=native on
 * Zen 4, tuned as Zen 3) lowers the generic conversions to two 8-lane extends and an insert, and to a two-table
 * word permute (vpermt2w), which run slower. With AVX2 and SSE2 a zero-extend (or an interleave with zeros) and
 * a shift, and a signed pack of the arithmetically shifted bits (exact: each value fits 16 signed bits). */
typedef uint16_t vh __attribute__((vector_size(2 * W), aligned(2)));
#if defined(__AVX512F__) || defined(__AVX2__) || defined(__SSE2__)
#include <immintrin.h>
#endif
#if defined(__AVX512F__)
static inline vf vload_bf16(const uint16_t *p) {
    return (vf)_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16);
}
static inline void vstore_bf16_bits(uint16_t *p, vu bits) {
    _mm256_storeu_si256((__m256i *)p, _mm512_cvtepi32_epi16(_mm512_srli_epi32((__m512i)bits, 16)));
}
#elif defined(__AVX2__)
static inline vf vload_bf16(const uint16_t *p) {
    return (vf)_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16);
}
static inline void vstore_bf16_bits(uint16_t *p, vu bits) {
    const __m256i high = _mm256_srai_epi32((__m256i)bits, 16);
    _mm_storeu_si128((__m128i *)p, _mm_packs_epi32(_mm256_castsi256_si128(high), _mm256_extracti128_si256(high, 1)));
}
#elif defined(__SSE2__) && W == 4
static inline vf vload_bf16(const uint16_t *p) {
    return (vf)_mm_unpacklo_epi16(_mm_setzero_si128(), _mm_loadl_epi64((const __m128i *)p));
}
static inline void vstore_bf16_bits(uint16_t *p, vu bits) {
    const __m128i high = _mm_srai_epi32((__m128i)bits, 16);
    _mm_storel_epi64((__m128i *)p, _mm_packs_epi32(high, high));
}
#else
static inline vf vload_bf16(const uint16_t *p) { return (vf)(__builtin_convertvector(*(const vh *)p, vu) << 16); }
static inline void vstore_bf16_bits(uint16_t *p, vu bits) { *(vh *)p = __builtin_convertvector(bits >> 16, vh); }
#endif

/* round to nearest even bfloat16 (NaN kept), as a float */
static inline vf vround_bf16(vf f) {
    vu bits = (vu)f;
    vi nan = (vi)((bits & 0x7fffffffu) > 0x7f800000u);
    vu r = (bits + 0x7fffu + ((bits >> 16) & 1u)) & 0xffff0000u;
    return (vf)(((vu)nan & bits) | (~(vu)nan & r));
}

/* dtype(silu(gate)) * up, before the caller's rounding of the product (gate and up already in the dtype):
 * the layer ops' silu_mul and the many-row matmul's fused epilogue compute it alike. */
static inline vf vsilu_mul(vf gate, vf up, int bf16) {
    const vf s = gate / (1.f + vexp(-gate));
    return (bf16 ? vround_bf16(s) : s) * up;
}

#endif
