/* GGUF blocks straight from the file's bytes into the many-row kernel's tiles (csrc/quantized_matmul.c's
 * layouts, runtime/kernels/quantized_matmul.py says which), each group of 16 output rows by one thread, with no
 * copy in between: the load's only pass over a matrix's bytes.
 *
 * kind (GGUF_* below) and its buffers, g = N / 16 tile groups, nb = K / 32 blocks, ns = K / 256 super-blocks:
 *   Q4_0  tiles [g, nb, 4, 16, 4] 4-bit, scale [g, nb, 16] float16: d; offset NULL (the kernels form -8 d;
 *         given, it gets -8 d as float16)
 *   Q4_1  as Q4_0, offset [g, nb, 16] float16: the block's minimum m
 *   Q5_0  tiles [g, nb, 5, 16, 4]: the low 4 bits of the codes as Q4_0's, then the plane of their fifth bits
 *         (as Q5_K's below), scale as Q4_0's, offset NULL (the kernels form -16 d; given, it gets -16 d)
 *   Q5_1  as Q5_0, offset [g, nb, 16] float16: the block's minimum m
 *   Q8_0  tiles [g, nb, 8, 16, 4] codes q + 128, scale as Q4_0's, offset NULL (-128 d) or as Q4_0's
 *   Q4_K  tiles [g, nb, 4, 16, 4] 4-bit, scale [g, nb, 2, 16] uint8: sc | m, offset [g, ns, 2, 16] float16:
 *         d | dmin (sc 0 where d is 0, m 0 where dmin is 0)
 *   Q5_K  as Q4_K, tiles [g, nb, 5, 16, 4]: the low 4 bits of the codes as Q4_K's, then the plane of their
 *         fifth bits (byte 4j + i, bit t: input 4t + i of column j)
 *   Q6_K  tiles [g, nb, 6, 64] 6-bit, scale [g, ns, 16] float16: d, offset [g, nb, 16, 2] int8: sc (0 where d
 *         is 0)
 * 4-bit tiles: vector v of a block holds per column the codes of inputs 8v..8v+3 in its low nibbles and
 * 8v+4..8v+7 in its high ones; 8-bit: inputs 4v..4v+3; 6-bit: vector 3s+i holds code vector 4s+i (inputs
 * 4(4s+i)..+3) in its low 6 bits and 2 bits of code vector 4s+3 in its top 2.
 * Output row r reads the file's row rows[r] (rows NULL: row r), row_bytes apart. Returns how many of the
 * scales and offsets the other layouts' float16 could not hold (runtime/quant/gguf_blocks.py, fits_float16:
 * |value| above 65504 / 128 for Q8_0 and Q6_K, 65504 / 32 for the others, or not finite); the caller then
 * takes another path. */
#include <stdint.h>
#include <string.h>

#include "f16.h"
#include "gguf_block.h"
#include "kernels.h"

#define TILE 16
#define GGUF_Q4_0 0
#define GGUF_Q8_0 1
#define GGUF_Q5_K 2
#define GGUF_Q4_K 3
#define GGUF_Q6_K 4
#define GGUF_Q4_1 5
#define GGUF_Q5_0 6
#define GGUF_Q5_1 7

static inline int outside(float v, float limit) { return !(v <= limit && v >= -limit); }

/* Four bytes at a time (little-endian loads and stores, as on every target the kernels build for): a tile's
 * vector holds 4 bytes per column, and the file's bytes for them lie next to each other. */
