/* y = x W^T for W in GGUF-style blocks of 32 (4-bit or 8-bit codes, a scale and an offset per block),
 * with the activations quantized to 8 bits per block of 32 on the way in (as llama.cpp does for its
 * Q4/Q8 dot products): the inner products run on integers, 64 at a time with AVX-512 VNNI.
 *
 * Weights, prepared once at load (runtime/kernels/quantized_matmul.py):
 *   codes  4-bit: [N, K/2] bytes; the 32 bytes of block pair p hold block 2p's element i in the low
 *                 nibble of byte i and block 2p+1's element i in the high nibble (values 0..15).
 *          8-bit: [N, K] bytes, code + 128 (values 0..255).
 *   scale  [N, K/32] float16: the block's step d.
 *   offset [N, K/32] float16: o such that the block's weights are w_j = d * c_j + o (c_j the stored code).
 *   (float16, as the GGUF stores them: decode is bound by reading weights, so bytes count.)
 * Activations x [M, K] (float32 or bfloat16) become xq (int8) and dx per block of 32 (xq = round(x / dx),
 * dx = max|x| / 127), so that per block
 *   sum_j w_j x_j ~= d * dx * sum_j c_j xq_j + o * (dx * sum_j xq_j).
 * out [M, N] float32 or bfloat16. Requires K % 64 == 0. `portable`: the plain C loops even where vector loops
 * are compiled in (the tests check both compute one function).
 *
 * Vector loops per instruction-set level of the build: AVX-512 VNNI (vpdpbusd: 4 byte products summed into
 * each 32-bit lane), else AVX2 + FMA + F16C (vpmaddubsw: unsigned x signed byte pairs summed into 16 bits,
 * then vpmaddwd into 32; the 8-bit codes, unsigned here, are multiplied as signed code - 128 with its
 * magnitude and the activation's sign moved over (vpsignb), so no pair sum can saturate, and 128 x the block's
 * activation sum is added back), else none. The integer inner products are exact at every level, so every
 * level computes one function; the levels differ only in the order of the float sums over blocks.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "check.h"
#include "f16.h"
#include "kernels.h"
#include "vector_exp.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#include <immintrin.h>
#define QMM_VNNI 1
#define QMM_AVX2 0
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define QMM_VNNI 0
#define QMM_AVX2 1
#else
#define QMM_VNNI 0
#define QMM_AVX2 0
#endif

#define QBLOCK 32
#define ROW_TILE 16

/* One row of activations into int8 blocks: xq [K], dx [K/32], sx [K/32] = dx * sum(xq), xs [K/32] = sum(xq).
 * A NaN in a block makes its d NaN (and its codes 0), so that it reaches every output of the row, as in a
 * float matmul. */
static void quantize_row_portable(const void *x, int x_bf16, int64_t K, int8_t *xq, float *dx, float *sx,
                                  int32_t *xs) {
    float buf[QBLOCK];
    for (int64_t b = 0; b < K / QBLOCK; b++) {
        float amax = 0.f;
        for (int j = 0; j < QBLOCK; j++) {
            const int64_t k = b * QBLOCK + j;
            buf[j] = x_bf16 ? bf16_to_f32(((const uint16_t *)x)[k]) : ((const float *)x)[k];
            const float a = fabsf(buf[j]);
            amax = a > amax || isnan(a) ? a : amax;
        }
        const float d = amax / 127.f, inv = d > 0.f ? 1.f / d : 0.f;
        int sum = 0;
        for (int j = 0; j < QBLOCK; j++) {
            const int q = isfinite(d) ? (int)nearbyintf(buf[j] * inv) : 0;
            xq[b * QBLOCK + j] = (int8_t)q;
            sum += q;
        }
        dx[b] = d;
        sx[b] = d * (float)sum;
        xs[b] = sum;
    }
}

#if QMM_VNNI
/* The same, 32 at a time: the same float operations, so the same codes. A bfloat16 block's largest magnitude
 * is found on the bits (x & 0x7fff orders as |x|, a NaN above infinity, so a NaN reaches d), and the codes are
 * packed and summed with integer shuffles, which is cheaper than float reductions and a narrowing store
 * (vpmovdb) per block. */
static void quantize_row_vector(const void *x, int x_bf16, int64_t K, int8_t *xq, float *dx, float *sx, int32_t *xs) {
    if (x_bf16) {
        const __m512i magnitude = _mm512_set1_epi16(0x7fff);
        const __m256i order = _mm256_setr_epi32(0, 4, 2, 6, 1, 5, 3, 7); /* undoes the packs' lane interleave */
        for (int64_t b = 0; b < K / QBLOCK; b++) {
            const __m512i raw = _mm512_loadu_si512((const uint16_t *)x + b * QBLOCK);
            const __m512i a = _mm512_and_si512(raw, magnitude);
            const __m256i m16 = _mm256_max_epu16(_mm512_castsi512_si256(a), _mm512_extracti64x4_epi64(a, 1));
            const __m128i m8 = _mm_max_epu16(_mm256_castsi256_si128(m16), _mm256_extracti128_si256(m16, 1));
            const uint32_t top = (uint32_t)(~_mm_cvtsi128_si32(_mm_minpos_epu16(_mm_xor_si128(m8, _mm_set1_epi16(-1)))) & 0xffff) << 16;
            float amax;
            memcpy(&amax, &top, sizeof amax);
            const float d = amax / 127.f, inv = d > 0.f ? 1.f / d : 0.f;
            const __m512 vinv = _mm512_set1_ps(inv);
            const __m512 v0 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(raw)), 16));
            const __m512 v1 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(raw, 1)), 16));
            const __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, vinv)), q1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, vinv));
            const __m512i w16 = _mm512_packs_epi32(q0, q1); /* |q| <= 127: no saturation */
            const __m256i codes = _mm256_permutevar8x32_epi32(
                _mm256_packs_epi16(_mm512_castsi512_si256(w16), _mm512_extracti64x4_epi64(w16, 1)), order);
            _mm256_storeu_si256((__m256i *)(xq + b * QBLOCK), codes);
            /* the sum: bytes + 128 summed as unsigned in groups of 8 */
            const __m256i sad = _mm256_sad_epu8(_mm256_xor_si256(codes, _mm256_set1_epi8((char)0x80)), _mm256_setzero_si256());
            __m128i s2 = _mm_add_epi64(_mm256_castsi256_si128(sad), _mm256_extracti128_si256(sad, 1));
            s2 = _mm_add_epi64(s2, _mm_unpackhi_epi64(s2, s2));
            dx[b] = d;
            xs[b] = _mm_cvtsi128_si32(s2) - 128 * QBLOCK;
            sx[b] = d * (float)xs[b];
        }
        return;
    }
    const __m512 sign = _mm512_set1_ps(-0.f);
    for (int64_t b = 0; b < K / QBLOCK; b++) {
        const __m512 v0 = _mm512_loadu_ps((const float *)x + b * QBLOCK), v1 = _mm512_loadu_ps((const float *)x + b * QBLOCK + 16);
        float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_andnot_ps(sign, v0), _mm512_andnot_ps(sign, v1)));
        if (_mm512_cmp_ps_mask(v0, v1, _CMP_UNORD_Q)) amax = NAN; /* a NaN in either */
        const float d = amax / 127.f, inv = d > 0.f ? 1.f / d : 0.f;
        const __m512 vinv = _mm512_set1_ps(inv);
        const __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, vinv)), q1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, vinv));
        _mm_storeu_si128((__m128i *)(xq + b * QBLOCK), _mm512_cvtepi32_epi8(q0));
        _mm_storeu_si128((__m128i *)(xq + b * QBLOCK + 16), _mm512_cvtepi32_epi8(q1));
        dx[b] = d;
        xs[b] = _mm512_reduce_add_epi32(q0) + _mm512_reduce_add_epi32(q1);
        sx[b] = d * (float)xs[b];
    }
}
#elif QMM_AVX2
/* One block of 32 floats (4 vectors) into codes, with the portable loop's float operations (so its codes): the
 * largest magnitude by vector maxima, a NaN anywhere found by an unordered compare. */
static inline void quantize_block_avx2(const __m256 v[4], int8_t *xq, float *dx, float *sx, int32_t *xs) {
    const __m256 sign = _mm256_set1_ps(-0.f);
    const __m256 m = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, v[0]), _mm256_andnot_ps(sign, v[1])),
                                   _mm256_max_ps(_mm256_andnot_ps(sign, v[2]), _mm256_andnot_ps(sign, v[3])));
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_shuffle_ps(m4, m4, 1));
    const __m256 unordered = _mm256_or_ps(_mm256_cmp_ps(v[0], v[1], _CMP_UNORD_Q), _mm256_cmp_ps(v[2], v[3], _CMP_UNORD_Q));
    const float amax = _mm256_movemask_ps(unordered) ? NAN : _mm_cvtss_f32(m4);
    const float d = amax / 127.f, inv = d > 0.f ? 1.f / d : 0.f;
    *dx = d;
    if (!isfinite(d)) { /* as the portable loop: codes 0, and d (NaN or infinity) reaches the outputs */
        memset(xq, 0, QBLOCK);
        *xs = 0;
        *sx = d * 0.f;
        return;
    }
    const __m256 vinv = _mm256_set1_ps(inv);
    __m256i q[4];
    for (int i = 0; i < 4; i++) q[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], vinv));
    /* |q| <= 127: the packs do not saturate; they interleave 4-code groups per 128-bit lane, undone by the
     * permute */
    const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
    _mm256_storeu_si256((__m256i *)xq, _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
    const __m256i s8 = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
    __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(s8), _mm256_extracti128_si256(s8, 1));
    s4 = _mm_add_epi32(s4, _mm_unpackhi_epi64(s4, s4));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 1));
    *xs = _mm_cvtsi128_si32(s4);
    *sx = d * (float)*xs;
}

static void quantize_row_vector(const void *x, int x_bf16, int64_t K, int8_t *xq, float *dx, float *sx, int32_t *xs) {
    for (int64_t b = 0; b < K / QBLOCK; b++) {
        __m256 v[4];
        if (x_bf16) {
            const uint16_t *src = (const uint16_t *)x + b * QBLOCK;
            for (int i = 0; i < 4; i++)
                v[i] = _mm256_castsi256_ps(
                    _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(src + 8 * i))), 16));
        } else {
            for (int i = 0; i < 4; i++) v[i] = _mm256_loadu_ps((const float *)x + b * QBLOCK + 8 * i);
        }
        quantize_block_avx2(v, xq + b * QBLOCK, dx + b, sx + b, xs + b);
    }
}
#endif

