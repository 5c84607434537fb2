/* The element-wise work of a layer, each a single pass in C instead of several torch ops (at a few rows,
 * each torch op costs more in dispatch than in arithmetic; at many rows, one pass over the data beats
 * several).
 *
 * Activations are float32 or bfloat16 (`bf16`), rows contiguous. Each function rounds to the model dtype
 * where the PyTorch path (runtime/model/model.py) does, with the arithmetic in float32 between roundings.
 * The inner loops run W floats at a time (GCC vector extensions of the build level's register width,
 * vector_exp.h) with a scalar tail; rows are shared out over `num_threads` OpenMP threads once a call has enough work.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "bf16.h"
#include "check.h"
#include "kernels.h"

#include "vector_exp.h"


static inline float load_elem(const void *p, int64_t i, int bf16) {
    return bf16 ? bf16_to_f32(((const uint16_t *)p)[i]) : ((const float *)p)[i];
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

/* --- W floats at a time --- */

static inline vf vload(const void *p, int64_t i, int bf16) {
    if (!bf16) return *(const vf *)((const float *)p + i);
    return vload_bf16((const uint16_t *)p + i);
}

static inline vf vto_dtype(vf f, int bf16) { return bf16 ? vround_bf16(f) : f; }

static inline void vstore(void *p, int64_t i, vf f, int bf16) {
    if (!bf16) {
        *(vf *)((float *)p + i) = f;
        return;
    }
    vstore_bf16_bits((uint16_t *)p + i, (vu)vround_bf16(f));
}

/* h [T, D] += delta (rounded to the dtype), when delta is not NULL; then
 * out = weight * dtype(h * rsqrt(mean(h^2) + eps)). */
void add_rms_norm(void *h, const void *delta, const void *weight, void *out, int64_t T, int64_t D, float eps,
                  int bf16, int num_threads) {
    CHECK(T >= 0, T);
    CHECK(D > 0, D);
    CHECK(num_threads > 0, num_threads);
    CHECK_PTR(h, T);
    CHECK_PTR(weight, T);
    CHECK_PTR(out, T);
    const int64_t Dv = D - D % W;
    _Pragma("omp parallel for schedule(static) num_threads(threads_for(T * D, num_threads))")
    for (int64_t t = 0; t < T; t++) {
        const int64_t row = t * D;
        vf acc = {0};
        float sum = 0.f;
        for (int64_t i = 0; i < Dv; i += W) {
            vf v = vload(h, row + i, bf16);
            if (delta) {
                v = vto_dtype(v + vload(delta, row + i, bf16), bf16);
                vstore(h, row + i, v, bf16);
            }
            acc += v * v;
        }
        for (int64_t i = Dv; i < D; i++) {
            float v = load_elem(h, row + i, bf16);
            if (delta) {
                v = to_dtype(v + load_elem(delta, row + i, bf16), bf16);
                store_elem(h, row + i, v, bf16);
            }
            sum += v * v;
        }
        sum += hsum(acc);
        const float r = 1.f / sqrtf(sum / (float)D + eps);
        for (int64_t i = 0; i < Dv; i += W)
            vstore(out, row + i, vload(weight, i, bf16) * vto_dtype(vload(h, row + i, bf16) * r, bf16), bf16);
        for (int64_t i = Dv; i < D; i++) {
            const float v = to_dtype(load_elem(h, row + i, bf16) * r, bf16);
            store_elem(out, row + i, load_elem(weight, i, bf16) * v, bf16);
        }
    }
}

#define SILU_COST 4 /* an exp and a division per element: counts as 4 elements of the others' work */
/* gate_up [T, 2I] (gate then up) -> out [T, I] = dtype(silu(gate)) * up. */
void silu_mul(const void *gate_up, void *out, int64_t T, int64_t I, int bf16, int num_threads) {
    CHECK(T >= 0, T);
    CHECK(I > 0, I);
    CHECK(num_threads > 0, num_threads);
    CHECK_PTR(gate_up, T);
    CHECK_PTR(out, T);
    const int64_t Iv = I - I % W;
    _Pragma("omp parallel for schedule(static) num_threads(threads_for(T * I * SILU_COST, num_threads))")
    for (int64_t t = 0; t < T; t++) {
        const int64_t g0 = t * 2 * I, u0 = g0 + I, o0 = t * I;
        for (int64_t i = 0; i < Iv; i += W) {
            vstore(out, o0 + i, vsilu_mul(vload(gate_up, g0 + i, bf16), vload(gate_up, u0 + i, bf16), bf16), bf16);
        }
        for (int64_t i = Iv; i < I; i++) {
            const float g = load_elem(gate_up, g0 + i, bf16);
            const float s = to_dtype(g / (1.f + expf(-g)), bf16);
            store_elem(out, o0 + i, s * load_elem(gate_up, u0 + i, bf16), bf16);
        }
    }
}