static inline uint32_t load4(const uint8_t *p) {
    uint32_t v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline void store4(uint8_t *p, uint32_t v) { memcpy(p, &v, sizeof v); }

#define LOW4 0x0f0f0f0fu

/* 4-bit vector v of a block of 32 whose codes are nibbles of q[0..31] (q's low nibbles where `high` is 0):
 * inputs 8v..8v+3 from q[8v..8v+3] into the low nibbles, 8v+4..8v+7 from q[8v+4..8v+7] into the high ones */
static inline uint32_t nibble_vector(const uint8_t *q, int v, int high) {
    const uint32_t a = load4(q + 8 * v), b = load4(q + 8 * v + 4);
    return high ? ((a >> 4) & LOW4) | (b & ~LOW4) : (a & LOW4) | ((b & LOW4) << 4);
}

static int64_t group_q4_0_q8_0(int kind, const uint8_t *row, int c, int64_t nb, uint8_t *tiles, uint16_t *scale,
                               uint16_t *offset) {
    const int eight = kind == GGUF_Q8_0, with_min = kind == GGUF_Q4_1 || kind == GGUF_Q5_1;
    const int five = kind == GGUF_Q5_0 || kind == GGUF_Q5_1;
    /* Q5_0 / Q5_1: d (and m), then qh, the codes' fifth bits (bit e: input e's), then the nibbles as Q4_0's */
    const size_t bytes = eight ? 34 : (with_min ? 20 : 18) + (five ? 4 : 0), vec = eight ? 512 : five ? 320 : 256;
    const size_t qh = with_min ? 4 : 2, codes = qh + (five ? 4 : 0);
    const float limit = 65504.0f / (eight ? 128 : 32), factor = eight ? -128.0f : five ? -16.0f : -8.0f;
    int64_t bad = 0;
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *p = row + b * bytes;
        const uint16_t d = load_half(p);
        const float df = f16_to_f32(d);
        bad += outside(df, limit);
        scale[b * TILE + c] = d;
        if (with_min) {
            const uint16_t m = load_half(p + 2);
            bad += outside(f16_to_f32(m), limit);
            offset[b * TILE + c] = m;
        } else if (offset) { /* NULL: the kernels form the symmetric offset themselves */
            offset[b * TILE + c] = f32_to_f16(df * factor);
        }
        uint8_t *block = tiles + b * vec + c * 4;
        if (eight) {
            for (int v = 0; v < 8; v++) store4(block + v * 64, load4(p + 2 + 4 * v) ^ 0x80808080u);
        } else { /* inputs 0..15 are qs[0..15]'s low nibbles, 16..31 their high ones */
            for (int v = 0; v < 4; v++) store4(block + v * 64, nibble_vector(p + codes, v & 1, v >> 1));
            if (five) { /* the plane's byte i, bit t: the fifth bit of input 4t + i */
                const uint32_t h = load4(p + qh);
                uint32_t plane = 0;
                for (int i = 0; i < 4; i++)
                    for (int t = 0; t < 8; t++) plane |= ((h >> (4 * t + i)) & 1u) << (8 * i + t);
                store4(block + 4 * 64, plane);
            }
        }
    }
    return bad;
}

/* Q4_K (five 0) and Q5_K (five 1): their super-blocks share d, dmin and the 12 bytes of sc and m; Q5_K's then
 * hold qh[32] (bit j of qh[l]: the fifth bit of sub-block j's element l) before qs. */
static int64_t group_q4_k_q5_k(int five, const uint8_t *row, int c, int64_t ns, uint8_t *tiles, uint8_t *scm,
                               uint16_t *dd) {
    const float limit = 65504.0f / 32;
    const int vecs = five ? 5 : 4;
    int64_t bad = 0;
    uint8_t sc[8], m[8];
    for (int64_t s = 0; s < ns; s++) {
        const uint8_t *p = row + s * (five ? 176 : 144), *qh = p + 16, *qs = p + (five ? 48 : 16);
        const uint16_t dh = load_half(p), dminh = load_half(p + 2);
        const float d = f16_to_f32(dh), dmin = f16_to_f32(dminh);
        k_scales(p + 4, sc, m);
        dd[(s * 2) * TILE + c] = dh;
        dd[(s * 2 + 1) * TILE + c] = dminh;
        for (int j = 0; j < 8; j++) {
            const int64_t b = s * 8 + j;
            bad += outside(d * (float)sc[j], limit) + outside(-(dmin * (float)m[j]), limit);
            scm[(b * 2) * TILE + c] = d == 0.0f ? 0 : sc[j];
            scm[(b * 2 + 1) * TILE + c] = dmin == 0.0f ? 0 : m[j];
            /* sub-block j: the low (j even) or high nibbles of qs[32 (j / 2) ..] */
            uint8_t *block = tiles + b * vecs * 64 + c * 4;
            for (int v = 0; v < 4; v++) store4(block + v * 64, nibble_vector(qs + 32 * (j / 2), v, j & 1));
            if (five) { /* the plane's byte i, bit t: the fifth bit of element 4t + i, bit j of qh[4t + i] */
                uint32_t plane = 0;
                for (int t = 0; t < 8; t++) plane |= ((load4(qh + 4 * t) >> j) & 0x01010101u) << t;
                store4(block + 4 * 64, plane);
            }
        }
    }
    return bad;
}