/* The vector loops where the build has them (the same codes as the portable loop), else the portable loop. */
static void quantize_row(const void *x, int x_bf16, int64_t K, int8_t *xq, float *dx, float *sx, int32_t *xs,
                         int portable) {
#if QMM_VNNI || QMM_AVX2
    if (!portable) {
        quantize_row_vector(x, x_bf16, K, xq, dx, sx, xs);
        return;
    }
#endif
    quantize_row_portable(x, x_bf16, K, xq, dx, sx, xs);
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

#if QMM_AVX2
static inline float hsum256(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

/* Signed bytes a (any, -128 too) times signed bytes x (|x| <= 127), 4 adjacent products summed into each 32-bit
 * lane: |a| x (x with a's sign) keeps vpmaddubsw's pair sums within 2 x 128 x 127, so none saturates. */
static inline __m256i dot_s8_avx2(__m256i a, __m256i x) {
    return _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_abs_epi8(a), _mm256_sign_epi8(x, a)), _mm256_set1_epi16(1));
}

/* The one-row dot with AVX2: one block (32 codes) per integer dot product, its 8 lanes scaled by the block's
 * d * dx. 8-bit codes u are multiplied as u - 128 (dot_s8_avx2) and each lane gets 16 x the block's activation
 * sum back (128 x over the 8 lanes), so that the lanes add up to the portable loop's integer sum. ds: K/32 + 16
 * floats. */
static inline float row_dot_avx2(const uint8_t *codes, const uint16_t *scale, const uint16_t *offset,
                                 const int8_t *xq, const float *dx, const float *sx, const int32_t *xs, int64_t K,
                                 int bits, float *ds) {
    const int64_t nb = K / QBLOCK;
    __m256 acc_o = _mm256_setzero_ps();
    float tail_o = 0.f;
    int64_t b = 0;
    for (; b + 8 <= nb; b += 8) {
        const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(scale + b)));
        const __m256 o = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(offset + b)));
        _mm256_storeu_ps(ds + b, _mm256_mul_ps(d, _mm256_loadu_ps(dx + b)));
        acc_o = _mm256_fmadd_ps(o, _mm256_loadu_ps(sx + b), acc_o);
    }
    for (; b < nb; b++) {
        ds[b] = f16_to_f32(scale[b]) * dx[b];
        tail_o += f16_to_f32(offset[b]) * sx[b];
    }
    const __m256i low4 = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    if (bits == 4) {
        for (int64_t p = 0; p < nb / 2; p++) {
            const __m256i raw = _mm256_loadu_si256((const __m256i *)(codes + p * 32));
            const __m256i lo = _mm256_and_si256(raw, low4), hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low4);
            const __m256i x0 = _mm256_loadu_si256((const __m256i *)(xq + p * 64));
            const __m256i x1 = _mm256_loadu_si256((const __m256i *)(xq + p * 64 + 32));
            const __m256i s0 = _mm256_madd_epi16(_mm256_maddubs_epi16(lo, x0), ones); /* |pair| <= 2 x 15 x 127 */
            const __m256i s1 = _mm256_madd_epi16(_mm256_maddubs_epi16(hi, x1), ones);
            acc0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s0), _mm256_broadcast_ss(ds + 2 * p), acc0);
            acc1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s1), _mm256_broadcast_ss(ds + 2 * p + 1), acc1);
        }
    } else {
        const __m256i flip = _mm256_set1_epi8((char)0x80);
        for (int64_t c = 0; c < nb; c++) {
            const __m256i w = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(codes + c * 32)), flip);
            const __m256i s = _mm256_add_epi32(dot_s8_avx2(w, _mm256_loadu_si256((const __m256i *)(xq + c * 32))),
                                               _mm256_set1_epi32(16 * xs[c]));
            if (c & 1)
                acc1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_broadcast_ss(ds + c), acc1);
            else
                acc0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_broadcast_ss(ds + c), acc0);
        }
    }
    return hsum256(_mm256_add_ps(acc0, acc1)) + hsum256(acc_o) + tail_o;
}
#endif

void quantized_matmul(const void *x, int x_bf16, int64_t M, int64_t K, const uint8_t *codes,
                      const uint16_t *scale, const uint16_t *offset, int64_t N, int bits, void *out, int out_bf16,
                      int portable, int num_threads) {
    CHECK(M >= 0, M);
    CHECK(K > 0 && K % QBLOCK == 0, K);
    CHECK(N > 0, N);
    CHECK(bits == 4 || bits == 8, bits);
    CHECK(num_threads > 0, num_threads);
    CHECK_PTR(x, M);
    CHECK_PTR(out, M);
    CHECK_PTR(codes, 1);
    CHECK_PTR(scale, 1);
    CHECK_PTR(offset, 1);
    const int64_t nb = K / QBLOCK, row_bytes = bits == 4 ? K / 2 : K;
    int8_t *xq = (int8_t *)malloc((size_t)(M * K));
    float *dx = (float *)malloc(sizeof(float) * (size_t)(M * nb));
    float *sx = (float *)malloc(sizeof(float) * (size_t)(M * nb));
    int32_t *xs = (int32_t *)malloc(sizeof(int32_t) * (size_t)(M * nb));
    const size_t elem = x_bf16 ? 2 : 4;
    for (int64_t m = 0; m < M; m++)
        quantize_row((const char *)x + m * K * elem, x_bf16, K, xq + m * K, dx + m * nb, sx + m * nb, xs + m * nb,
                     portable);
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
#elif QMM_AVX2
                    if (!portable)
                        y = row_dot_avx2(cn, sn, on, xm, dxm, sxm, xs + m * nb, K, bits, ds);
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
    free(xs);
}

/* Many rows: the same function on weights re-laid for a register tile (prepared at load, kernels/quantized_matmul.py):
 *   tiles [N/16][K/32][V][64] bytes, V = 4 (4-bit) or 8 (8-bit): each 64-byte vector holds 4 codes for each of
 *         16 output columns (column 16g + j in bytes 4j..4j+3). 4-bit: vector v's low nibbles are inputs
 *         32b + 8v + 0..3 and its high nibbles 32b + 8v + 4..7; 8-bit: vector v is inputs 32b + 4v + 0..3.
 *   tscale, toffset [N/16][K/32][16] float16: d and o of each column's block (as the codes' own; decode
 *         reads every weight's bytes once a step, so bytes count); toffset NULL for a symmetric type's tiles
 *         (symmetric_offset below).
 * One VNNI instruction multiplies 4 inputs of one activation row (broadcast) into 16 columns, so a tile of
 * gemm_rows(bits) rows x 32 columns keeps 2 integer accumulators per row and block and reuses each loaded weight
 * vector across the rows; the block scales are applied once per block and tile row. Requires N % 32 == 0.
 * Rows per tile: 8-bit weights take 6 (more reuse of each loaded weight vector), 4-bit weights 4 (their
 * unpacked vectors take the registers the extra rows would need). Timed with `python -m tests.bench engine`
 * and the kernel's own A/B (tests/bench/RESULTS.md). */
#if QMM_AVX2
/* AVX2's 16 registers hold a tile's 2 x rows accumulators and a few weight vectors: 4 rows for both widths */
#define GEMM_ROWS_4BIT 4
#define GEMM_ROWS_8BIT 4
#else
#define GEMM_ROWS_4BIT 4
#define GEMM_ROWS_8BIT 6
#endif
#define GEMM_ROWS_MAX 6
/* gemm_pair's switch has a constant-row tile for every count up to these; a larger one would fall to its
 * 1-row default and leave rows uncomputed */
_Static_assert(GEMM_ROWS_4BIT <= 4 && GEMM_ROWS_8BIT <= 6, "gemm_pair's tile switch covers 1-4 and 1-6 rows");
/* bits KQ4: 4-bit tiles (the codes as bits 4's) with Q4_K's own scales instead of a float16 scale and offset
 * per block (kernels/quantized_matmul.py, NativeMatmul.q4_k), 4.625 bits a weight:
 *   tscale  [N/16][K/32][2][16] bytes: the block's 6-bit sc, then its m, of each column;
 *   toffset [N/16][K/256][2][16] float16: the super-block's d, then its dmin, of each column.
 * The block's step is d * sc and its offset -(dmin * m), both exact in float32, as ggml de-quantizes Q4_K; then
 * the same float operations per column as the other tiles. K % 256 == 0. Every level's loops
 * take it.
 * bits KQ5: Q5_K's 5-bit codes as KQ4's tiles of their low 4 bits plus a fifth 64-byte vector per block, the
 * plane of their fifth bits: its byte 4j + i holds, in bit t, the fifth bit of the block's input 4t + i of
 * column j (t = 2v + n: the inputs of nibble vector v's low (n 0) or high (n 1) nibbles at those bytes), so
 * that a shift and a mask of the plane put each nibble's fifth bit beside it. Q5_K's scales as KQ4's (its
 * super-block has the same d, dmin, sc and m); 5.625 bits a weight (the file: 5.5; the 8-bit tiles: 9). */
#define KQ4 14
#define KQ5 15
/* bits 5: Q5_0's and Q5_1's codes (0..31) as KQ5's, the 4-bit tiles of their low 4 bits and the plane of their
 * fifth bits, with the float16 scale (and offset) per block of bits 4: Q5_0's d with no offset array (the
 * kernels form -16 d), Q5_1's d and m. 5.5 and 6 bits a weight, as in the file. */
static inline int kquant(int bits) { return bits == KQ4 || bits == KQ5; }
static inline int four_bit(int bits) { return bits == 4 || bits == 5 || kquant(bits); }
/* codes of 5 bits: a plane of fifth bits after the block's 4 nibble vectors */
static inline int fifth(int bits) { return bits == 5 || bits == KQ5; }
/* 64-byte vectors a block of one group holds */
static inline int block_vectors(int bits) { return fifth(bits) ? 5 : four_bit(bits) ? 4 : 8; }
static inline int gemm_rows(int bits) { return four_bit(bits) ? GEMM_ROWS_4BIT : GEMM_ROWS_8BIT; }

/* bits 4, 5 and 8 without an offset array (toffset NULL): a symmetric type's tiles (Q4_0's codes, Q5_0's, Q8_0's
 * + 128), w = d * code + c d with c = -8, -16 or -128, c d formed in float32 (exact: c is a power of 2) instead of
 * read as a float16 (the same value wherever that held it), so the tiles hold the file's bits a weight. */
static inline float symmetric_offset(int bits) { return bits == 4 ? -8.0f : bits == 5 ? -16.0f : -128.0f; }

