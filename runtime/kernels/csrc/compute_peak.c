/* The best rate of the 8-bit products the many-row kernels are built on, at this build's level: the compute
 * ceiling the prefill benchmarks set their figures against (tests/bench/roofline.py), as the read bandwidth
 * is the decode's. Each thread multiplies registers only, in independent chains, with the level's instructions
 * for 8-bit codes times 8-bit activations: `avx512` one VNNI vpdpbusd per 64 products into 32-bit sums (zmm),
 * `avx2` vpmaddubsw + vpaddw per 32 into 16-bit sums (ymm; the AVX2 tiles' cheapest form, which their 4-bit
 * codes take: 8-bit codes need a vpmaddwd and a vpaddd more, as llama.cpp's AVX2 path does), `generic` plain
 * C. Returns the products computed (what the caller divides by its wall time). */
#include <omp.h>
#include <stdint.h>

#include "kernels.h"

#if defined(__AVX512VNNI__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#define CHAINS 8 /* independent sums a thread keeps (the VNNI loop) */

static int64_t peak_thread(int64_t iters, int seed, int32_t *sink) {
#if defined(__AVX512VNNI__)
    __m512i w = _mm512_set1_epi8((char)(3 + seed)), x = _mm512_set1_epi8(5);
    __m512i a0 = _mm512_setzero_si512(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
    for (int64_t i = 0; i < iters; i++) {
        __asm__("" : "+v"(w), "+v"(x)); /* opaque operands: the compiler can neither hoist nor fold a product */
        a0 = _mm512_dpbusd_epi32(a0, w, x), a1 = _mm512_dpbusd_epi32(a1, w, x);
        a2 = _mm512_dpbusd_epi32(a2, w, x), a3 = _mm512_dpbusd_epi32(a3, w, x);
        a4 = _mm512_dpbusd_epi32(a4, w, x), a5 = _mm512_dpbusd_epi32(a5, w, x);
        a6 = _mm512_dpbusd_epi32(a6, w, x), a7 = _mm512_dpbusd_epi32(a7, w, x);
        /* and opaque sums: equal chains would otherwise be merged into one */
        __asm__("" : "+v"(a0), "+v"(a1), "+v"(a2), "+v"(a3), "+v"(a4), "+v"(a5), "+v"(a6), "+v"(a7));
    }
    const __m512i s = _mm512_add_epi32(_mm512_add_epi32(_mm512_add_epi32(a0, a1), _mm512_add_epi32(a2, a3)),
                                       _mm512_add_epi32(_mm512_add_epi32(a4, a5), _mm512_add_epi32(a6, a7)));
    *sink = _mm512_reduce_add_epi32(s);
    return iters * CHAINS * 64;
#elif defined(__AVX2__)
    /* six distinct products a round (two w by three x), so that none serves two chains; six chains and five
     * operands keep to AVX2's 16 registers (more spill, and the spills set the pace) */
    __m256i w0 = _mm256_set1_epi8((char)(3 + seed)), w1 = _mm256_set1_epi8(7), x0 = _mm256_set1_epi8(5),
            x1 = _mm256_set1_epi8(6), x2 = _mm256_set1_epi8(9);
    __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0;
#define STEP(a, w, x) a = _mm256_add_epi16(a, _mm256_maddubs_epi16(w, x))
    for (int64_t i = 0; i < iters; i++) {
        __asm__("" : "+x"(w0), "+x"(w1), "+x"(x0), "+x"(x1), "+x"(x2)); /* opaque operands */
        STEP(a0, w0, x0), STEP(a1, w0, x1), STEP(a2, w0, x2), STEP(a3, w1, x0), STEP(a4, w1, x1), STEP(a5, w1, x2);
    }
#undef STEP
    const __m256i s = _mm256_add_epi16(_mm256_add_epi16(_mm256_add_epi16(a0, a1), _mm256_add_epi16(a2, a3)),
                                       _mm256_add_epi16(a4, a5));
    int32_t lanes[8];
    _mm256_storeu_si256((__m256i *)lanes, s);
    *sink = lanes[0] + lanes[7];
    return iters * 6 * 32;
#else
    /* the portable kernels' form: 8-bit rows multiplied into 32-bit sums in loops the compiler vectorizes */
    int8_t w[64], x[64];
    int32_t a[64] = {0};
    for (int j = 0; j < 64; j++) w[j] = (int8_t)(3 + seed + j % 5), x[j] = (int8_t)(5 + j % 3);
    for (int64_t i = 0; i < iters; i++) {
        __asm__("" : : "r"(w), "r"(x) : "memory"); /* the rows read anew: nothing hoisted or folded */
        for (int j = 0; j < 64; j++) a[j] += w[j] * x[j];
    }
    int32_t s = 0;
    for (int j = 0; j < 64; j++) s += a[j];
    *sink = s;
    return iters * 64;
#endif
}

/* where the sums go, so that no chain's work is dead code */
static volatile int32_t peak_sums;

int64_t int8_dot_peak(int64_t iters, int num_threads) {
    int64_t total = 0;
    int32_t sink = 0;
    _Pragma("omp parallel num_threads(num_threads) reduction(+ : total, sink)")
    {
        int32_t s;
        total += peak_thread(iters, omp_get_thread_num() & 1, &s);
        sink += s;
    }
    peak_sums = sink;
    return total;
}