static int64_t group_q6_k(const uint8_t *row, int c, int64_t ns, uint8_t *tiles, uint16_t *td, int8_t *tsc) {
    const float limit = 65504.0f / 128;
    const uint32_t two = 0x03030303u;
    int64_t bad = 0;
    uint8_t code[256];
    for (int64_t s = 0; s < ns; s++) {
        const uint8_t *p = row + s * 210, *ql = p, *qh = p + 128;
        const int8_t *sc = (const int8_t *)(p + 192);
        const uint16_t dh = load_half(p + 208);
        const float d = f16_to_f32(dh);
        td[s * TILE + c] = dh;
        /* half h, run r, element l: the low (r < 2) or high nibble of ql[64 h + 32 (r & 1) + l], bits 2r, 2r+1 of
         * qh[32 h + l] above it */
        for (int h = 0; h < 2; h++)
            for (int l = 0; l < 32; l += 4) {
                const uint32_t a = load4(ql + 64 * h + l), b = load4(ql + 64 * h + 32 + l), hi = load4(qh + 32 * h + l);
                uint8_t *o = code + 128 * h + l;
                store4(o, (a & LOW4) | ((hi & two) << 4));
                store4(o + 32, (b & LOW4) | (((hi >> 2) & two) << 4));
                store4(o + 64, ((a >> 4) & LOW4) | (((hi >> 4) & two) << 4));
                store4(o + 96, ((b >> 4) & LOW4) | (((hi >> 6) & two) << 4));
            }
        for (int i = 0; i < 16; i++) {
            bad += outside(d * (float)sc[i], limit);
            tsc[((s * 8 + i / 2) * TILE + c) * 2 + (i & 1)] = d == 0.0f ? 0 : sc[i];
        }
        for (int j = 0; j < 8; j++) {
            const uint8_t *q = code + 32 * j;
            uint8_t *block = tiles + (s * 8 + j) * 384 + c * 4;
            for (int h = 0; h < 2; h++) {
                const uint32_t last = load4(q + 16 * h + 12);
                for (int i = 0; i < 3; i++)
                    store4(block + (3 * h + i) * 64, load4(q + 16 * h + 4 * i) | (((last >> (2 * i)) & two) << 6));
            }
        }
    }
    return bad;
}

int64_t gguf_relayout(int kind, const uint8_t *src, int64_t row_bytes, const int64_t *rows, int64_t N, int64_t K,
                      void *tiles, void *scale, void *offset, int num_threads) {
    const int64_t groups = N / TILE, nb = K / 32, ns = K / 256;
    const int64_t vec = kind == GGUF_Q6_K   ? 384
                        : (kind == GGUF_Q5_K || kind == GGUF_Q5_0 || kind == GGUF_Q5_1) ? 320
                        : (kind == GGUF_Q4_0 || kind == GGUF_Q4_1 || kind == GGUF_Q4_K) ? 256
                                                                                         : 512;
    int64_t bad = 0;
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads) reduction(+ : bad)
    for (int64_t t = 0; t < groups; t++) {
        uint8_t *tile = (uint8_t *)tiles + t * nb * vec;
        for (int c = 0; c < TILE; c++) {
            const int64_t r = rows ? rows[t * TILE + c] : t * TILE + c;
            const uint8_t *row = src + r * row_bytes;
            switch (kind) {
            case GGUF_Q4_0:
            case GGUF_Q4_1:
            case GGUF_Q5_0:
            case GGUF_Q5_1:
            case GGUF_Q8_0:
                bad += group_q4_0_q8_0(kind, row, c, nb, tile, (uint16_t *)scale + t * nb * TILE,
                                       offset ? (uint16_t *)offset + t * nb * TILE : NULL);
                break;
            case GGUF_Q4_K:
            case GGUF_Q5_K:
                bad += group_q4_k_q5_k(kind == GGUF_Q5_K, row, c, ns, tile, (uint8_t *)scale + t * nb * 2 * TILE,
                                       (uint16_t *)offset + t * ns * 2 * TILE);
                break;
            case GGUF_Q6_K:
                bad += group_q6_k(row, c, ns, tile, (uint16_t *)scale + t * ns * TILE,
                                  (int8_t *)offset + t * nb * TILE * 2);
                break;
            }
        }
    }
    return bad;
}