/* Column col (0..15) of group gg's block b: its step d and offset o (w = d * code + o). */
static inline void block_scale(const uint16_t *tscale, const uint16_t *toffset, int bits, int64_t nb, int64_t gg,
                               int64_t b, int col, float *d, float *o) {
    if (kquant(bits)) {
        const uint8_t *scm = (const uint8_t *)tscale + (gg * nb + b) * 32;
        const uint16_t *dd = toffset + (gg * (nb / 8) + b / 8) * 32;
        *d = f16_to_f32(dd[col]) * (float)scm[col];
        *o = -(f16_to_f32(dd[16 + col]) * (float)scm[16 + col]);
    } else {
        *d = f16_to_f32(tscale[(gg * nb + b) * 16 + col]);
        *o = toffset ? f16_to_f32(toffset[(gg * nb + b) * 16 + col]) : *d * symmetric_offset(bits);
    }
}
#define GEMM_CHUNK 64

#if QMM_VNNI || QMM_AVX2
/* Into L2: block b of both groups of the pair from group g, its codes and the scales it reads (block_scale's
 * addresses): the K-quants' sc and m bytes per block and their d and dmin per super-block of 8 blocks, the
 * other kinds' scales (and offsets) per block. */
static inline __attribute__((always_inline)) void prefetch_pair(const uint8_t *tiles, const uint16_t *tscale,
                                                                const uint16_t *toffset, int64_t nb, int bits,
                                                                int64_t g, int64_t b) {
    const int vecs = block_vectors(bits);
    for (int64_t gg = g; gg < g + 2; gg++) {
        for (int v = 0; v < vecs; v++) _mm_prefetch((const char *)(tiles + (gg * nb + b) * vecs * 64 + v * 64), _MM_HINT_T1);
        _mm_prefetch((const char *)(tscale + (gg * nb + b) * 16), _MM_HINT_T1);
        if (kquant(bits))
            _mm_prefetch((const char *)(toffset + (gg * (nb / 8) + b / 8) * 32), _MM_HINT_T1);
        else if (toffset)
            _mm_prefetch((const char *)(toffset + (gg * nb + b) * 16), _MM_HINT_T1);
    }
}
#endif

static inline int tiled_code(const uint8_t *tiles, int64_t nb, int bits, int64_t n, int64_t k) {
    const int64_t g = n / 16, j = n % 16, b = k / QBLOCK, i = k % QBLOCK;
    if (four_bit(bits)) {
        const int vecs = block_vectors(bits);
        const uint8_t byte = tiles[((g * nb + b) * vecs + i / 8) * 64 + j * 4 + (i % 4)];
        const int low = (i % 8) < 4 ? (byte & 0x0F) : (byte >> 4);
        if (!fifth(bits)) return low;
        const uint8_t plane = tiles[((g * nb + b) * vecs + 4) * 64 + j * 4 + (i % 4)];
        return low | (((plane >> (i / 4)) & 1) << 4);
    }
    return tiles[((g * nb + b) * 8 + i / 4) * 64 + j * 4 + (i % 4)];
}

#if QMM_VNNI
/* The activation's 4 bytes (or 1 float) broadcast inside the instruction from memory ({1to16}): acc += w . x.
 * GCC keeps a broadcast used twice in a register of its own (a separate vpbroadcastd); folded into each use
 * the 4-bit tiles run faster, while 8-bit tiles keep the shared broadcast (it measured slower folded). The
 * block scales' broadcasts (below) are folded for both. AT&T syntax, as GCC emits by default. */
#define DPBUSD_BCAST(acc, w, mem) __asm__("vpdpbusd %[x]%{1to16%}, %[a], %[c]" : [c] "+v"(acc) : [a] "v"(w), [x] "m"(mem))
#define MUL_BCAST(out, v, mem) __asm__("vmulps %[x]%{1to16%}, %[a], %[o]" : [o] "=v"(out) : [a] "v"(v), [x] "m"(mem))
#define FMADD_BCAST(acc, v, mem) __asm__("vfmadd231ps %[x]%{1to16%}, %[a], %[c]" : [c] "+v"(acc) : [a] "v"(v), [x] "m"(mem))
/* block_scale for the 16 columns of group gg: the same products, in one vector. */
static inline __attribute__((always_inline)) void block_scale_vnni(const uint16_t *tscale, const uint16_t *toffset,
                                                                   int bits, int64_t nb, int64_t gg, int64_t b,
                                                                   __m512 *d, __m512 *o) {
#define LOAD_HALVES(p) _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p)))
    if (kquant(bits)) {
        const uint8_t *scm = (const uint8_t *)tscale + (gg * nb + b) * 32;
        const uint16_t *dd = toffset + (gg * (nb / 8) + b / 8) * 32;
        const __m512 sc = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)scm)));
        const __m512 m = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(scm + 16))));
        *d = _mm512_mul_ps(LOAD_HALVES(dd), sc);
        *o = _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(_mm512_mul_ps(LOAD_HALVES(dd + 16), m)),
                                                  _mm512_set1_epi32((int)0x80000000)));
    } else {
        *d = LOAD_HALVES(tscale + (gg * nb + b) * 16);
        *o = toffset ? LOAD_HALVES(toffset + (gg * nb + b) * 16) : _mm512_mul_ps(*d, _mm512_set1_ps(symmetric_offset(bits)));
    }
#undef LOAD_HALVES
}

/* KQ5: the fifth bits of nibble vector v's low (t = 2v) or high (t = 2v + 1) nibbles, at bit 4 of each byte (the
 * plane shifted so that its bit t lands there, masked), to be or-ed into those nibbles. */
static inline __attribute__((always_inline)) __m512i fifth_bits_vnni(__m512i plane, int t) {
    const __m512i bit = t <= 4 ? _mm512_slli_epi16(plane, 4 - t) : _mm512_srli_epi16(plane, t - 4);
    return _mm512_and_si512(bit, _mm512_set1_epi8(0x10));
}

/* Always inlined with a constant `rows`, so the accumulators stay in registers. */
static inline __attribute__((always_inline)) void gemm_tile_vnni(const uint8_t *tiles, const uint16_t *tscale, const uint16_t *toffset, int64_t nb,
                           int bits, int64_t g, const int8_t *xq, const float *dx, const float *sx, int64_t K,
                           int64_t m0, int rows, float *acc_out /* [rows][32] */, int64_t pf_g,
                           int pf_every, int pf_phase, const float *ksc) {
    /* pf_g >= 0: also prefetch (into L2) the blocks b % pf_every == pf_phase of column pair pf_g; ksc: the pair's
     * K-quant block scales as floats (pair_scales), else formed here */
    const int four = four_bit(bits), vecs = block_vectors(bits), step = four ? 8 : 4;
    const __m512i low4 = _mm512_set1_epi8(0x0F);
    __m512 acc[GEMM_ROWS_MAX][2];
    for (int r = 0; r < rows; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *c0 = tiles + (g * nb + b) * vecs * 64, *c1 = tiles + ((g + 1) * nb + b) * vecs * 64;
        if (pf_g >= 0 && b % pf_every == pf_phase) prefetch_pair(tiles, tscale, toffset, nb, bits, pf_g, b);
        __m512i ia[GEMM_ROWS_MAX][2];
        for (int r = 0; r < rows; r++) ia[r][0] = ia[r][1] = _mm512_setzero_si512();
        __m512i plane0 = _mm512_setzero_si512(), plane1 = _mm512_setzero_si512();
        if (fifth(bits)) {
            plane0 = _mm512_loadu_si512((const void *)(c0 + 4 * 64));
            plane1 = _mm512_loadu_si512((const void *)(c1 + 4 * 64));
        }
        for (int v = 0; v < (four ? 4 : 8); v++) {
            const __m512i raw0 = _mm512_loadu_si512((const void *)(c0 + v * 64));
            const __m512i raw1 = _mm512_loadu_si512((const void *)(c1 + v * 64));
            if (four) {
                __m512i a0 = _mm512_and_si512(raw0, low4), a1 = _mm512_and_si512(_mm512_srli_epi16(raw0, 4), low4);
                __m512i b0 = _mm512_and_si512(raw1, low4), b1 = _mm512_and_si512(_mm512_srli_epi16(raw1, 4), low4);
                if (fifth(bits)) {
                    a0 = _mm512_or_si512(a0, fifth_bits_vnni(plane0, 2 * v));
                    a1 = _mm512_or_si512(a1, fifth_bits_vnni(plane0, 2 * v + 1));
                    b0 = _mm512_or_si512(b0, fifth_bits_vnni(plane1, 2 * v));
                    b1 = _mm512_or_si512(b1, fifth_bits_vnni(plane1, 2 * v + 1));
                }
                for (int r = 0; r < rows; r++) {
                    const int32_t *x4 = (const int32_t *)(xq + (m0 + r) * K + b * QBLOCK + v * step);
                    DPBUSD_BCAST(ia[r][0], a0, x4[0]);
                    DPBUSD_BCAST(ia[r][1], b0, x4[0]);
                    DPBUSD_BCAST(ia[r][0], a1, x4[1]);
                    DPBUSD_BCAST(ia[r][1], b1, x4[1]);
                }
            } else {
                for (int r = 0; r < rows; r++) {
                    int32_t x4;
                    memcpy(&x4, xq + (m0 + r) * K + b * QBLOCK + v * step, sizeof x4);
                    const __m512i x0 = _mm512_set1_epi32(x4);
                    ia[r][0] = _mm512_dpbusd_epi32(ia[r][0], raw0, x0);
                    ia[r][1] = _mm512_dpbusd_epi32(ia[r][1], raw1, x0);
                }
            }
        }
        __m512 d0, d1, o0, o1;
        if (kquant(bits) && ksc) {
            d0 = _mm512_loadu_ps(ksc + b * 64), o0 = _mm512_loadu_ps(ksc + b * 64 + 16);
            d1 = _mm512_loadu_ps(ksc + b * 64 + 32), o1 = _mm512_loadu_ps(ksc + b * 64 + 48);
        } else {
            block_scale_vnni(tscale, toffset, bits, nb, g, b, &d0, &o0);
            block_scale_vnni(tscale, toffset, bits, nb, g + 1, b, &d1, &o1);
        }
        for (int r = 0; r < rows; r++) {
            const float *rdx = dx + (m0 + r) * nb + b, *rsx = sx + (m0 + r) * nb + b;
            __m512 s0, s1;
            MUL_BCAST(s0, d0, *rdx);
            MUL_BCAST(s1, d1, *rdx);
            acc[r][0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ia[r][0]), s0, acc[r][0]);
            acc[r][1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ia[r][1]), s1, acc[r][1]);
            FMADD_BCAST(acc[r][0], o0, *rsx);
            FMADD_BCAST(acc[r][1], o1, *rsx);
        }
    }
    for (int r = 0; r < rows; r++) {
        _mm512_storeu_ps(acc_out + r * 32, acc[r][0]);
        _mm512_storeu_ps(acc_out + r * 32 + 16, acc[r][1]);
    }
}
#endif

