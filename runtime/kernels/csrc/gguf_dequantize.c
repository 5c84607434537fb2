/* GGUF blocks straight from the file's bytes to float32 rows: the dense path of a load (--dtype float32 or
 * bfloat16 with quantization none, int8, int4), one pass over a matrix's bytes, parallel over rows, with no
 * parsed copy in between. Bit for bit ggml's de-quantization (and runtime/quant/gguf_blocks.py's): each weight
 * is one float32 product, plus one float32 sum for the kinds with a minimum, never fused into one rounding.
 *
 * kind (GGUF_DQ_* below). Output row r (of N, K floats each, dst + r * K) reads the file's row rows[r] (rows
 * NULL: row r), row_bytes apart. */
#include <stdint.h>
#include <string.h>

#include "f16.h"
#include "gguf_block.h"
#include "kernels.h"

/* s * q + m in two roundings: a fused multiply-add would round once and differ from ggml in the last bit. GCC
 * fuses across statements where the target has FMA unless told not to; clang fuses only within one expression. */
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC optimize("fp-contract=off")
#endif

#define GGUF_DQ_Q4_0 0
#define GGUF_DQ_Q4_1 1
#define GGUF_DQ_Q5_0 2
#define GGUF_DQ_Q5_1 3
#define GGUF_DQ_Q8_0 4
#define GGUF_DQ_Q4_K 5
#define GGUF_DQ_Q5_K 6
#define GGUF_DQ_Q6_K 7

static inline float half_at(const uint8_t *p) { return f16_to_f32(load_half(p)); }

static inline float affine(float s, float q, float m) {
    const float p = s * q;
    return p + m;
}

static void row_q4_0_q4_1(const uint8_t *b, int64_t nb, float *y, int with_min) {
    const size_t bytes = with_min ? 20 : 18;
    for (int64_t i = 0; i < nb; i++, b += bytes, y += 32) {
        const float d = half_at(b);
        if (with_min) {
            const float m = half_at(b + 2);
            const uint8_t *q = b + 4;
            for (int j = 0; j < 16; j++) y[j] = affine(d, (float)(q[j] & 15), m);
            for (int j = 0; j < 16; j++) y[j + 16] = affine(d, (float)(q[j] >> 4), m);
        } else {
            const uint8_t *q = b + 2;
            for (int j = 0; j < 16; j++) y[j] = d * (float)((q[j] & 15) - 8);
            for (int j = 0; j < 16; j++) y[j + 16] = d * (float)((q[j] >> 4) - 8);
        }
    }
}

static void row_q5_0_q5_1(const uint8_t *b, int64_t nb, float *y, int with_min) {
    const size_t bytes = with_min ? 24 : 22;
    for (int64_t i = 0; i < nb; i++, b += bytes, y += 32) {
        const float d = half_at(b), m = with_min ? half_at(b + 2) : 0.0f;
        const uint8_t *at = b + (with_min ? 4 : 2);
        uint32_t qh;
        memcpy(&qh, at, sizeof qh);
        const uint8_t *q = at + 4;
        for (int j = 0; j < 16; j++) {
            const int lo = (q[j] & 15) | (((qh >> j) & 1) << 4), hi = (q[j] >> 4) | (((qh >> (j + 16)) & 1) << 4);
            if (with_min) {
                y[j] = affine(d, (float)lo, m);
                y[j + 16] = affine(d, (float)hi, m);
            } else {
                y[j] = d * (float)(lo - 16);
                y[j + 16] = d * (float)(hi - 16);
            }
        }
    }
}

static void row_q8_0(const uint8_t *b, int64_t nb, float *y) {
    for (int64_t i = 0; i < nb; i++, b += 34, y += 32) {
        const float d = half_at(b);
        const int8_t *q = (const int8_t *)(b + 2);
        for (int j = 0; j < 32; j++) y[j] = d * (float)q[j];
    }
}

