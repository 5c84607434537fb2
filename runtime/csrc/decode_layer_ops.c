/* The element-wise work of a decode step's layer, each a single pass in C instead of several torch ops
 * (at a few rows, each torch op costs more in dispatch than in arithmetic).
 *
 * Activations are float32 or bfloat16 (`bf16`), rows contiguous. Each function rounds to the model dtype
 * where the PyTorch path (runtime/model.py) does, with the arithmetic in float32 between roundings.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

static inline float load_elem(const void *p, int64_t i, int bf16) {
    if (!bf16) return ((const float *)p)[i];
    uint32_t bits = (uint32_t)((const uint16_t *)p)[i] << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline float round_bf16(float f) {
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return f;
    bits += 0x7fffu + ((bits >> 16) & 1u);
    bits &= 0xffff0000u;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline void store_elem(void *p, int64_t i, float f, int bf16) {
    if (!bf16) {
        ((float *)p)[i] = f;
        return;
    }
    f = round_bf16(f);
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    ((uint16_t *)p)[i] = (uint16_t)(bits >> 16);
}

static inline float to_dtype(float f, int bf16) { return bf16 ? round_bf16(f) : f; }

/* h [T, D] += delta (rounded to the dtype), when delta is not NULL; then
 * out = weight * dtype(h * rsqrt(mean(h^2) + eps)). */
void add_rms_norm(void *h, const void *delta, const void *weight, void *out, int64_t T, int64_t D, float eps,
                  int bf16) {
    for (int64_t t = 0; t < T; t++) {
        float sum = 0.f;
        for (int64_t i = 0; i < D; i++) {
            float v = load_elem(h, t * D + i, bf16);
            if (delta) {
                v = to_dtype(v + load_elem(delta, t * D + i, bf16), bf16);
                store_elem(h, t * D + i, v, bf16);
            }
            sum += v * v;
        }
        const float r = 1.f / sqrtf(sum / (float)D + eps);
        for (int64_t i = 0; i < D; i++) {
            const float v = to_dtype(load_elem(h, t * D + i, bf16) * r, bf16);
            store_elem(out, t * D + i, load_elem(weight, i, bf16) * v, bf16);
        }
    }
}

/* gate_up [T, 2I] (gate then up) -> out [T, I] = dtype(silu(gate)) * up. */
void silu_mul(const void *gate_up, void *out, int64_t T, int64_t I, int bf16) {
    for (int64_t t = 0; t < T; t++) {
        for (int64_t i = 0; i < I; i++) {
            const float g = load_elem(gate_up, t * 2 * I + i, bf16);
            const float s = to_dtype(g / (1.f + expf(-g)), bf16);
            store_elem(out, t * I + i, s * load_elem(gate_up, t * 2 * I + I + i, bf16), bf16);
        }
    }
}

/* qkv [T, (H + 2 KVH) D]: RoPE (half-split) on the H query and KVH key heads at each row's position,
 * x * cos + rotate_half(x) * sin, rounded to the dtype; the queries into q_out [T, H, D] float32, the keys
 * and values into their slots of the caches [slots, KVH, D] (the model dtype). cos, sin_signed:
 * [positions, D] in the dtype, sin_signed = [-sin, sin] by halves. */
void rope_write_kv(const void *qkv, const int64_t *positions, const void *cos, const void *sin_signed,
                   float *q_out, void *k_cache, void *v_cache, const int64_t *slots, int64_t T, int64_t H,
                   int64_t KVH, int64_t D, int bf16) {
    const int64_t half = D / 2, width = (H + 2 * KVH) * D, kv_row = KVH * D;
    for (int64_t t = 0; t < T; t++) {
        const int64_t pos = positions[t], slot = slots[t];
        for (int64_t h = 0; h < H + KVH; h++) {
            const int64_t base = t * width + h * D;
            for (int64_t i = 0; i < D; i++) {
                const int64_t j = i < half ? i + half : i - half; /* rotate_half's partner */
                const float x = load_elem(qkv, base + i, bf16), partner = load_elem(qkv, base + j, bf16);
                /* the PyTorch path rounds x * cos to the dtype, then adds partner * sin in float32 */
                const float xc = to_dtype(x * load_elem(cos, pos * D + i, bf16), bf16);
                const float y = to_dtype(xc + partner * load_elem(sin_signed, pos * D + i, bf16), bf16);
                if (h < H)
                    q_out[(t * H + h) * D + i] = y;
                else
                    store_elem(k_cache, slot * kv_row + (h - H) * D + i, y, bf16);
            }
        }
        const int64_t v_base = t * width + (H + KVH) * D;
        for (int64_t i = 0; i < kv_row; i++)
            store_elem(v_cache, slot * kv_row + i, load_elem(qkv, v_base + i, bf16), bf16);
    }
}