#if QMM_AVX2
/* Pins a vector in a register at this point of the loop: GCC otherwise re-associates a tile's integer sums
 * (exact either way) into a tree that computes every product of a block first, and the tile's accumulators
 * and those products no longer fit AVX2's 16 registers (the 4-row tiles spilled ~47 vectors a block). */
#define PIN(v) __asm__("" : "+x"(v))

/* block_scale for 8 columns (half h of group gg): the same products, in vectors. */
static inline void block_scale_avx2(const uint16_t *tscale, const uint16_t *toffset, int bits, int64_t nb, int64_t gg,
                                    int64_t b, int h, __m256 *d, __m256 *o) {
    if (kquant(bits)) {
        const uint8_t *scm = (const uint8_t *)tscale + (gg * nb + b) * 32 + h * 8;
        const uint16_t *dd = toffset + (gg * (nb / 8) + b / 8) * 32 + h * 8;
        const __m256 sc = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)scm)));
        const __m256 m = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(scm + 16))));
        *d = _mm256_mul_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)dd)), sc);
        *o = _mm256_xor_ps(_mm256_mul_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(dd + 16))), m),
                           _mm256_set1_ps(-0.0f));
    } else {
        *d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(tscale + (gg * nb + b) * 16 + h * 8)));
        *o = toffset ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(toffset + (gg * nb + b) * 16 + h * 8)))
                     : _mm256_mul_ps(*d, _mm256_set1_ps(symmetric_offset(bits)));
    }
}

/* fifth_bits_vnni for AVX2's half vectors */
static inline __attribute__((always_inline)) __m256i fifth_bits_avx2(__m256i plane, int t) {
    const __m256i bit = t <= 4 ? _mm256_slli_epi16(plane, 4 - t) : _mm256_srli_epi16(plane, t - 4);
    return _mm256_and_si256(bit, _mm256_set1_epi8(0x10));
}

/* The tile with AVX2: 8 columns (half of one 64-byte vector) a pass, each pass over every block, so that a pass
 * keeps 2 accumulators per row (the block's integer sums, the float total) and the weight vectors it unpacks in
 * registers. 4-bit: vpmaddubsw's 16-bit pair sums of a block's 8 vectors (low and high nibbles) add up in 16 bits
 * (8 x 2 x 15 x 127 = 30,480 at most) before one vpmaddwd; 8-bit: each vector's products are summed to 32 bits
 * (dot_s8_avx2), on 128 x the row's block sum; 5-bit (bits 5, KQ5): each vector's two products (2 x 2 x 31 x 128 at most)
 * summed to 32 bits. The same integers as the VNNI tile, then the same float
 * operations per column (s = d * dx; acc += s * sum; acc += o * sx): the same results, bit for bit. */
static inline __attribute__((always_inline)) void gemm_tile_avx2(const uint8_t *tiles, const uint16_t *tscale, const uint16_t *toffset, int64_t nb,
                           int bits, int64_t g, const int8_t *xq, const float *dx, const float *sx, const int32_t *xs,
                           int64_t K, int64_t m0, int rows, float *acc_out /* [rows][32] */, int64_t pf_g,
                           int pf_every, int pf_phase, const float *ksc) {
    const int four = four_bit(bits), vecs = block_vectors(bits), step = four ? 8 : 4;
    const __m256i low4 = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1), flip = _mm256_set1_epi8((char)0x80);
    for (int q = 0; q < 4; q++) {
        const int64_t gg = g + q / 2;
        const int h = q % 2;
        __m256 acc[GEMM_ROWS_MAX];
        for (int r = 0; r < rows; r++) acc[r] = _mm256_setzero_ps();
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *c = tiles + (gg * nb + b) * vecs * 64 + h * 32;
            if (q == 0 && pf_g >= 0 && b % pf_every == pf_phase)
                prefetch_pair(tiles, tscale, toffset, nb, bits, pf_g, b);
            __m256i ia[GEMM_ROWS_MAX];
            if (four) {
                for (int r = 0; r < rows; r++) ia[r] = _mm256_setzero_si256();
                for (int v = 0; v < 4; v++) {
                    const __m256i raw = _mm256_loadu_si256((const __m256i *)(c + v * 64));
                    __m256i lo = _mm256_and_si256(raw, low4), hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low4);
                    if (fifth(bits)) {
                        const __m256i plane = _mm256_loadu_si256((const __m256i *)(c + 4 * 64));
                        lo = _mm256_or_si256(lo, fifth_bits_avx2(plane, 2 * v));
                        hi = _mm256_or_si256(hi, fifth_bits_avx2(plane, 2 * v + 1));
                    }
                    for (int r = 0; r < rows; r++) {
                        const int8_t *x4 = xq + (m0 + r) * K + b * QBLOCK + v * step;
                        int32_t x0, x1;
                        memcpy(&x0, x4, sizeof x0);
                        memcpy(&x1, x4 + 4, sizeof x1);
                        const __m256i plo = _mm256_maddubs_epi16(lo, _mm256_set1_epi32(x0));
                        const __m256i phi = _mm256_maddubs_epi16(hi, _mm256_set1_epi32(x1));
                        if (fifth(bits)) /* 5-bit products: each vector's pair summed to 32 bits */
                            ia[r] = _mm256_add_epi32(ia[r], _mm256_madd_epi16(_mm256_add_epi16(plo, phi), ones));
                        else
                            ia[r] = _mm256_add_epi16(_mm256_add_epi16(ia[r], plo), phi);
                        PIN(ia[r]);
                    }
                }
                if (!fifth(bits))
                    for (int r = 0; r < rows; r++) ia[r] = _mm256_madd_epi16(ia[r], ones);
            } else {
                for (int r = 0; r < rows; r++) ia[r] = _mm256_set1_epi32(128 * xs[(m0 + r) * nb + b]);
                for (int v = 0; v < 8; v++) {
                    const __m256i w = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(c + v * 64)), flip);
                    const __m256i magnitude = _mm256_abs_epi8(w);
                    for (int r = 0; r < rows; r++) {
                        int32_t x4;
                        memcpy(&x4, xq + (m0 + r) * K + b * QBLOCK + v * step, sizeof x4);
                        const __m256i signed_x = _mm256_sign_epi8(_mm256_set1_epi32(x4), w);
                        ia[r] = _mm256_add_epi32(ia[r], _mm256_madd_epi16(_mm256_maddubs_epi16(magnitude, signed_x), ones));
                        PIN(ia[r]);
                    }
                }
            }
            __m256 d, o;
            if (kquant(bits) && ksc) {
                d = _mm256_loadu_ps(ksc + b * 64 + (q / 2) * 32 + h * 8);
                o = _mm256_loadu_ps(ksc + b * 64 + (q / 2) * 32 + 16 + h * 8);
            } else {
                block_scale_avx2(tscale, toffset, bits, nb, gg, b, h, &d, &o);
            }
            for (int r = 0; r < rows; r++) {
                const __m256 s = _mm256_mul_ps(d, _mm256_broadcast_ss(dx + (m0 + r) * nb + b));
                acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ia[r]), s, acc[r]);
                acc[r] = _mm256_fmadd_ps(o, _mm256_broadcast_ss(sx + (m0 + r) * nb + b), acc[r]);
            }
        }
        for (int r = 0; r < rows; r++) _mm256_storeu_ps(acc_out + r * 32 + q * 8, acc[r]);
    }
}

/* One row (a single stream's decode): the pair's four quarters of 8 columns in one pass over the blocks, so each
 * block's bytes of both groups are read once and in order (two sequential streams, which the hardware prefetcher
 * follows), and four independent accumulator chains hide the latency of each one's adds. The same integer sums
 * and the same float operations per column, in the same block order, as gemm_tile_avx2 with one row: the same
 * bits. */
static inline __attribute__((always_inline)) void gemm_row1_avx2(const uint8_t *tiles, const uint16_t *tscale,
                                                                 const uint16_t *toffset, int64_t nb, int bits,
                                                                 int64_t g, const int8_t *xq, const float *dx,
                                                                 const float *sx, const int32_t *xs,
                                                                 float *acc_out /* [32] */, int64_t pf_g) {
    const int four = four_bit(bits), vecs = block_vectors(bits);
    const __m256i low4 = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1), flip = _mm256_set1_epi8((char)0x80);
    const uint8_t *c0 = tiles + g * nb * vecs * 64, *c1 = c0 + nb * vecs * 64;
    __m256 acc[4];
    for (int q = 0; q < 4; q++) acc[q] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        if (pf_g >= 0) prefetch_pair(tiles, tscale, toffset, nb, bits, pf_g, b); /* the next pair (< 0: none) */
        const uint8_t *cq[4] = {c0 + b * vecs * 64, c0 + b * vecs * 64 + 32, c1 + b * vecs * 64, c1 + b * vecs * 64 + 32};
        const int8_t *xb = xq + b * QBLOCK;
        __m256i ia[4];
        if (four) {
            for (int q = 0; q < 4; q++) ia[q] = _mm256_setzero_si256();
            for (int v = 0; v < 4; v++) {
                int32_t x0, x1;
                memcpy(&x0, xb + v * 8, sizeof x0);
                memcpy(&x1, xb + v * 8 + 4, sizeof x1);
                const __m256i bx0 = _mm256_set1_epi32(x0), bx1 = _mm256_set1_epi32(x1);
                for (int q = 0; q < 4; q++) {
                    const __m256i raw = _mm256_loadu_si256((const __m256i *)(cq[q] + v * 64));
                    __m256i lo = _mm256_and_si256(raw, low4), hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low4);
                    if (fifth(bits)) { /* 5-bit products: each vector's pair summed to 32 bits */
                        const __m256i plane = _mm256_loadu_si256((const __m256i *)(cq[q] + 4 * 64));
                        lo = _mm256_or_si256(lo, fifth_bits_avx2(plane, 2 * v));
                        hi = _mm256_or_si256(hi, fifth_bits_avx2(plane, 2 * v + 1));
                        const __m256i pair = _mm256_add_epi16(_mm256_maddubs_epi16(lo, bx0), _mm256_maddubs_epi16(hi, bx1));
                        ia[q] = _mm256_add_epi32(ia[q], _mm256_madd_epi16(pair, ones));
                    } else {
                        ia[q] = _mm256_add_epi16(ia[q], _mm256_maddubs_epi16(lo, bx0));
                        ia[q] = _mm256_add_epi16(ia[q], _mm256_maddubs_epi16(hi, bx1));
                    }
                    PIN(ia[q]);
                }
            }
            if (!fifth(bits))
                for (int q = 0; q < 4; q++) ia[q] = _mm256_madd_epi16(ia[q], ones);
        } else {
            for (int q = 0; q < 4; q++) ia[q] = _mm256_set1_epi32(128 * xs[b]);
            for (int v = 0; v < 8; v++) {
                int32_t x4;
                memcpy(&x4, xb + v * 4, sizeof x4);
                const __m256i bx = _mm256_set1_epi32(x4);
                for (int q = 0; q < 4; q++) {
                    const __m256i w = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(cq[q] + v * 64)), flip);
                    const __m256i signed_x = _mm256_sign_epi8(bx, w);
                    ia[q] = _mm256_add_epi32(ia[q], _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_abs_epi8(w), signed_x), ones));
                    PIN(ia[q]);
                }
            }
        }
        const __m256 dxb = _mm256_broadcast_ss(dx + b), sxb = _mm256_broadcast_ss(sx + b);
        for (int q = 0; q < 4; q++) {
            __m256 d, o;
            block_scale_avx2(tscale, toffset, bits, nb, g + q / 2, b, q % 2, &d, &o);
            acc[q] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ia[q]), _mm256_mul_ps(d, dxb), acc[q]);
            acc[q] = _mm256_fmadd_ps(o, sxb, acc[q]);
        }
    }
    for (int q = 0; q < 4; q++) _mm256_storeu_ps(acc_out + q * 8, acc[q]);
}
#endif