/* Q4_K: d, dmin, scales[12], qs[128]; Q5_K: the same, then qh[32] before qs. Sub-block j's element l: the
 * low (j even) or high nibble of qs[32 (j / 2) + l], and for Q5_K bit j of qh[l] as its fifth bit. */
static void row_k4_k5(const uint8_t *b, int64_t ns, float *y, int five) {
    const size_t bytes = five ? 176 : 144;
    for (int64_t i = 0; i < ns; i++, b += bytes, y += 256) {
        const float d = half_at(b), dmin = half_at(b + 2);
        uint8_t sc[8], m[8];
        k_scales(b + 4, sc, m);
        const uint8_t *qh = b + 16, *qs = b + (five ? 48 : 16);
        for (int j = 0; j < 8; j++) {
            const float s = d * (float)sc[j], mn = -(dmin * (float)m[j]);
            const uint8_t *q = qs + 32 * (j / 2);
            for (int l = 0; l < 32; l++) {
                int code = j & 1 ? q[l] >> 4 : q[l] & 15;
                if (five) code |= ((qh[l] >> j) & 1) << 4;
                y[32 * j + l] = affine(s, (float)code, mn);
            }
        }
    }
}

/* Q6_K: ql[128], qh[64], scales[16] (int8, one per 16 elements), d. Half h, run r, element l (position
 * 128 h + 32 r + l): low 4 bits from ql[64 h + 32 (r & 1) + l] (high nibble for r >= 2), top 2 bits
 * (qh[32 h + l] >> 2 r) & 3; the weight is d sc * (code - 32). */
static void row_q6_k(const uint8_t *b, int64_t ns, float *y) {
    for (int64_t i = 0; i < ns; i++, b += 210, y += 256) {
        const float d = half_at(b + 208);
        const int8_t *scales = (const int8_t *)(b + 192);
        for (int h = 0; h < 2; h++) {
            const uint8_t *ql = b + 64 * h, *qh = b + 128 + 32 * h;
            for (int r = 0; r < 4; r++) {
                for (int l = 0; l < 32; l++) {
                    const int pos = 128 * h + 32 * r + l;
                    const uint8_t low = r < 2 ? ql[32 * r + l] & 15 : ql[32 * (r - 2) + l] >> 4;
                    const int code = low | (((qh[l] >> (2 * r)) & 3) << 4);
                    const float s = d * (float)scales[pos / 16];
                    y[pos] = s * (float)(code - 32);
                }
            }
        }
    }
}

int gguf_dequantize(int kind, const uint8_t *src, int64_t row_bytes, const int64_t *rows, int64_t N, int64_t K,
                    float *dst, int num_threads) {
    if (kind < GGUF_DQ_Q4_0 || kind > GGUF_DQ_Q6_K) return -1;
    if (K % (kind >= GGUF_DQ_Q4_K ? 256 : 32)) return -1;
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t r = 0; r < N; r++) {
        const uint8_t *b = src + (rows ? rows[r] : r) * row_bytes;
        float *y = dst + r * K;
        switch (kind) {
        case GGUF_DQ_Q4_0: row_q4_0_q4_1(b, K / 32, y, 0); break;
        case GGUF_DQ_Q4_1: row_q4_0_q4_1(b, K / 32, y, 1); break;
        case GGUF_DQ_Q5_0: row_q5_0_q5_1(b, K / 32, y, 0); break;
        case GGUF_DQ_Q5_1: row_q5_0_q5_1(b, K / 32, y, 1); break;
        case GGUF_DQ_Q8_0: row_q8_0(b, K / 32, y); break;
        case GGUF_DQ_Q4_K: row_k4_k5(b, K / 256, y, 0); break;
        case GGUF_DQ_Q5_K: row_k4_k5(b, K / 256, y, 1); break;
        default: row_q6_k(b, K / 256, y); break;
        }
    }
    return 0;
}
