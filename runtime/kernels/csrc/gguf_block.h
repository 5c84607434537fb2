/* Reading a GGUF block's fields from the file's bytes, shared by gguf_relayout.c and gguf_dequantize.c. */
#ifndef PRESCIENT_GGUF_BLOCK_H
#define PRESCIENT_GGUF_BLOCK_H

#include <stdint.h>
#include <string.h>

/* The float16 stored at p, as its bits (unaligned, little-endian) */
static inline uint16_t load_half(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, sizeof h);
    return h;
}

/* Q4_K / Q5_K's 12 bytes of 6-bit scales: sc[j] and m[j] of sub-block j (ggml's get_scale_min_k4) */
static inline void k_scales(const uint8_t *q, uint8_t *sc, uint8_t *m) {
    for (int j = 0; j < 4; j++) {
        sc[j] = q[j] & 63;
        m[j] = q[j + 4] & 63;
        sc[j + 4] = (q[j + 8] & 0x0f) | ((q[j] >> 6) << 4);
        m[j + 4] = (q[j + 8] >> 4) | ((q[j + 4] >> 6) << 4);
    }
}

#endif