static void gemm_tile_portable(const uint8_t *tiles, const uint16_t *tscale, const uint16_t *toffset, int64_t nb,
                               int bits, int64_t g, const int8_t *xq, const float *dx, const float *sx,
                               int64_t K, int64_t m0, int rows, float *acc_out) {
    for (int r = 0; r < rows; r++)
        for (int j = 0; j < 32; j++) {
            const int64_t n = g * 16 + j, col = n % 16, gg = n / 16;
            float total = 0.f;
            for (int64_t b = 0; b < nb; b++) {
                int32_t isum = 0;
                for (int i = 0; i < QBLOCK; i++)
                    isum += tiled_code(tiles, nb, bits, n, b * QBLOCK + i) * xq[(m0 + r) * K + b * QBLOCK + i];
                /* the vector tiles' float operations, fused as theirs (fmaf), so every level's result is the same
                 * bit for bit */
                float d, o;
                block_scale(tscale, toffset, bits, nb, gg, b, (int)col, &d, &o);
                const float step = d * dx[(m0 + r) * nb + b];
                total = fmaf((float)isum, step, total);
                total = fmaf(o, sx[(m0 + r) * nb + b], total);
            }
            acc_out[r * 32 + j] = total;
        }
}

/* 32 floats to out[at..at+32), as float32 or rounded to bfloat16 (nearest even, NaN kept). */
static inline void store_row32(const float *src, void *out, int64_t at, int out_bf16) {
    if (!out_bf16) {
        memcpy((float *)out + at, src, 32 * sizeof(float));
        return;
    }
#if QMM_VNNI
    for (int h = 0; h < 2; h++) {
        const __m512i bits = _mm512_castps_si512(_mm512_loadu_ps(src + h * 16));
        const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
        __m512i r = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff))), 16);
        const __mmask16 nan = _mm512_cmp_ps_mask(_mm512_loadu_ps(src + h * 16), _mm512_loadu_ps(src + h * 16), _CMP_UNORD_Q);
        r = _mm512_mask_or_epi32(r, nan, _mm512_srli_epi32(bits, 16), _mm512_set1_epi32(0x40));
        _mm256_storeu_si256((__m256i *)((uint16_t *)out + at + h * 16), _mm512_cvtepi32_epi16(r));
    }
#else
    for (int j = 0; j < 32; j++) ((uint16_t *)out)[at + j] = f32_to_bf16(src[j]);
#endif
}

/* The fused epilogue: out[at .. at + 32) = dtype(dtype(silu(gate)) * up) of 32 columns' gate and up sums, each
 * first rounded to the dtype as store_row32 stores them, then as the layer ops' silu_mul computes it. */
static inline void store_silu32(const float *gate, const float *up, void *out, int64_t at, int out_bf16) {
    for (int h = 0; h < 32 / W; h++) {
        vf g, u;
        memcpy(&g, gate + h * W, sizeof g);
        memcpy(&u, up + h * W, sizeof u);
        if (out_bf16) {
            g = vround_bf16(g), u = vround_bf16(u);
            vstore_bf16_bits((uint16_t *)out + at + h * W, (vu)vround_bf16(vsilu_mul(g, u, 1)));
        } else {
            const vf y = vsilu_mul(g, u, 0);
            memcpy((float *)out + at + h * W, &y, sizeof y);
        }
    }
}

/* A tile's `rows` rows of column pair g, from row m0: the plain sums (32 columns a row), or with `silu` the
 * gate sums and, GEMM_ROWS_MAX rows on, the up sums, as SiLU(gate) x up into the N / 2 outputs' columns; output
 * rows ldo elements apart. */
static inline void store_tile_rows(const float *tile, int rows, int64_t m0, int64_t g, int64_t ldo, int silu,
                                   void *out, int out_bf16) {
    for (int r = 0; r < rows; r++) {
        if (silu)
            store_silu32(tile + r * 32, tile + (GEMM_ROWS_MAX + r) * 32, out, (m0 + r) * ldo + g * 16, out_bf16);
        else
            store_row32(tile + r * 32, out, (m0 + r) * ldo + g * 16, out_bf16);
    }
}

#if QMM_VNNI || QMM_AVX2
/* A K-quant pair's block scales (block_scale's d and o, the same floats) once for all its row tiles: [nb][group
 * g, g + 1][d, o][16 columns]. Formed in each tile they cost about as much as a row's own scaling. */
static void pair_scales(const uint16_t *tscale, const uint16_t *toffset, int bits, int64_t nb, int64_t g, float *ksc) {
    for (int64_t b = 0; b < nb; b++)
        for (int i = 0; i < 2; i++) {
            float *t = ksc + b * 64 + i * 32;
#if QMM_VNNI
            __m512 d, o;
            block_scale_vnni(tscale, toffset, bits, nb, g + i, b, &d, &o);
            _mm512_storeu_ps(t, d);
            _mm512_storeu_ps(t + 16, o);
#else
            for (int h = 0; h < 2; h++) {
                __m256 d, o;
                block_scale_avx2(tscale, toffset, bits, nb, g + i, b, h, &d, &o);
                _mm256_storeu_ps(t + h * 8, d);
                _mm256_storeu_ps(t + 16 + h * 8, o);
            }
#endif
        }
}
#endif

/* Column pair g (columns 16g .. 16g + 31) for rows mc .. mend - 1, a tile of `step` rows at a time: the next
 * pair's weights come from memory while this one's are reused from cache by every row group, each group
 * prefetching its share of the blocks. With `silu`, pair g is a gate pair of the fused gate-up weight (its
 * first N / 2 columns): the up pair N / 32 groups on is computed for the same rows, and SiLU(gate) x up goes
 * to out [M, N / 2]. */
static inline __attribute__((always_inline)) void gemm_pair(
    const uint8_t *tiles, const uint16_t *tscale, const uint16_t *toffset, int64_t nb, int bits, int64_t g, int64_t N,
    const int8_t *xq, const float *dx, const float *sx, const int32_t *xs, int64_t K, int64_t mc, int64_t mend,
    int step, float *tile, void *out, int64_t ldo, int out_bf16, int portable, int silu, float *ksc) {
    const int groups = (int)((mend - mc + step - 1) / step);
    const int64_t up = g + N / 32; /* silu: the up pair */
#if QMM_VNNI || QMM_AVX2
    /* ksc (the thread's scratch, K-quants): the scales once where more than one tile of rows reads them */
    if (ksc && groups > 1 && !portable)
        for (int part = 0; part <= silu; part++) pair_scales(tscale, toffset, bits, nb, part ? up : g, ksc + part * nb * 64);
    else
        ksc = NULL;
#else
    ksc = NULL;
#endif
    /* the rows in `groups` tiles as even as they go, each tile a constant row count (its accumulators in
     * registers): 32 rows of 6-row tiles as 6, 6, 5, 5, 5, 5, not 6 x 5 and a 2-row tile at a variable count.
     * Same results. */
    const int64_t base_rows = (mend - mc) / groups, extra = (mend - mc) % groups;
    for (int64_t gi = 0, m0 = mc; gi < groups; gi++) {
        const int rows = (int)(base_rows + (gi < extra));
        const int pf_phase = (int)gi;
        for (int part = 0; part <= silu; part++) {
            const int64_t gg = part ? up : g, pf_g = gg + 2 < (silu && !part ? N / 32 : N / 16) ? gg + 2 : -1;
            float *t = tile + part * GEMM_ROWS_MAX * 32;
            const float *kt = ksc ? ksc + part * nb * 64 : NULL;
#if !QMM_VNNI && !QMM_AVX2
            (void)pf_g, (void)pf_phase, (void)kt; /* prefetching and the pair's scales are for the vector tiles */
#endif
#if QMM_VNNI || QMM_AVX2
#if QMM_VNNI
#define GEMM_TILE(B, R) gemm_tile_vnni(tiles, tscale, toffset, nb, B, gg, xq, dx, sx, K, m0, R, t, pf_g, groups, pf_phase, kt)
#else
#define GEMM_TILE(B, R) gemm_tile_avx2(tiles, tscale, toffset, nb, B, gg, xq, dx, sx, xs, K, m0, R, t, pf_g, groups, pf_phase, kt)
#endif
            if (!portable) {
#if QMM_AVX2
                if (rows == 1 && groups == 1) {
#define ROW1(B) gemm_row1_avx2(tiles, tscale, toffset, nb, B, gg, xq + m0 * K, dx + m0 * nb, sx + m0 * nb, xs + m0 * nb, t, pf_g)
                    if (bits == 4)
                        ROW1(4);
                    else if (bits == 5)
                        ROW1(5);
                    else if (bits == KQ4)
                        ROW1(KQ4);
                    else if (bits == KQ5)
                        ROW1(KQ5);
                    else
                        ROW1(8);
#undef ROW1
                } else
#endif
/* the 4-bit tiles' kinds: a constant `bits` and row count per call */
#define GEMM_TILE_4BIT(B)                                                                                         \
    switch (rows) {                                                                                               \
    case 4: GEMM_TILE(B, 4); break;                                                                               \
    case 3: GEMM_TILE(B, 3); break;                                                                               \
    case 2: GEMM_TILE(B, 2); break;                                                                               \
    default: GEMM_TILE(B, 1); break;                                                                              \
    }
                if (bits == 4) {
                    GEMM_TILE_4BIT(4)
                } else if (bits == 5) {
                    GEMM_TILE_4BIT(5)
                } else if (bits == KQ4) {
                    GEMM_TILE_4BIT(KQ4)
                } else if (bits == KQ5) {
                    GEMM_TILE_4BIT(KQ5)
                } else {
                    switch (rows) {
#if GEMM_ROWS_8BIT > 4
                    case 6: GEMM_TILE(8, 6); break;
                    case 5: GEMM_TILE(8, 5); break;
#endif
                    case 4: GEMM_TILE(8, 4); break;
                    case 3: GEMM_TILE(8, 3); break;
                    case 2: GEMM_TILE(8, 2); break;
                    default: GEMM_TILE(8, 1); break;
                    }
                }
            } else
#undef GEMM_TILE_4BIT
#undef GEMM_TILE
#endif
                gemm_tile_portable(tiles, tscale, toffset, nb, bits, gg, xq, dx, sx, K, m0, rows, t);
        }
        store_tile_rows(tile, rows, m0, g, ldo, silu, out, out_bf16);
        m0 += rows;
    }
}

