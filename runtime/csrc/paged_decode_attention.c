/* Decode attention straight from the paged KV pool (CPU; K/V in float32 or bfloat16).
 *
 * One query token per sequence. For each (sequence, kv head) the kernel walks
 * the sequence's block table, so no K/V is gathered or copied: each cached
 * vector is read from the pool in place and shared by the query heads of its
 * group (GQA). Math is float32 throughout; bfloat16 K/V are widened on load.
 *
 * Layouts (all contiguous):
 *   q             [B, H, D] float32
 *   k_pool/v_pool [num_blocks, block_size, KVH, D] (float32 or bfloat16)
 *   block_tables  [B, max_blocks] (int64), context_lens [B] (int64)
 *   out           [B, H, D] float32
 *
 * Written with GCC vector extensions (8 floats), which the compiler maps to
 * AVX2/AVX-512 or NEON. Dot products run 8 cached positions at a time so
 * that 8 independent accumulators hide the FMA latency; the weighted sum of V
 * keeps a 16-wide slice of every group's output in registers while it walks
 * the positions. Requires D % 16 == 0 and H / KVH <= MAX_GROUP.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define MAX_GROUP 16
#define TILE 8

typedef float v8f __attribute__((vector_size(32), aligned(4)));
typedef uint16_t v8u16 __attribute__((vector_size(16), aligned(2)));
typedef uint32_t v8u32 __attribute__((vector_size(32)));

static inline v8f load_f32(const void *p) { return *(const v8f *)p; }

static inline v8f load_bf16(const void *p) {
    v8u32 wide = __builtin_convertvector(*(const v8u16 *)p, v8u32) << 16;
    v8f out;
    memcpy(&out, &wide, sizeof out);
    return out;
}

static inline float hsum(v8f v) {
    return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7]));
}

/* exp(x) for x <= 0 (softmax after subtracting the max), vectorizable; relative error ~2e-7. */
static inline float exp_nonpositive(float x) {
    if (x < -87.f) return 0.f;
    const float t = x * 1.44269504088896341f;          /* x / ln 2 */
    const float n = floorf(t);
    const float f = (t - n) * 0.69314718055994531f;   /* in [0, ln 2) */
    float p = 1.f / 5040.f;
    p = p * f + 1.f / 720.f;
    p = p * f + 1.f / 120.f;
    p = p * f + 1.f / 24.f;
    p = p * f + 1.f / 6.f;
    p = p * f + 0.5f;
    p = p * f + 1.f;
    p = p * f + 1.f;
    const int32_t bits = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

#define DEFINE_KERNEL(NAME, ELEM, LOAD)                                                                        \
void NAME(const float *q, const ELEM *k_pool, const ELEM *v_pool, const int64_t *block_tables,                \
          const int64_t *context_lens, float *out, int64_t B, int64_t H, int64_t KVH, int64_t D,              \
          int64_t block_size, int64_t max_blocks, float scale, int num_threads) {                              \
    const int64_t G = H / KVH, C = D / 8, row = KVH * D;                                                       \
    /* a task is one sequence (its cached rows are read whole, in order) unless too few to share out */      \
    const int64_t heads_per_task = B >= 2 * num_threads ? KVH : 1;                                             \
    const int64_t tasks_per_seq = KVH / heads_per_task;                                                        \
    int64_t max_ctx = 0;                                                                                       \
    for (int64_t b = 0; b < B; b++) if (context_lens[b] > max_ctx) max_ctx = context_lens[b];                 \
    _Pragma("omp parallel num_threads(num_threads)")                                                           \
    {                                                                                                          \
        float *scores = (float *)malloc(sizeof(float) * (size_t)(H * max_ctx + TILE));                        \
        int64_t *rows = (int64_t *)malloc(sizeof(int64_t) * (size_t)(max_ctx + TILE));                        \
        float *qs = (float *)malloc(sizeof(float) * (size_t)(H * D));                                         \
        float *acc = (float *)malloc(sizeof(float) * (size_t)(H * D));                                        \
        _Pragma("omp for schedule(dynamic, 1)")                                                                \
        for (int64_t task = 0; task < B * tasks_per_seq; task++) {                                             \
            const int64_t b = task / tasks_per_seq, h0 = task % tasks_per_seq * heads_per_task;                \
            const int64_t h1 = h0 + heads_per_task, ctx = context_lens[b];                                     \
            const int64_t *table = block_tables + b * max_blocks;                                              \
            const int64_t nq = heads_per_task * G;                 /* query heads of this task */            \
            const float *qb = q + (b * H + h0 * G) * D;                                                        \
            for (int64_t i = 0; i < nq * D; i++) qs[i] = qb[i] * scale;                                        \
            for (int64_t t = 0; t < ctx; t++)                                                                  \
                rows[t] = (table[t / block_size] * block_size + t % block_size) * row;                         \
            /* scores[i][t] = q_i . k_t, TILE positions at a time (independent accumulators) */              \
            float maxs[MAX_GROUP * 64];                                                                        \
            for (int64_t i = 0; i < nq; i++) maxs[i] = -INFINITY;                                              \
            for (int64_t t0 = 0; t0 < ctx; t0 += TILE) {                                                       \
                const int64_t n = ctx - t0 < TILE ? ctx - t0 : TILE;                                           \
                for (int64_t h = h0; h < h1; h++) {                                                            \
                    for (int64_t g = 0; g < G; g++) {                                                          \
                        const int64_t i = (h - h0) * G + g;                                                    \
                        const float *qi = qs + i * D;                                                          \
                        v8f a[TILE];                                                                           \
                        for (int j = 0; j < TILE; j++) a[j] = (v8f){0};                                        \
                        for (int64_t c = 0; c < C; c++) {                                                      \
                            const v8f qv = load_f32(qi + 8 * c);                                               \
                            for (int j = 0; j < n; j++) a[j] += qv * LOAD(k_pool + rows[t0 + j] + h * D + 8 * c); \
                        }                                                                                      \
                        float *si = scores + i * ctx;                                                          \
                        for (int j = 0; j < n; j++) {                                                          \
                            const float s = hsum(a[j]);                                                        \
                            si[t0 + j] = s;                                                                    \
                            if (s > maxs[i]) maxs[i] = s;                                                      \
                        }                                                                                      \
                    }                                                                                          \
                }                                                                                              \
            }                                                                                                  \
            float inv[MAX_GROUP * 64];                                                                         \
            for (int64_t i = 0; i < nq; i++) {                                                                 \
                float *si = scores + i * ctx, sum = 0.f;                                                       \
                const float m = maxs[i];                                                                       \
                _Pragma("omp simd reduction(+ : sum)")                                                         \
                for (int64_t t = 0; t < ctx; t++) { si[t] = exp_nonpositive(si[t] - m); sum += si[t]; }       \
                inv[i] = 1.f / sum;                                                                            \
            }                                                                                                  \
            /* out_i = sum_t p_i[t] v_t: each cached row read once, the sums kept in L1 */                    \
            memset(acc, 0, sizeof(float) * (size_t)(nq * D));                                                  \
            for (int64_t t = 0; t < ctx; t++) {                                                                \
                for (int64_t h = h0; h < h1; h++) {                                                            \
                    const ELEM *v = v_pool + rows[t] + h * D;                                                  \
                    for (int64_t c = 0; c < C; c++) {                                                          \
                        const v8f vc = LOAD(v + 8 * c);                                                        \
                        for (int64_t g = 0; g < G; g++) {                                                      \
                            const int64_t i = (h - h0) * G + g;                                                \
                            v8f *ai = (v8f *)(acc + i * D + 8 * c);                                            \
                            *ai += scores[i * ctx + t] * vc;                                                   \
                        }                                                                                      \
                    }                                                                                          \
                }                                                                                              \
            }                                                                                                  \
            for (int64_t i = 0; i < nq; i++) {                                                                 \
                float *o = out + (b * H + h0 * G + i) * D;                                                     \
                for (int64_t d = 0; d < D; d++) o[d] = acc[i * D + d] * inv[i];                                \
            }                                                                                                  \
        }                                                                                                      \
        free(scores);                                                                                          \
        free(rows);                                                                                            \
        free(qs);                                                                                              \
        free(acc);                                                                                             \
    }                                                                                                          \
}

DEFINE_KERNEL(paged_decode_attention_f32, float, load_f32)
DEFINE_KERNEL(paged_decode_attention_bf16, uint16_t, load_bf16)
