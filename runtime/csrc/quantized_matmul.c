/* y = x W^T for W in GGUF-style blocks of 32 (4-bit or 8-bit codes, a scale and an offset per block),
 * with the activations quantized to 8 bits per block of 32 on the way in (as llama.cpp does for its
 * Q4/Q8 dot products): the inner products run on integers, 64 at a time with AVX-512 VNNI.
 *
 * Weights, prepared once at load (runtime/native_matmul.py):
 *   codes  4-bit: [N, K/2] bytes; the 32 bytes of block pair p hold block 2p's element i in the low
 *                 nibble of byte i and block 2p+1's element i in the high nibble (values 0..15).
 *          8-bit: [N, K] bytes, code + 128 (values 0..255).
 *   scale  [N, K/32] float16: the block's step d.
 *   offset [N, K/32] float16: o such that the block's weights are w_j = d * c_j + o (c_j the stored code).
 *   (float16, as the GGUF stores them: decode is bound by reading weights, so bytes count.)
 * Activations x [M, K] (float32 or bfloat16) become xq (int8) and dx per block of 32 (xq = round(x / dx),
 * dx = max|x| / 127), so that per block
 *   sum_j w_j x_j ~= d * dx * sum_j c_j xq_j + o * (dx * sum_j xq_j).
 * out [M, N] float32 or bfloat16. Requires K % 64 == 0. `portable`: the plain C loops even where AVX-512
 * VNNI is compiled in (the tests check both compute one function).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#include <immintrin.h>
#define QMM_VNNI 1
#else
#define QMM_VNNI 0
#endif

#define QBLOCK 32
#define ROW_TILE 16

static inline float bf16_to_f32(uint16_t v) {
    uint32_t bits = (uint32_t)v << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

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

static inline uint16_t f32_to_bf16(float f) {
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x40); /* NaN stays NaN */
    bits += 0x7fffu + ((bits >> 16) & 1u); /* round to nearest even */
    return (uint16_t)(bits >> 16);
}

/* One row of activations into int8 blocks: xq [K], dx [K/32], sx [K/32] = dx * sum(xq). */
static void quantize_row(const void *x, int x_bf16, int64_t K, int8_t *xq, float *dx, float *sx) {
    float buf[QBLOCK];
    for (int64_t b = 0; b < K / QBLOCK; b++) {
        float amax = 0.f;
        for (int j = 0; j < QBLOCK; j++) {
            const int64_t k = b * QBLOCK + j;
            buf[j] = x_bf16 ? bf16_to_f32(((const uint16_t *)x)[k]) : ((const float *)x)[k];
            const float a = fabsf(buf[j]);
            amax = a > amax ? a : amax;
        }
        const float d = amax / 127.f, inv = d > 0.f ? 1.f / d : 0.f;
        int sum = 0;
        for (int j = 0; j < QBLOCK; j++) {
            const int q = (int)nearbyintf(buf[j] * inv);
            xq[b * QBLOCK + j] = (int8_t)q;
            sum += q;
        }
        dx[b] = d;
        sx[b] = d * (float)sum;
    }
}

/* One weight row against one activation row: sum over blocks of
 * d * dx * (codes . xq) + offset * (dx * sum xq), in portable C. */
static float row_dot_portable(const uint8_t *codes, const uint16_t *scale, const uint16_t *offset,
                              const int8_t *xq, const float *dx, const float *sx, int64_t K, int bits) {
    float total = 0.f;
    for (int64_t b = 0; b < K / QBLOCK; b++) {
        int32_t isum = 0;
        const int8_t *xb = xq + b * QBLOCK;
        if (bits == 4) {
            const uint8_t *cb = codes + (b / 2) * 32;
            const int shift = (b & 1) * 4;
            for (int j = 0; j < QBLOCK; j++) isum += (int32_t)((cb[j] >> shift) & 0x0F) * xb[j];
        } else {
            const uint8_t *cb = codes + b * QBLOCK;
            for (int j = 0; j < QBLOCK; j++) isum += (int32_t)cb[j] * xb[j];
        }
        total += f16_to_f32(scale[b]) * dx[b] * (float)isum + f16_to_f32(offset[b]) * sx[b];
    }
    return total;
}