/* 6-bit weights: Q6_K's own blocks, w = d * sc * (q - 32) with q 0..63, sc an int8 per 16 inputs and d a
 * float16 per 256, multiplied without re-quantizing them. Tiles of the 8-bit tiles' shape (prepared at load,
 * kernels/quantized_matmul.py, NativeMatmul.q6_k):
 *   tiles   [N/16][K/32][6][64] bytes. Code vector v (0..7) of a block is its inputs 4v..4v+3 for the 16
 *           columns (column j in bytes 4j..4j+3, as the 8-bit tiles' vector v). Sub-block s (v = 4s..4s+3) is
 *           vectors 3s..3s+2, A, B, C: the low 6 bits of A, B, C are code vectors 4s, 4s+1, 4s+2, and their top
 *           2 bits hold code vector 4s+3's bits 0-1, 2-3 and 4-5.
 *   tscale  [N/16][K/256][16] float16: d of each column's super-block.
 *   toffset [N/16][K/32][16][2] int8 (passed as the offset pointer): sc of each column's two sub-blocks of 16.
 * 6.5625 bits a weight, as in the file. Per block, column and row, each sub-block's integer sum
 * I_s = sum_16 (q - 32) xq is exact at every level (it starts at -32 x the row's sum of xq over the sub-block);
 * then t = fma(I_1, d sc_1, I_0 * d sc_0) (d sc exact in a float: 11 by 8 significant bits) and
 * acc = fma(t, dx, acc): the same float operations at every level, so every level returns the same bits.
 * The vector tiles read each row's activations per block from one 64-byte record (xa [M][K/32][64], made once
 * per call, so that a tile of rows keeps one pointer per row): xq [32] int8 at 0, -32 x its two sub-blocks'
 * sums (int32) at 32, dx (float) at 40.
 * Where a call's rows fit one tile the vector levels unpack the codes in registers; with more rows they unpack
 * a column pair once per chunk of rows (UNPACKED6 bytes a block, into the thread's scratch: codes [2 halves of
 * the pair][8][64] as bytes 0..63, then d sc [2][2 sub-blocks][16] floats) and every row group multiplies
 * from there, as from 8-bit tiles. */
#define Q6_VECS 6
#define UNPACKED6 1280
#define XA_BYTES 64
#if QMM_AVX2
#define GEMM_ROWS_6BIT 4
#else
#define GEMM_ROWS_6BIT 6
#endif
_Static_assert(GEMM_ROWS_6BIT <= GEMM_ROWS_MAX, "gemm_pair6's tile switch covers 1-6 rows");

#if QMM_VNNI || QMM_AVX2
/* Into L2: block b of group gg of the 6-bit tiles, with its sc (per block) and d (per super-block of 8). */
static inline __attribute__((always_inline)) void prefetch_block6(const uint8_t *tiles, const uint16_t *td,
                                                                  const int8_t *tsc, int64_t nb, int64_t gg, int64_t b) {
    for (int v = 0; v < Q6_VECS; v++) _mm_prefetch((const char *)(tiles + ((gg * nb + b) * Q6_VECS + v) * 64), _MM_HINT_T1);
    _mm_prefetch((const char *)(tsc + (gg * nb + b) * 32), _MM_HINT_T1);
    _mm_prefetch((const char *)(td + (gg * (nb / 8) + b / 8) * 16), _MM_HINT_T1);
}
#endif
int quantized_matmul_vectorized(void);

static inline int tiled_code6(const uint8_t *tiles, int64_t nb, int64_t n, int64_t k) {
    const int64_t g = n / 16, j = n % 16, b = k / QBLOCK, i = k % QBLOCK, v = i / 4;
    const uint8_t *t = tiles + (g * nb + b) * Q6_VECS * 64 + (v / 4) * 192 + j * 4 + i % 4;
    if (v % 4 < 3) return t[(v % 4) * 64] & 0x3F;
    return (t[0] >> 6) | ((t[64] >> 6) << 2) | ((t[128] >> 6) << 4);
}

static void gemm_tile6_portable(const uint8_t *tiles, const uint16_t *td, const int8_t *tsc, int64_t nb, int64_t g,
                                const int8_t *xq, const float *dx, int64_t K, int64_t m0, int rows, float *acc_out) {
    for (int r = 0; r < rows; r++)
        for (int j = 0; j < 32; j++) {
            const int64_t n = g * 16 + j, col = n % 16, gg = n / 16;
            float total = 0.f;
            for (int64_t b = 0; b < nb; b++) {
                float dsc[2];
                int32_t isum[2];
                for (int s = 0; s < 2; s++) {
                    isum[s] = 0;
                    for (int i = 0; i < 16; i++) {
                        const int64_t k = b * QBLOCK + s * 16 + i;
                        isum[s] += (tiled_code6(tiles, nb, n, k) - 32) * xq[(m0 + r) * K + k];
                    }
                    dsc[s] = f16_to_f32(td[(gg * (nb / 8) + b / 8) * 16 + col]) * (float)tsc[((gg * nb + b) * 16 + col) * 2 + s];
                }
                const float t = fmaf((float)isum[1], dsc[1], (float)isum[0] * dsc[0]);
                total = fmaf(t, dx[(m0 + r) * nb + b], total);
            }
            acc_out[r * 32 + j] = total;
        }
}

#if QMM_VNNI
/* A sub-block's 4 code vectors (0..63) from its 3 tile vectors at t. 0xCA: a ? b : c. */
static inline void codes6_vnni(const uint8_t *t, __m512i w[4]) {
    const __m512i six = _mm512_set1_epi8(0x3F), m03 = _mm512_set1_epi8(0x03), m0f = _mm512_set1_epi8(0x0F);
    const __m512i a = _mm512_loadu_si512((const void *)t), b = _mm512_loadu_si512((const void *)(t + 64)),
                  c = _mm512_loadu_si512((const void *)(t + 128));
    w[0] = _mm512_and_si512(a, six);
    w[1] = _mm512_and_si512(b, six);
    w[2] = _mm512_and_si512(c, six);
    /* top bits of a, b, c to bits 0-1, 2-3, 4-5 (16-bit shifts: what crosses from the next byte is masked) */
    const __m512i ab = _mm512_ternarylogic_epi32(m03, _mm512_srli_epi16(a, 6), _mm512_srli_epi16(b, 4), 0xCA);
    w[3] = _mm512_and_si512(_mm512_ternarylogic_epi32(m0f, ab, _mm512_srli_epi16(c, 2), 0xCA), six);
}

/* d sc of 16 columns' two sub-blocks of block b. */
static inline void scales6_vnni(const int8_t *tsc, const uint16_t *td, int64_t nb, int64_t g, int64_t b, __m512 dsc[2]) {
    const __m512i pairs = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(tsc + (g * nb + b) * 32)));
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(td + (g * (nb / 8) + b / 8) * 16)));
    dsc[0] = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_slli_epi32(pairs, 16), 16)));
    dsc[1] = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_srai_epi32(pairs, 16)));
}

/* Column pair g's tiles into the scratch layout above. */
static void unpack6_vnni(const uint8_t *tiles, const int8_t *tsc, const uint16_t *td, int64_t nb, int64_t g, uint8_t *u) {
    for (int64_t b = 0; b < nb; b++) {
        uint8_t *ub = u + b * UNPACKED6;
        for (int cg = 0; cg < 2; cg++) {
            const uint8_t *t = tiles + ((g + cg) * nb + b) * Q6_VECS * 64;
            for (int s = 0; s < 2; s++) {
                __m512i w[4];
                codes6_vnni(t + s * 192, w);
                for (int v = 0; v < 4; v++) _mm512_storeu_si512((void *)(ub + cg * 512 + (4 * s + v) * 64), w[v]);
            }
            __m512 dsc[2];
            scales6_vnni(tsc, td, nb, g + cg, b, dsc);
            _mm512_storeu_ps((float *)(ub + 1024 + (cg * 2) * 64), dsc[0]);
            _mm512_storeu_ps((float *)(ub + 1024 + (cg * 2 + 1) * 64), dsc[1]);
        }
    }
}

/* The tile: one half of the pair (16 columns) a pass, so that a pass keeps one float accumulator per row and a
 * sub-block's 4 code vectors in registers; the codes from the scratch (u) or, `from_tiles`, unpacked from the
 * tiles in registers. */
static inline __attribute__((always_inline)) void gemm_tile6_vnni(const uint8_t *u, const uint8_t *tiles, const int8_t *tsc,
                                                                  int from_tiles, const uint16_t *td, int64_t nb, int64_t g,
                                                                  const uint8_t *xa, int64_t m0, int rows, float *acc_out,
                                                                  int64_t pf_g) {
    for (int cg = 0; cg < 2; cg++) {
        __m512 acc[GEMM_ROWS_MAX];
        for (int r = 0; r < rows; r++) acc[r] = _mm512_setzero_ps();
        for (int64_t b = 0; b < nb; b++) {
            if (pf_g >= 0) prefetch_block6(tiles, td, tsc, nb, pf_g + cg, b); /* the next pair's group */
            const uint8_t *ub = u + b * UNPACKED6;
            __m512 dsc[2];
            if (from_tiles) {
                scales6_vnni(tsc, td, nb, g + cg, b, dsc);
            } else {
                dsc[0] = _mm512_loadu_ps((const float *)(ub + 1024 + (cg * 2) * 64));
                dsc[1] = _mm512_loadu_ps((const float *)(ub + 1024 + (cg * 2 + 1) * 64));
            }
            __m512 t[GEMM_ROWS_MAX];
            for (int s = 0; s < 2; s++) {
                __m512i w[4];
                if (from_tiles)
                    codes6_vnni(tiles + ((g + cg) * nb + b) * Q6_VECS * 64 + s * 192, w);
                else
                    for (int v = 0; v < 4; v++) w[v] = _mm512_loadu_si512((const void *)(ub + cg * 512 + (4 * s + v) * 64));
                for (int r = 0; r < rows; r++) {
                    const uint8_t *rec = xa + ((m0 + r) * nb + b) * XA_BYTES;
                    const int32_t *x4 = (const int32_t *)(rec + s * 16);
                    __m512i ia = _mm512_set1_epi32(((const int32_t *)(rec + 32))[s]);
                    for (int v = 0; v < 4; v++) DPBUSD_BCAST(ia, w[v], x4[v]);
                    t[r] = s ? _mm512_fmadd_ps(_mm512_cvtepi32_ps(ia), dsc[1], t[r]) : _mm512_mul_ps(_mm512_cvtepi32_ps(ia), dsc[0]);
                }
            }
            for (int r = 0; r < rows; r++)
                FMADD_BCAST(acc[r], t[r], *(const float *)(xa + ((m0 + r) * nb + b) * XA_BYTES + 40));
        }
        for (int r = 0; r < rows; r++) _mm512_storeu_ps(acc_out + r * 32 + cg * 16, acc[r]);
    }
}
#define UNPACK6 unpack6_vnni
#define GEMM_TILE6 gemm_tile6_vnni
#endif