#define GELU_COST 6 /* as SILU_COST, with the cubic of tanh's argument */
/* gate_up [T, 2I] (gate then up) -> out [T, I] = dtype(gelu_tanh(gate)) * up, GELU's tanh approximation
 * (Gemma's activation) 0.5 g (1 + tanh(u)), u = sqrt(2/pi) (g + 0.044715 g^3), tanh(u) = 1 - 2 / (1 + e^2u):
 * written as PyTorch writes it, so that where 1 + tanh(u) cancels to 0 in float32 (g below ~-5) it gives 0
 * as PyTorch does. */
void gelu_mul(const void *gate_up, void *out, int64_t T, int64_t I, int bf16, int num_threads) {
    CHECK(T >= 0, T);
    CHECK(I > 0, I);
    CHECK(num_threads > 0, num_threads);
    CHECK_PTR(gate_up, T);
    CHECK_PTR(out, T);
    const int64_t Iv = I - I % W;
    const float c = 0.7978845608028654f, k = 0.044715f;
    _Pragma("omp parallel for schedule(static) num_threads(threads_for(T * I * GELU_COST, num_threads))")
    for (int64_t t = 0; t < T; t++) {
        const int64_t g0 = t * 2 * I, u0 = g0 + I, o0 = t * I;
        for (int64_t i = 0; i < Iv; i += W) {
            const vf g = vload(gate_up, g0 + i, bf16);
            const vf th = 1.f - 2.f / (1.f + vexp(2.f * c * (g + k * g * g * g)));
            const vf s = 0.5f * g * (1.f + th);
            vstore(out, o0 + i, vto_dtype(s, bf16) * vload(gate_up, u0 + i, bf16), bf16);
        }
        for (int64_t i = Iv; i < I; i++) {
            const float g = load_elem(gate_up, g0 + i, bf16);
            float e = 2.f * c * (g + k * g * g * g);
            e = e < -87.f ? -87.f : (e > 88.f ? 88.f : e);
            const float th = 1.f - 2.f / (1.f + expf(e));
            const float s = to_dtype(0.5f * g * (1.f + th), bf16);
            store_elem(out, o0 + i, s * load_elem(gate_up, u0 + i, bf16), bf16);
        }
    }
}

/* One head of D values before RoPE, into tmp (float32, each value in the dtype): src + bias, rounded to the
 * dtype; then, where norm is not NULL, norm * dtype(x * rsqrt(mean(x^2) + eps)) rounded to the dtype (the
 * PyTorch path's per-head RMSNorm of q and k, Qwen 3 / Gemma 3). */
static void prepare_head(const void *src, int64_t base, const void *bias, int64_t bias_base, const void *norm,
                         float eps, int64_t D, int bf16, float *tmp) {
    float sum = 0.f;
    for (int64_t i = 0; i < D; i++) {
        float x = load_elem(src, base + i, bf16);
        if (bias) x = to_dtype(x + load_elem(bias, bias_base + i, bf16), bf16);
        tmp[i] = x;
        sum += x * x;
    }
    if (!norm) return;
    const float r = 1.f / sqrtf(sum / (float)D + eps);
    for (int64_t i = 0; i < D; i++) tmp[i] = to_dtype(load_elem(norm, i, bf16) * to_dtype(tmp[i] * r, bf16), bf16);
}

/* qkv [T, (H + 2 KVH) D]: plus bias [(H + 2 KVH) D] where not NULL (Qwen 2), rounded to the dtype; the query
 * and key heads RMS-normalised per head by q_norm / k_norm [D] where not NULL (prepare_head); then RoPE
 * (half-split) on the H query and KVH key heads at each row's position, x * cos + rotate_half(x) * sin,
 * rounded to the dtype; the queries into q_out [T, H, D] (float32 when q_f32, else the model dtype), the
 * keys and values into their slots of the caches [slots, KVH, D] (the model dtype). cos, sin_signed:
 * [positions, D] in the dtype, sin_signed = [-sin, sin] by halves. */