#if QMM_VNNI
/* The same with AVX-512 VNNI: two blocks (64 codes) per integer dot product. ds: K/32 + 16 floats. */
static inline float row_dot_vnni(const uint8_t *codes, const uint16_t *scale, const uint16_t *offset,
                                 const int8_t *xq, const float *dx, const float *sx, int64_t K, int bits,
                                 float *ds) {
    const int64_t nb = K / QBLOCK;
    __m512 acc_o = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b += 16) {
        const __mmask16 mask = nb - b >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (nb - b)) - 1);
        const __m512 d = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, scale + b));
        const __m512 o = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, offset + b));
        _mm512_storeu_ps(ds + b, _mm512_mul_ps(d, _mm512_maskz_loadu_ps(mask, dx + b)));
        acc_o = _mm512_fmadd_ps(o, _mm512_maskz_loadu_ps(mask, sx + b), acc_o);
    }
    const __m512i low4 = _mm512_set1_epi8(0x0F);
    const __m512i pair = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
    __m512 acc = _mm512_setzero_ps();
    for (int64_t p = 0; p < nb / 2; p++) {
        __m512i w;
        if (bits == 4) {
            const __m256i raw = _mm256_loadu_si256((const __m256i *)(codes + p * 32));
            w = _mm512_inserti64x4(_mm512_castsi256_si512(raw), _mm256_srli_epi16(raw, 4), 1);
            w = _mm512_and_si512(w, low4);
        } else {
            w = _mm512_loadu_si512((const void *)(codes + p * 64));
        }
        const __m512i x = _mm512_loadu_si512((const void *)(xq + p * 64));
        const __m512i dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w, x); /* lanes 0-7: block 2p */
        const __m512 sc = _mm512_permutexvar_ps(
            pair, _mm512_castps128_ps512(_mm_castpd_ps(_mm_load_sd((const double *)(ds + 2 * p)))));
        acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), sc, acc);
    }
    return _mm512_reduce_add_ps(acc) + _mm512_reduce_add_ps(acc_o);
}
#endif

void quantized_matmul(const void *x, int x_bf16, int64_t M, int64_t K, const uint8_t *codes,
                      const uint16_t *scale, const uint16_t *offset, int64_t N, int bits, void *out, int out_bf16,
                      int portable, int num_threads) {
    const int64_t nb = K / QBLOCK, row_bytes = bits == 4 ? K / 2 : K;
    int8_t *xq = (int8_t *)malloc((size_t)(M * K));
    float *dx = (float *)malloc(sizeof(float) * (size_t)(M * nb));
    float *sx = (float *)malloc(sizeof(float) * (size_t)(M * nb));
    const size_t elem = x_bf16 ? 2 : 4;
    for (int64_t m = 0; m < M; m++)
        quantize_row((const char *)x + m * K * elem, x_bf16, K, xq + m * K, dx + m * nb, sx + m * nb);
    const int64_t tiles = (N + ROW_TILE - 1) / ROW_TILE;
    _Pragma("omp parallel num_threads(num_threads)")
    {
        float *ds = (float *)malloc(sizeof(float) * (size_t)(nb + 16));
        _Pragma("omp for schedule(static)")
        for (int64_t t = 0; t < tiles; t++) {
            const int64_t n1 = (t + 1) * ROW_TILE < N ? (t + 1) * ROW_TILE : N;
            for (int64_t m = 0; m < M; m++) {
                for (int64_t n = t * ROW_TILE; n < n1; n++) {
                    const uint8_t *cn = codes + n * row_bytes;
                    const uint16_t *sn = scale + n * nb, *on = offset + n * nb;
                    const int8_t *xm = xq + m * K;
                    const float *dxm = dx + m * nb, *sxm = sx + m * nb;
                    float y;
#if QMM_VNNI
                    if (!portable)
                        y = row_dot_vnni(cn, sn, on, xm, dxm, sxm, K, bits, ds);
                    else
#endif
                        y = row_dot_portable(cn, sn, on, xm, dxm, sxm, K, bits);
                    if (out_bf16)
                        ((uint16_t *)out)[m * N + n] = f32_to_bf16(y);
                    else
                        ((float *)out)[m * N + n] = y;
                }
            }
        }
        free(ds);
    }
    free(xq);
    free(dx);
    free(sx);
}

/* 1 when this build multiplies with AVX-512 VNNI, 0 for the portable loops. */
int quantized_matmul_vectorized(void) { return QMM_VNNI; }