#if QMM_AVX2
/* 8 columns' code vectors of a sub-block (0..63) from its 3 tile vectors at t (32 bytes of each). */
static inline void codes6_avx2(const uint8_t *t, __m256i w[4]) {
    const __m256i six = _mm256_set1_epi8(0x3F);
    const __m256i a = _mm256_loadu_si256((const __m256i *)t), b = _mm256_loadu_si256((const __m256i *)(t + 64)),
                  c = _mm256_loadu_si256((const __m256i *)(t + 128));
    w[0] = _mm256_and_si256(a, six);
    w[1] = _mm256_and_si256(b, six);
    w[2] = _mm256_and_si256(c, six);
    w[3] = _mm256_or_si256(_mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(a, 6), _mm256_set1_epi8(0x03)),
                                           _mm256_and_si256(_mm256_srli_epi16(b, 4), _mm256_set1_epi8(0x0C))),
                           _mm256_and_si256(_mm256_srli_epi16(c, 2), _mm256_set1_epi8(0x30)));
}

/* d sc of 8 columns' (half hh of group g) two sub-blocks of block b. */
static inline void scales6_avx2(const int8_t *tsc, const uint16_t *td, int64_t nb, int64_t g, int hh, int64_t b, __m256 dsc[2]) {
    const __m256i pairs = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(tsc + (g * nb + b) * 32 + hh * 16)));
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(td + (g * (nb / 8) + b / 8) * 16 + hh * 8)));
    dsc[0] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_slli_epi32(pairs, 16), 16)));
    dsc[1] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_srai_epi32(pairs, 16)));
}

static void unpack6_avx2(const uint8_t *tiles, const int8_t *tsc, const uint16_t *td, int64_t nb, int64_t g, uint8_t *u) {
    for (int64_t b = 0; b < nb; b++) {
        uint8_t *ub = u + b * UNPACKED6;
        for (int cg = 0; cg < 2; cg++)
            for (int hh = 0; hh < 2; hh++) {
                const uint8_t *t = tiles + ((g + cg) * nb + b) * Q6_VECS * 64 + hh * 32;
                for (int s = 0; s < 2; s++) {
                    __m256i w[4];
                    codes6_avx2(t + s * 192, w);
                    for (int v = 0; v < 4; v++) _mm256_storeu_si256((__m256i *)(ub + cg * 512 + (4 * s + v) * 64 + hh * 32), w[v]);
                }
                __m256 dsc[2];
                scales6_avx2(tsc, td, nb, g + cg, hh, b, dsc);
                _mm256_storeu_ps((float *)(ub + 1024 + (cg * 2) * 64 + hh * 32), dsc[0]);
                _mm256_storeu_ps((float *)(ub + 1024 + (cg * 2 + 1) * 64 + hh * 32), dsc[1]);
            }
    }
}

/* The tile with AVX2: 8 columns a pass. A row's 4-input pair sums (vpmaddubsw: codes 0..63 unsigned, so no
 * pair saturates: 2 x 63 x 127) of two code vectors add up in 16 bits (at most 32,004) before vpmaddwd takes
 * them to 32 bits. Codes from the scratch or, `from_tiles`, unpacked in registers. */
static inline __attribute__((always_inline)) void gemm_tile6_avx2(const uint8_t *u, const uint8_t *tiles, const int8_t *tsc,
                                                                  int from_tiles, const uint16_t *td, int64_t nb, int64_t g,
                                                                  const uint8_t *xa, int64_t m0, int rows, float *acc_out,
                                                                  int64_t pf_g) {
    (void)pf_g; /* one row from the tiles takes gemm_row1_6_avx2, which prefetches */
    const __m256i ones = _mm256_set1_epi16(1);
    for (int q = 0; q < 4; q++) {
        const int cg = q / 2, hh = q % 2;
        __m256 acc[GEMM_ROWS_MAX];
        for (int r = 0; r < rows; r++) acc[r] = _mm256_setzero_ps();
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *ub = u + b * UNPACKED6;
            __m256 dsc[2];
            if (from_tiles) {
                scales6_avx2(tsc, td, nb, g + cg, hh, b, dsc);
            } else {
                dsc[0] = _mm256_loadu_ps((const float *)(ub + 1024 + (cg * 2) * 64 + hh * 32));
                dsc[1] = _mm256_loadu_ps((const float *)(ub + 1024 + (cg * 2 + 1) * 64 + hh * 32));
            }
            __m256 t[GEMM_ROWS_MAX];
            for (int s = 0; s < 2; s++) {
                __m256i w[4];
                if (from_tiles)
                    codes6_avx2(tiles + ((g + cg) * nb + b) * Q6_VECS * 64 + s * 192 + hh * 32, w);
                else
                    for (int v = 0; v < 4; v++) w[v] = _mm256_loadu_si256((const __m256i *)(ub + cg * 512 + (4 * s + v) * 64 + hh * 32));
                for (int r = 0; r < rows; r++) {
                    const uint8_t *rec = xa + ((m0 + r) * nb + b) * XA_BYTES;
                    __m256i ia = _mm256_set1_epi32(((const int32_t *)(rec + 32))[s]);
                    for (int v = 0; v < 4; v += 2) {
                        int32_t x0, x1;
                        memcpy(&x0, rec + (4 * s + v) * 4, sizeof x0);
                        memcpy(&x1, rec + (4 * s + v) * 4 + 4, sizeof x1);
                        const __m256i pair = _mm256_add_epi16(_mm256_maddubs_epi16(w[v], _mm256_set1_epi32(x0)),
                                                              _mm256_maddubs_epi16(w[v + 1], _mm256_set1_epi32(x1)));
                        ia = _mm256_add_epi32(ia, _mm256_madd_epi16(pair, ones));
                    }
                    t[r] = s ? _mm256_fmadd_ps(_mm256_cvtepi32_ps(ia), dsc[1], t[r]) : _mm256_mul_ps(_mm256_cvtepi32_ps(ia), dsc[0]);
                }
            }
            for (int r = 0; r < rows; r++)
                acc[r] = _mm256_fmadd_ps(t[r], _mm256_broadcast_ss((const float *)(xa + ((m0 + r) * nb + b) * XA_BYTES + 40)), acc[r]);
        }
        for (int r = 0; r < rows; r++) _mm256_storeu_ps(acc_out + r * 32 + q * 8, acc[r]);
    }
}

/* One row from the tiles (a single stream's decode): the pair's four quarters in one pass over the blocks, as
 * gemm_row1_avx2 does for the 4- and 8-bit tiles; the same operations per column as gemm_tile6_avx2 with one
 * row, in the same order: the same bits. */
static inline __attribute__((always_inline)) void gemm_row1_6_avx2(const uint8_t *tiles, const int8_t *tsc,
                                                                   const uint16_t *td, int64_t nb, int64_t g,
                                                                   const uint8_t *xa, float *acc_out, int64_t pf_g) {
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 acc[4];
    for (int q = 0; q < 4; q++) acc[q] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        if (pf_g >= 0) /* the next pair's block */
            for (int64_t pg = pf_g; pg < pf_g + 2; pg++) prefetch_block6(tiles, td, tsc, nb, pg, b);
        const uint8_t *rec = xa + b * XA_BYTES;
        int32_t xv[8], neg[2];
        memcpy(xv, rec, sizeof xv);
        memcpy(neg, rec + 32, sizeof neg);
        const __m256 dxb = _mm256_broadcast_ss((const float *)(rec + 40));
        for (int q = 0; q < 4; q++) {
            const int cg = q / 2, hh = q % 2;
            __m256 dsc[2], t = _mm256_setzero_ps();
            scales6_avx2(tsc, td, nb, g + cg, hh, b, dsc);
            for (int s = 0; s < 2; s++) {
                __m256i w[4];
                codes6_avx2(tiles + ((g + cg) * nb + b) * Q6_VECS * 64 + s * 192 + hh * 32, w);
                __m256i ia = _mm256_set1_epi32(neg[s]);
                for (int v = 0; v < 4; v += 2) {
                    const __m256i pair = _mm256_add_epi16(_mm256_maddubs_epi16(w[v], _mm256_set1_epi32(xv[4 * s + v])),
                                                          _mm256_maddubs_epi16(w[v + 1], _mm256_set1_epi32(xv[4 * s + v + 1])));
                    ia = _mm256_add_epi32(ia, _mm256_madd_epi16(pair, ones));
                }
                t = s ? _mm256_fmadd_ps(_mm256_cvtepi32_ps(ia), dsc[1], t) : _mm256_mul_ps(_mm256_cvtepi32_ps(ia), dsc[0]);
            }
            acc[q] = _mm256_fmadd_ps(t, dxb, acc[q]);
        }
    }
    for (int q = 0; q < 4; q++) _mm256_storeu_ps(acc_out + q * 8, acc[q]);
}
#define UNPACK6 unpack6_avx2
#define GEMM_TILE6 gemm_tile6_avx2
#endif

/* gemm_pair for 6-bit tiles: with more rows than one tile takes, the pair (and with `silu` its up pair)
 * unpacked once into `scratch` and each row group multiplied from there; else unpacked in registers. */