void rope_write_kv(const void *qkv, const void *bias, const void *q_norm, const void *k_norm, float eps,
                   const int64_t *positions, const void *cos, const void *sin_signed, void *q_out, void *k_cache,
                   void *v_cache, const int64_t *slots, int64_t T, int64_t H, int64_t KVH, int64_t D, int bf16,
                   int q_f32, int num_threads) {
    CHECK(T >= 0, T);
    CHECK(H > 0, H);
    CHECK(KVH > 0, KVH);
    CHECK(D > 0 && D % 2 == 0, D);
    CHECK(num_threads > 0, num_threads);
    CHECK_PTR(qkv, T);
    CHECK_PTR(positions, T);
    CHECK_PTR(cos, T);
    CHECK_PTR(sin_signed, T);
    CHECK_PTR(q_out, T);
    CHECK_PTR(k_cache, T);
    CHECK_PTR(v_cache, T);
    CHECK_PTR(slots, T);
    CHECK((q_norm == NULL) == (k_norm == NULL), q_norm != NULL);
    CHECK_EACH(t, T, positions[t] >= 0, positions[t]);
    CHECK_EACH(t, T, slots[t] >= 0, slots[t]);
    const int64_t half = D / 2, width = (H + 2 * KVH) * D, kv_row = KVH * D;
    const int q_bf16 = bf16 && !q_f32;
    const int vector = half % W == 0;
    const int prepared = bias != NULL || q_norm != NULL;
    _Pragma("omp parallel for schedule(static) num_threads(threads_for(T * width, num_threads))")
    for (int64_t t = 0; t < T; t++) {
        const int64_t pos = positions[t], slot = slots[t];
        float tmp[prepared ? D : 1];
        for (int64_t h = 0; h < H + KVH; h++) {
            const void *src = qkv;
            int64_t base = t * width + h * D;
            int src_bf16 = bf16;
            if (prepared) {
                prepare_head(qkv, base, bias, h * D, h < H ? q_norm : k_norm, eps, D, bf16, tmp);
                src = tmp, base = 0, src_bf16 = 0;
            }
            void *dst = h < H ? q_out : k_cache;
            const int64_t d0 = h < H ? (t * H + h) * D : slot * kv_row + (h - H) * D;
            const int dst_bf16 = h < H ? q_bf16 : bf16;
            if (vector) {
                for (int64_t i = 0; i < D; i += W) {
                    const int64_t j = i < half ? i + half : i - half; /* rotate_half's partner */
                    const vf x = vload(src, base + i, src_bf16), partner = vload(src, base + j, src_bf16);
                    /* the PyTorch path rounds x * cos to the dtype, then adds partner * sin in float32 */
                    const vf xc = vto_dtype(x * vload(cos, pos * D + i, bf16), bf16);
                    const vf y = vto_dtype(xc + partner * vload(sin_signed, pos * D + i, bf16), bf16);
                    vstore(dst, d0 + i, y, dst_bf16);
                }
                continue;
            }
            for (int64_t i = 0; i < D; i++) {
                const int64_t j = i < half ? i + half : i - half;
                const float x = load_elem(src, base + i, src_bf16), partner = load_elem(src, base + j, src_bf16);
                const float xc = to_dtype(x * load_elem(cos, pos * D + i, bf16), bf16);
                const float y = to_dtype(xc + partner * load_elem(sin_signed, pos * D + i, bf16), bf16);
                store_elem(dst, d0 + i, y, dst_bf16);
            }
        }
        const int64_t v_base = t * width + (H + KVH) * D;
        if (bias) {
            for (int64_t i = 0; i < kv_row; i++) {
                const float v = load_elem(qkv, v_base + i, bf16) + load_elem(bias, (H + KVH) * D + i, bf16);
                store_elem(v_cache, slot * kv_row + i, v, bf16);
            }
            continue;
        }
        const size_t elem = bf16 ? 2 : 4;
        memcpy((char *)v_cache + slot * kv_row * elem, (const char *)qkv + v_base * elem, kv_row * elem);
    }
}