static inline void gemm_pair6(const uint8_t *tiles, const uint16_t *td, const int8_t *tsc, int64_t nb, int64_t g, int64_t N,
                              const int8_t *xq, const float *dx, const uint8_t *xa, int64_t K, int64_t mc,
                              int64_t mend, int step, float *tile, void *out, int64_t ldo, int out_bf16, int portable,
                              int silu, uint8_t *scratch) {
    const int groups = (int)((mend - mc + step - 1) / step);
    const int64_t up = g + N / 32;
#if QMM_VNNI || QMM_AVX2
    const int from_tiles = groups == 1;
    if (!portable && !from_tiles)
        for (int part = 0; part <= silu; part++) UNPACK6(tiles, tsc, td, nb, part ? up : g, scratch + part * nb * UNPACKED6);
#else
    (void)xa, (void)scratch;
#endif
    const int64_t base_rows = (mend - mc) / groups, extra = (mend - mc) % groups;
    for (int64_t gi = 0, m0 = mc; gi < groups; gi++) {
        const int rows = (int)(base_rows + (gi < extra));
        for (int part = 0; part <= silu; part++) {
            const int64_t gg = part ? up : g;
            float *t = tile + part * GEMM_ROWS_MAX * 32;
#if QMM_VNNI || QMM_AVX2
            const uint8_t *u = scratch + part * nb * UNPACKED6;
            /* one row from the tiles (decode): the next pair prefetched as this one is read */
            const int64_t pf_g =
                from_tiles && rows == 1 && gg + 2 < (silu && !part ? N / 32 : N / 16) ? gg + 2 : -1;
#define TILE6(F, R) GEMM_TILE6(u, tiles, tsc, F, td, nb, gg, xa, m0, R, t, pf_g)
#define TILE6_ROWS(F)                                                                                             \
    switch (rows) {                                                                                               \
    case 6: TILE6(F, GEMM_ROWS_6BIT > 5 ? 6 : 1); break;                                                          \
    case 5: TILE6(F, GEMM_ROWS_6BIT > 4 ? 5 : 1); break;                                                          \
    case 4: TILE6(F, 4); break;                                                                                   \
    case 3: TILE6(F, 3); break;                                                                                   \
    case 2: TILE6(F, 2); break;                                                                                   \
    default: TILE6(F, 1); break;                                                                                  \
    }
            if (!portable) {
#if QMM_AVX2
                if (from_tiles && rows == 1)
                    gemm_row1_6_avx2(tiles, tsc, td, nb, gg, xa + m0 * nb * XA_BYTES, t, pf_g);
                else
#endif
                if (from_tiles) {
                    TILE6_ROWS(1)
                } else {
                    TILE6_ROWS(0)
                }
            } else
#undef TILE6_ROWS
#undef TILE6
#endif
                gemm_tile6_portable(tiles, td, tsc, nb, gg, xq, dx, K, m0, rows, t);
        }
        store_tile_rows(tile, rows, m0, g, ldo, silu, out, out_bf16);
        m0 += rows;
    }
}

/* The column pairs are shared out in shrinking chunks (guided) where all rows fit one chunk (decode): a
 * thread that the OS takes away mid-call (the server's event loop and its clients share the cores) then
 * leaves its pairs to the other instead of holding up the call. Bigger calls (prefill) keep a static split,
 * so that each thread finds its pairs' weights in its own L2 for every chunk of rows.
 * `python -m tests.bench serve` measures it (HTTP against the offline engine).
 * `silu`: the weight is a fused [gate; up] (N = 2 I, I % 32 == 0) and out [M, I] receives SiLU(gate) x up,
 * rounded as the layer ops' silu_mul rounds it after this kernel's plain output: the same values without
 * writing and reading back the M x 2I intermediate. bits 6: the 6-bit tiles (gemm_pair6), K % 256 == 0.
 * `ldo`: elements from one output row to the next (<= 0: the rows' width, N or N / 2 with silu), so that the
 * parts of a projection stacked from matrices of different kinds write their columns of one output. */
void quantized_gemm(const void *x, int x_bf16, int64_t M, int64_t K, const uint8_t *tiles, const uint16_t *tscale,
                    const uint16_t *toffset, int64_t N, int bits, void *out, int64_t ldo, int out_bf16, int silu,
                    int portable, int num_threads) {
    CHECK(M >= 0, M);
    CHECK(K > 0 && K % QBLOCK == 0, K);
    CHECK(N > 0, N);
    CHECK(bits == 4 || bits == 5 || bits == 6 || bits == 8 || kquant(bits), bits);
    CHECK((bits != 6 && !kquant(bits)) || K % 256 == 0, K);
    CHECK(num_threads > 0, num_threads);
    CHECK_PTR(x, M);
    CHECK_PTR(out, M);
    CHECK(!silu || N % (2 * QBLOCK) == 0, N);
    if (ldo <= 0) ldo = silu ? N / 2 : N;
    CHECK(ldo >= (silu ? N / 2 : N), ldo);
    CHECK_PTR(tiles, 1);
    CHECK_PTR(tscale, 1);
    if (bits != 4 && bits != 5 && bits != 8) CHECK_PTR(toffset, 1); /* NULL: a symmetric type (symmetric_offset) */
    const int64_t nb = K / QBLOCK;
    int8_t *xq = (int8_t *)malloc((size_t)(M * K));
    float *dx = (float *)malloc(sizeof(float) * (size_t)(M * nb));
    float *sx = (float *)malloc(sizeof(float) * (size_t)(M * nb));
    int32_t *xs = (int32_t *)malloc(sizeof(int32_t) * (size_t)(M * nb));
    /* bits 6: the vector tiles' activation records (gemm_pair6) */
    uint8_t *xa = bits == 6 ? (uint8_t *)malloc((size_t)(M * nb * XA_BYTES)) : NULL;
    const size_t elem = x_bf16 ? 2 : 4;
    _Pragma("omp parallel num_threads(num_threads)")
    {
        _Pragma("omp for schedule(static)")
        for (int64_t m = 0; m < M; m++) {
            quantize_row((const char *)x + m * K * elem, x_bf16, K, xq + m * K, dx + m * nb, sx + m * nb,
                         xs + m * nb, portable);
            if (xa)
                for (int64_t b = 0; b < nb; b++) {
                    uint8_t *rec = xa + (m * nb + b) * XA_BYTES;
                    memcpy(rec, xq + m * K + b * QBLOCK, QBLOCK);
                    for (int s = 0; s < 2; s++) {
                        int32_t n32 = 0;
                        for (int i = 0; i < 16; i++) n32 -= 32 * xq[m * K + b * QBLOCK + s * 16 + i];
                        memcpy(rec + 32 + 4 * s, &n32, 4);
                    }
                    memcpy(rec + 40, dx + m * nb + b, 4);
                }
        }
        float tile[2 * GEMM_ROWS_MAX * 32];
        const int step = bits == 6 ? GEMM_ROWS_6BIT : gemm_rows(bits);
        const int64_t pairs_end = silu ? N / 32 : N / 16; /* silu: the gate pairs */
        /* the 6-bit tiles' unpacked pair (two with silu), per thread */
        uint8_t *scratch = bits == 6 && !portable && quantized_matmul_vectorized()
                               ? (uint8_t *)malloc((size_t)(nb * UNPACKED6 * (1 + silu)))
                               : NULL;
        /* the K-quant pairs' block scales (pair_scales), per thread */
        float *ksc = kquant(bits) && !portable && quantized_matmul_vectorized()
                         ? (float *)malloc(sizeof(float) * (size_t)(nb * 64 * (1 + silu)))
                         : NULL;
#define PAIR(MC, MEND)                                                                                            \
    do {                                                                                                          \
        if (bits == 6)                                                                                            \
            gemm_pair6(tiles, tscale, (const int8_t *)toffset, nb, g, N, xq, dx, xa, K, MC, MEND, step, tile, out, \
                       ldo, out_bf16, portable, silu, scratch);                                                        \
        else                                                                                                      \
            gemm_pair(tiles, tscale, toffset, nb, bits, g, N, xq, dx, sx, xs, K, MC, MEND, step, tile, out,         \
                      ldo, out_bf16, portable, silu, ksc);                                                         \
    } while (0)
        if (M <= GEMM_CHUNK) {
            _Pragma("omp for schedule(guided)")
            for (int64_t g = 0; g < pairs_end; g += 2)
                PAIR(0, M);
        } else {
            for (int64_t mc = 0; mc < M; mc += GEMM_CHUNK) {
                const int64_t mend = mc + GEMM_CHUNK < M ? mc + GEMM_CHUNK : M;
                _Pragma("omp for schedule(static)")
                for (int64_t g = 0; g < pairs_end; g += 2)
                    PAIR(mc, mend);
            }
        }
#undef PAIR
        free(scratch);
        free(ksc);
    }
    free(xq);
    free(dx);
    free(sx);
    free(xs);
    free(xa);
}

/* Which vector loops this build multiplies with: 2 AVX-512 VNNI, 1 AVX2 + FMA + F16C, 0 none (the portable
 * loops only). */
int quantized_matmul_vectorized(void) { return QMM_VNNI ? 2 : QMM_AVX2 ? 1 : 0; }

/* Rows ids[0..R) of a weight held only in the tiles, as float32 [R][K] (an embedding lookup from a tied LM
 * head's tiles, kernels/quantized_matmul.py, NativeMatmul.dequantize_rows): each weight as the portable loops
 * read it, w = d * code + o (bits 4, 5, 8, KQ4, KQ5; block_scale's d and o) or (d * sc) * (q - 32) (bits 6), one
 * rounding per product and per sum (never fused: the torch expression it replaces rounds each). */
#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")
void quantized_tiles_rows(const uint8_t *tiles, const uint16_t *tscale, const uint16_t *toffset, int64_t K, int bits,
                          const int64_t *ids, int64_t R, float *out, int num_threads) {
    const int64_t nb = K / QBLOCK;
#pragma omp parallel for num_threads(threads_for(R * K, num_threads)) schedule(static)
    for (int64_t r = 0; r < R; r++) {
        const int64_t n = ids[r], gg = n / 16;
        const int col = (int)(n % 16);
        float *y = out + r * K;
        for (int64_t b = 0; b < nb; b++, y += QBLOCK) {
            if (bits == 6) {
                const int8_t *sc = (const int8_t *)toffset + ((gg * nb + b) * 16 + col) * 2;
                const float d = f16_to_f32(tscale[(gg * (K / 256) + b / 8) * 16 + col]);
                for (int s = 0; s < 2; s++) {
                    const float step = d * (float)sc[s];
                    for (int i = 0; i < 16; i++)
                        y[s * 16 + i] = step * (float)(tiled_code6(tiles, nb, n, b * QBLOCK + s * 16 + i) - 32);
                }
            } else {
                float d, o;
                block_scale(tscale, toffset, bits, nb, gg, b, col, &d, &o);
                for (int i = 0; i < QBLOCK; i++) {
                    const float p = (float)tiled_code(tiles, nb, bits, n, b * QBLOCK + i) * d;
                    y[i] = p + o;
                }
            }
        }
    }
}
#pragma GCC pop_options
