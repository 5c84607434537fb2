/* Attention of one query token per row straight from the paged KV pool (CPU; K/V in float32 or bfloat16):
 * a decode step's sequences, or a prefill chunk's rows (row i over its first ctx - n + i + 1 positions).
 *
 * For each (row, kv head) the kernel walks the row's block table, so no K/V is gathered or copied: each
 * cached vector is read from the pool in place and shared by the query heads of its group (GQA). Math is
 * float32 throughout; bfloat16 K/V are widened on load.
 *
 * A window (window > 0) limits a query at position p to the keys at positions > p - window (transformers'
 * sliding_window: the window counts the query's own key); a soft-cap (softcap > 0) maps each scaled score s
 * to softcap * tanh(s / softcap) before the softmax (Gemma 2).
 *
 * Layouts (all contiguous):
 *   q             [B, H, D] float32
 *   k_pool/v_pool [num_blocks, block_size, KVH, D] (float32 or bfloat16)
 *   block_tables  [B, max_blocks] (int64), context_lens [B] (int64)
 *   out           [B, H, D] float32
 *
 * Two implementations, both with GCC vector extensions of the build's register width (W lanes, vector_exp.h:
 * AVX-512, AVX2, SSE2 or NEON): the fast path at the end of the file (head_dim 64, 128 or 256, up to 8 query heads
 * a KV head: every model this engine serves today) and the generic kernels here (D % 16 == 0, H / KVH <=
 * MAX_GROUP). The generic ones run dot products 8 cached positions at a time so that 8 independent
 * accumulators hide the FMA latency; the weighted sum of V keeps a W-wide slice of every group's output in
 * L1 while it walks the positions. A prefill chunk takes its own kernel where the shape allows (paged_prefill_attention_*, the
 * last section), which shares each cached element among many query rows.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "check.h"
#include "kernels.h"
#include "vector_exp.h"

#define MAX_GROUP 16
#define TILE 8

static inline vf vload_f32(const float *p) { return *(const vf *)p; }

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

/* The first position a query at position ctx - 1 sees: keys at positions > p - window (transformers'
 * sliding_window, the query's own key counted); window <= 0: all from 0. */
static inline int64_t window_start(int64_t ctx, int64_t window) {
    return window > 0 && ctx > window ? ctx - window : 0;
}

#define DEFINE_KERNEL(NAME, ELEM, LOAD)                                                                        \
static void NAME(const float *q, const ELEM *k_pool, const ELEM *v_pool, const int64_t *block_tables,                \
          const int64_t *context_lens, float *out, int64_t B, int64_t H, int64_t KVH, int64_t D,              \
          int64_t block_size, int64_t max_blocks, float scale, int64_t window, float softcap,                  \
          int num_threads) {                                                                                   \
    const int64_t G = H / KVH, C = D / W, row = KVH * D;                                                       \
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
            const int64_t h1 = h0 + heads_per_task, lo = window_start(context_lens[b], window);               \
            const int64_t ctx = context_lens[b] - lo;                /* the positions lo .. seen */            \
            const int64_t *table = block_tables + b * max_blocks;                                              \
            const int64_t nq = heads_per_task * G;                 /* query heads of this task */            \
            const float *qb = q + (b * H + h0 * G) * D;                                                        \
            for (int64_t i = 0; i < nq * D; i++) qs[i] = qb[i] * scale;                                        \
            for (int64_t t = 0; t < ctx; t++)                                                                  \
                rows[t] = (table[(lo + t) / block_size] * block_size + (lo + t) % block_size) * row;           \
            /* scores[i][t] = q_i . k_t, TILE positions at a time (independent accumulators) */              \
            float maxs[MAX_GROUP * 64];                                                                        \
            for (int64_t i = 0; i < nq; i++) maxs[i] = -INFINITY;                                              \
            for (int64_t t0 = 0; t0 < ctx; t0 += TILE) {                                                       \
                const int64_t n = ctx - t0 < TILE ? ctx - t0 : TILE;                                           \
                for (int64_t h = h0; h < h1; h++) {                                                            \
                    for (int64_t g = 0; g < G; g++) {                                                          \
                        const int64_t i = (h - h0) * G + g;                                                    \
                        const float *qi = qs + i * D;                                                          \
                        vf a[TILE];                                                                            \
                        for (int j = 0; j < TILE; j++) a[j] = (vf){0};                                         \
                        for (int64_t c = 0; c < C; c++) {                                                      \
                            const vf qv = vload_f32(qi + W * c);                                               \
                            for (int j = 0; j < n; j++) a[j] += qv * LOAD(k_pool + rows[t0 + j] + h * D + W * c); \
                        }                                                                                      \
                        float *si = scores + i * ctx;                                                          \
                        for (int j = 0; j < n; j++) {                                                          \
                            const float s = softcap > 0.f ? softcap * tanhf(hsum(a[j]) / softcap) : hsum(a[j]); \
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
                        const vf vc = LOAD(v + W * c);                                                         \
                        for (int64_t g = 0; g < G; g++) {                                                      \
                            const int64_t i = (h - h0) * G + g;                                                \
                            vf *ai = (vf *)(acc + i * D + W * c);                                              \
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

DEFINE_KERNEL(generic_f32, float, vload_f32)
DEFINE_KERNEL(generic_bf16, uint16_t, vload_bf16)

/* --- The fast path: W floats at a time; a task per sequence (all its KV heads) or per (sequence, KV head). ---
 *
 * Scores: each cached key is loaded (and widened) once for a group of query heads and multiplied into their
 * accumulators; QK_TILE positions at a time, so heads x QK_TILE independent sums hide the FMA latency. The
 * weighted sum of V keeps a slice of all G outputs in registers while it walks the positions, one KV head
 * after another. G and C = D / W are compile-time constants in each instance (always_inline + a switch), so
 * the accumulators are registers: at most ACC_REGS of them (vector_exp.h), so that a build for 16 registers
 * (AVX2, SSE2) neither spills nor takes minutes to compile. The key walk takes KEY_GROUP(G) query heads a
 * pass over the keys (all G where they fit) and the value walk VALUE_SLICE(G, C) vectors of each output a
 * pass over the values; each sum still runs over the positions in order, so the results do not depend on the
 * split. Taken where D is 64, 128 or 256 and G <= 8; other shapes run the kernels above.
 *
 * A task takes all of a sequence's KV heads when there are SEQUENCE_TASKS_PER_THREAD sequences a thread:
 * its key walk then reads whole rows (every head's part, contiguous) instead of one head's 2 lines at a 6-line
 * stride, which the memory system serves faster (same results bit for bit). Below 4 sequences a thread the
 * tasks stay one per KV head, so that one or two sequences still keep both threads busy. */

#define QK_TILE 4
#define PREFETCH_ROWS 32 /* two blocks ahead: a sequence's blocks lie anywhere in the pool once it has been reused */
#define SEQUENCE_TASKS_PER_THREAD 4

/* Query heads a pass of the key walk: the largest divisor of G whose QK_TILE accumulators each fit. */
#define KEY_HEADS (ACC_REGS / QK_TILE)
#define FITS_DIVIDES(d, G) ((d) <= KEY_HEADS && (G) % (d) == 0)
#define KEY_GROUP(G)                                                                                            \
    ((G) <= KEY_HEADS ? (G)                                                                                     \
     : FITS_DIVIDES(6, G) ? 6                                                                                   \
     : FITS_DIVIDES(4, G) ? 4                                                                                   \
     : FITS_DIVIDES(3, G) ? 3                                                                                   \
     : FITS_DIVIDES(2, G) ? 2                                                                                   \
                          : 1)
/* Vectors of each of the G outputs a pass of the value walk: C (all) where G x C fit, else a power of two. */
#define VALUE_SLICE(G, C)                                                                                       \
    ((G) * (C) <= ACC_REGS ? (C) : (G) * 8 <= ACC_REGS ? 8 : (G) * 4 <= ACC_REGS ? 4 : (G) * 2 <= ACC_REGS ? 2 : 1)

/* Ask for the cache lines of position t's row from element offset `off` (`bytes` of it: the task's heads),
 * when t < ctx, into L2 (prefetcht1). Decode attention is bound by memory latency, not bandwidth: a block lies
 * anywhere in the pool. The key walk prefetches its keys 32 rows ahead (and the first 32 at its start) and
 * the values of the row it reads, so the value walk that follows finds them all in L2; the number of misses
 * in flight, not the bytes, sets the speed; prefetching into L1, or fewer rows ahead, measured slower
 * (`python -m tests.bench engine`, decode x32). */
#define prefetch_row(pool, rows, t, ctx, off, bytes)                                                            \
    do {                                                                                                        \
        if ((t) < (ctx)) {                                                                                      \
            const char *line = (const char *)((pool) + (rows)[t] + (off));                                      \
            for (size_t b = 0; b < (bytes); b += 64) __builtin_prefetch(line + b, 0, 2);                       \
        }                                                                                                       \
    } while (0)

/* The sums of a0..a3's lanes, the sum of a_j in lane HSUM_X4_LANE(j): a transposing tree, ~3 shuffles and
 * adds per sum. */
#if W == 16
#define HSUM_X4_LANE(j) (4 * (j))
static inline vf hsum_x4(vf a0, vf a1, vf a2, vf a3) {
    const vf b01 = __builtin_shufflevector(a0, a1, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
                   __builtin_shufflevector(a0, a1, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
    const vf b23 = __builtin_shufflevector(a2, a3, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
                   __builtin_shufflevector(a2, a3, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
    const vf c = __builtin_shufflevector(b01, b23, 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
                 __builtin_shufflevector(b01, b23, 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
    const vf d = c + __builtin_shufflevector(c, c, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
    return d + __builtin_shufflevector(d, d, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14);
}
#elif W == 8
#define HSUM_X4_LANE(j) (2 * (j))
static inline vf hsum_x4(vf a0, vf a1, vf a2, vf a3) {
    const vf b01 = __builtin_shufflevector(a0, a1, 0, 1, 2, 3, 8, 9, 10, 11) +
                   __builtin_shufflevector(a0, a1, 4, 5, 6, 7, 12, 13, 14, 15);
    const vf b23 = __builtin_shufflevector(a2, a3, 0, 1, 2, 3, 8, 9, 10, 11) +
                   __builtin_shufflevector(a2, a3, 4, 5, 6, 7, 12, 13, 14, 15);
    const vf c = __builtin_shufflevector(b01, b23, 0, 1, 4, 5, 8, 9, 12, 13) +
                 __builtin_shufflevector(b01, b23, 2, 3, 6, 7, 10, 11, 14, 15);
    return c + __builtin_shufflevector(c, c, 1, 0, 3, 2, 5, 4, 7, 6);
}
#else
#define HSUM_X4_LANE(j) (j)
static inline vf hsum_x4(vf a0, vf a1, vf a2, vf a3) {
    const vf b01 = __builtin_shufflevector(a0, a1, 0, 4, 1, 5) + __builtin_shufflevector(a0, a1, 2, 6, 3, 7);
    const vf b23 = __builtin_shufflevector(a2, a3, 0, 4, 1, 5) + __builtin_shufflevector(a2, a3, 2, 6, 3, 7);
    return __builtin_shufflevector(b01, b23, 0, 1, 4, 5) + __builtin_shufflevector(b01, b23, 2, 3, 6, 7);
}
#endif

/* exp(x) for x <= 0, W at a time (the scalar exp_nonpositive's rounding; vector_exp.h's polynomial) */
static inline vf vexp_nonpositive(vf x) {
    vi under = x < -87.f;
    x = (vf)(((vi)x & ~under) | ((vi)((vf){0} - 87.f) & under));
    const vf t = x * 1.44269504088896341f;
    vi n = __builtin_convertvector(t, vi);
    n += (vi)(__builtin_convertvector(n, vf) > t);
    const vf f = (t - __builtin_convertvector(n, vf)) * 0.69314718055994531f;
    return (vf)((vi)(vexp_taylor(f) * (vf)((n + 127) << 23)) & ~under);
}

/* The logit soft-cap cap * tanh(x / cap), W at a time: tanh|y| = (1 - e) / (1 + e) with e = exp(-2|y|), the
 * sign put back (absolute error ~1e-7 x cap). */
static inline vf vsoftcap(vf x, float cap) {
    const vf y = x * (1.f / cap);
    const vi sign = (vi)y & ((vi){0} + INT32_MIN);
    const vf e = vexp_nonpositive((vf)((vi)y ^ sign) * -2.f);
    return (vf)((vi)((1.f - e) / (1.f + e) * cap) | sign);
}

/* Soft-caps n scores in place (cap > 0); their maximum *m with them (tanh is monotonic). */
static inline void softcap_scores(float *s, int64_t n, float *m, float cap) {
    int64_t t = 0;
    for (; t + W <= n; t += W) *(vf *)(s + t) = vsoftcap(vload_f32(s + t), cap);
    for (; t < n; t++) s[t] = cap * tanhf(s[t] / cap);
    *m = cap * tanhf(*m / cap);
}

#define DEFINE_GROUP_TASK(NAME, ELEM, LOADW)                                                                    \
static inline __attribute__((always_inline)) void NAME(                                                         \
    const int G, const int C, const int64_t nh, const float *q, const ELEM *k_pool, const ELEM *v_pool,        \
    const int64_t *rows, int64_t ctx, int64_t h0, float *qs, float *scores, float *out, float scale,           \
    float softcap) {                                                                                            \
    /* q, out: the nh x G query heads of KV heads h0 .. h0 + nh - 1 [nh G, D]; rows[t]: offset of position t's  \
     * row in the pools; qs: scratch for the scaled queries; scores: [nh G, ctx] */                             \
    const int64_t D = C * W, heads = nh * G, off = h0 * D;                                                      \
    const int KG = KEY_GROUP(G), VS = VALUE_SLICE(G, C);                                                        \
    const size_t span = (size_t)(nh * D) * sizeof(ELEM);                                                        \
    for (int64_t i = 0; i < heads * D; i++) qs[i] = q[i] * scale;                                               \
    float maxs[heads];                                                                                          \
    for (int64_t i = 0; i < heads; i++) maxs[i] = -INFINITY;                                                    \
    for (int64_t t = 0; t < PREFETCH_ROWS; t++) prefetch_row(k_pool, rows, t, ctx, off, span);                 \
    int64_t t0 = 0;                                                                                             \
    for (; t0 + QK_TILE <= ctx; t0 += QK_TILE) {                                                                \
        for (int j = 0; j < QK_TILE; j++) {                                                                     \
            prefetch_row(k_pool, rows, t0 + j + PREFETCH_ROWS, ctx, off, span);                                 \
            prefetch_row(v_pool, rows, t0 + j, ctx, off, span);                                                 \
        }                                                                                                       \
        for (int64_t h = 0; h < nh; h++) {                                                                      \
            for (int g0 = 0; g0 < G; g0 += KG) {                                                                \
                const float *qh = qs + (h * G + g0) * D;                                                        \
                vf a[KG][QK_TILE];                                                                              \
                for (int g = 0; g < KG; g++)                                                                    \
                    for (int j = 0; j < QK_TILE; j++) a[g][j] = (vf){0};                                        \
                for (int j = 0; j < QK_TILE; j++) {                                                             \
                    const ELEM *k = k_pool + rows[t0 + j] + off + h * D;                                        \
                    for (int c = 0; c < C; c++) {                                                               \
                        const vf kc = LOADW(k + c * W);                                                         \
                        for (int g = 0; g < KG; g++) a[g][j] += vload_f32(qh + g * D + c * W) * kc;            \
                    }                                                                                           \
                }                                                                                               \
                for (int g = 0; g < KG; g++) {                                                                  \
                    const vf s = hsum_x4(a[g][0], a[g][1], a[g][2], a[g][3]);                                   \
                    float *sg = scores + (h * G + g0 + g) * ctx;                                                \
                    float *m = maxs + h * G + g0 + g;                                                           \
                    for (int j = 0; j < QK_TILE; j++) {                                                         \
                        sg[t0 + j] = s[HSUM_X4_LANE(j)];                                                        \
                        *m = s[HSUM_X4_LANE(j)] > *m ? s[HSUM_X4_LANE(j)] : *m;                                 \
                    }                                                                                           \
                }                                                                                               \
            }                                                                                                   \
        }                                                                                                       \
    }                                                                                                           \
    for (; t0 < ctx; t0++) {                                                                                    \
        prefetch_row(v_pool, rows, t0, ctx, off, span);                                                         \
        for (int64_t h = 0; h < nh; h++) {                                                                      \
            const float *qh = qs + h * G * D;                                                                   \
            const ELEM *k = k_pool + rows[t0] + off + h * D;                                                    \
            for (int g = 0; g < G; g++) {                                                                       \
                vf a = {0};                                                                                     \
                for (int c = 0; c < C; c++) a += vload_f32(qh + g * D + c * W) * LOADW(k + c * W);              \
                const float s = hsum(a);                                                                        \
                scores[(h * G + g) * ctx + t0] = s;                                                             \
                maxs[h * G + g] = s > maxs[h * G + g] ? s : maxs[h * G + g];                                    \
            }                                                                                                   \
        }                                                                                                       \
    }                                                                                                           \
    if (softcap > 0.f)                                                                                          \
        for (int64_t i = 0; i < heads; i++) softcap_scores(scores + i * ctx, ctx, maxs + i, softcap);          \
    float inv[heads];                                                                                           \
    for (int64_t i = 0; i < heads; i++) {                                                                       \
        float *s = scores + i * ctx;                                                                            \
        vf sum = {0};                                                                                           \
        int64_t t = 0;                                                                                          \
        for (; t + W <= ctx; t += W) {                                                                          \
            const vf e = vexp_nonpositive(vload_f32(s + t) - maxs[i]);                                          \
            *(vf *)(s + t) = e;                                                                                 \
            sum += e;                                                                                           \
        }                                                                                                       \
        float total = hsum(sum);                                                                                \
        for (; t < ctx; t++) { s[t] = exp_nonpositive(s[t] - maxs[i]); total += s[t]; }                         \
        inv[i] = 1.f / total;                                                                                   \
    }                                                                                                           \
    for (int64_t h = 0; h < nh; h++) { /* the values of each KV head, from L2 since the key walk */            \
        const float *sh = scores + h * G * ctx;                                                                 \
        for (int c0 = 0; c0 < C; c0 += VS) {                                                                    \
            vf acc[G][VS];                                                                                      \
            for (int g = 0; g < G; g++)                                                                         \
                for (int c = 0; c < VS; c++) acc[g][c] = (vf){0};                                               \
            for (int64_t t = 0; t < ctx; t++) {                                                                 \
                const ELEM *v = v_pool + rows[t] + off + h * D + c0 * W;                                        \
                for (int c = 0; c < VS; c++) {                                                                  \
                    const vf vc = LOADW(v + c * W);                                                             \
                    for (int g = 0; g < G; g++) acc[g][c] += sh[g * ctx + t] * vc;                              \
                }                                                                                               \
            }                                                                                                   \
            for (int g = 0; g < G; g++)                                                                         \
                for (int c = 0; c < VS; c++)                                                                    \
                    *(vf *)(out + (h * G + g) * D + (c0 + c) * W) = acc[g][c] * inv[h * G + g];                 \
        }                                                                                                       \
    }                                                                                                           \
}

DEFINE_GROUP_TASK(group_task_f32, float, vload_f32)
DEFINE_GROUP_TASK(group_task_bf16, uint16_t, vload_bf16)

/* Each (G, D) instance is a function of its own: one function holding all of them took the compiler minutes. */
#define TASK_PARAMS(ELEM)                                                                                       \
    int64_t nh, const float *q, const ELEM *k_pool, const ELEM *v_pool, const int64_t *rows, int64_t ctx,       \
        int64_t h0, float *qs, float *scores, float *out, float scale, float softcap
#define DEFINE_INSTANCE(TASK, ELEM, G, D)                                                                       \
    static __attribute__((noinline)) void TASK##_##G##_##D(TASK_PARAMS(ELEM)) {                                 \
        TASK(G, D / W, nh, q, k_pool, v_pool, rows, ctx, h0, qs, scores, out, scale, softcap);                 \
    }
#define DEFINE_INSTANCES_D(TASK, ELEM, D)                                                                       \
    DEFINE_INSTANCE(TASK, ELEM, 1, D) DEFINE_INSTANCE(TASK, ELEM, 2, D) DEFINE_INSTANCE(TASK, ELEM, 3, D)      \
    DEFINE_INSTANCE(TASK, ELEM, 4, D) DEFINE_INSTANCE(TASK, ELEM, 5, D) DEFINE_INSTANCE(TASK, ELEM, 6, D)      \
    DEFINE_INSTANCE(TASK, ELEM, 7, D) DEFINE_INSTANCE(TASK, ELEM, 8, D)
#define DEFINE_INSTANCES(TASK, ELEM)                                                                            \
    DEFINE_INSTANCES_D(TASK, ELEM, 64) DEFINE_INSTANCES_D(TASK, ELEM, 128) DEFINE_INSTANCES_D(TASK, ELEM, 256)
DEFINE_INSTANCES(group_task_f32, float)
DEFINE_INSTANCES(group_task_bf16, uint16_t)

#define GROUP_CASES(TASK, D)                                                                                    \
    switch (G) {                                                                                                \
    case 1: TASK##_1_##D(ARGS); break;                                                                          \
    case 2: TASK##_2_##D(ARGS); break;                                                                          \
    case 3: TASK##_3_##D(ARGS); break;                                                                          \
    case 4: TASK##_4_##D(ARGS); break;                                                                          \
    case 5: TASK##_5_##D(ARGS); break;                                                                          \
    case 6: TASK##_6_##D(ARGS); break;                                                                          \
    case 7: TASK##_7_##D(ARGS); break;                                                                          \
    default: TASK##_8_##D(ARGS); break;                                                                         \
    }

/* KV heads a task: a sequence's all, so that its walks read whole rows, where there are enough sequences to
 * share out (SEQUENCE_TASKS_PER_THREAD a thread); else one, so that a few sequences still use every thread. */
static int64_t heads_per_task(int64_t B, int64_t KVH, int num_threads) {
    return B >= SEQUENCE_TASKS_PER_THREAD * (int64_t)num_threads ? KVH : 1;
}

#define DEFINE_FAST_KERNEL(NAME, ELEM, TASK)                                                                    \
static void NAME(const float *q, const ELEM *k_pool, const ELEM *v_pool, const int64_t *block_tables,           \
                 const int64_t *context_lens, float *out, int64_t B, int64_t H, int64_t KVH, int64_t D,         \
                 int64_t block_size, int64_t max_blocks, float scale, int64_t window, float softcap,            \
                 int num_threads) {                                                                             \
    const int64_t G = H / KVH, row = KVH * D, nh = heads_per_task(B, KVH, num_threads), per_seq = KVH / nh;    \
    int64_t max_ctx = 0;                                                                                        \
    for (int64_t b = 0; b < B; b++) if (context_lens[b] > max_ctx) max_ctx = context_lens[b];                  \
    const int64_t tasks = B * per_seq;                                                                          \
    _Pragma("omp parallel num_threads(tasks < num_threads ? (int)tasks : num_threads)")                        \
    {                                                                                                           \
        float *scores = (float *)malloc(sizeof(float) * (size_t)(nh * G * max_ctx + W));                       \
        float *qs = (float *)malloc(sizeof(float) * (size_t)(nh * G * D));                                      \
        int64_t *rows = (int64_t *)malloc(sizeof(int64_t) * (size_t)(max_ctx + 1));                            \
        _Pragma("omp for schedule(dynamic, 1)")                                                                 \
        for (int64_t task = 0; task < tasks; task++) {                                                          \
            const int64_t b = task / per_seq, h = task % per_seq * nh;                                          \
            const int64_t lo = window_start(context_lens[b], window), ctx = context_lens[b] - lo;              \
            const int64_t *table = block_tables + b * max_blocks;                                               \
            for (int64_t p = lo, t = 0; t < ctx;) {               /* rows[t]: position lo + t's row */        \
                const int64_t base = table[p / block_size] * block_size * row;                                  \
                for (int64_t j = p % block_size; j < block_size && t < ctx; j++, t++, p++) rows[t] = base + j * row; \
            }                                                                                                   \
            const float *qg = q + (b * H + h * G) * D;                                                          \
            float *og = out + (b * H + h * G) * D;                                                              \
            if (ctx == 0) { memset(og, 0, sizeof(float) * (size_t)(nh * G * D)); continue; }                   \
            if (D == 64) { GROUP_CASES(TASK, 64) }                                                              \
            else if (D == 128) { GROUP_CASES(TASK, 128) }                                                       \
            else { GROUP_CASES(TASK, 256) }                                                                     \
        }                                                                                                       \
        free(scores);                                                                                           \
        free(qs);                                                                                               \
        free(rows);                                                                                             \
    }                                                                                                           \
}
#define ARGS nh, qg, k_pool, v_pool, rows, ctx, h, qs, scores, og, scale, softcap
DEFINE_FAST_KERNEL(fast_f32, float, group_task_f32)
DEFINE_FAST_KERNEL(fast_bf16, uint16_t, group_task_bf16)
#undef ARGS

static int fast_path(int64_t H, int64_t KVH, int64_t D) {
    return (D == 64 || D == 128 || D == 256) && H % KVH == 0 && H / KVH <= 8;
}

/* The decode kernels' argument checks (debug build only, check.h): the generic kernel's limits unless the
 * fast path takes the shape, and every context within its row of the block table. */
#define DECODE_CHECKS()                                                                                        \
    CHECK(B >= 0, B);                                                                                          \
    CHECK(KVH > 0, KVH);                                                                                       \
    CHECK(H > 0 && H % KVH == 0, H);                                                                           \
    CHECK(fast_path(H, KVH, D) || H / KVH <= MAX_GROUP, H / KVH);                                              \
    CHECK(fast_path(H, KVH, D) || H <= MAX_GROUP * 64, H);                                                     \
    CHECK(D > 0 && (fast_path(H, KVH, D) || D % 16 == 0), D);                                                  \
    CHECK(block_size > 0, block_size);                                                                         \
    CHECK(max_blocks >= 0, max_blocks);                                                                        \
    CHECK_PTR(q, B);                                                                                           \
    CHECK_PTR(k_pool, B);                                                                                      \
    CHECK_PTR(v_pool, B);                                                                                      \
    CHECK_PTR(block_tables, B);                                                                                \
    CHECK_PTR(context_lens, B);                                                                                \
    CHECK_PTR(out, B);                                                                                         \
    CHECK_EACH(b, B, context_lens[b] >= 0 && context_lens[b] <= max_blocks * block_size, context_lens[b]);     \
    CHECK_EACH(i, B * max_blocks, block_tables[i] >= 0, block_tables[i])

void paged_decode_attention_f32(const float *q, const float *k_pool, const float *v_pool,
                                const int64_t *block_tables, const int64_t *context_lens, float *out, int64_t B,
                                int64_t H, int64_t KVH, int64_t D, int64_t block_size, int64_t max_blocks,
                                float scale, int64_t window, float softcap, int num_threads) {
    DECODE_CHECKS();
    (fast_path(H, KVH, D) ? fast_f32 : generic_f32)(q, k_pool, v_pool, block_tables, context_lens, out, B, H,
                                                    KVH, D, block_size, max_blocks, scale, window, softcap, num_threads);
}

void paged_decode_attention_bf16(const float *q, const uint16_t *k_pool, const uint16_t *v_pool,
                                 const int64_t *block_tables, const int64_t *context_lens, float *out,
                                 int64_t B, int64_t H, int64_t KVH, int64_t D, int64_t block_size,
                                 int64_t max_blocks, float scale, int64_t window, float softcap,
                                 int num_threads) {
    DECODE_CHECKS();
    (fast_path(H, KVH, D) ? fast_bf16 : generic_bf16)(q, k_pool, v_pool, block_tables, context_lens, out, B, H,
                                                      KVH, D, block_size, max_blocks, scale, window, softcap, num_threads);
}

/* --- Prefill: a chunk's causal attention, query rows and heads across the vector lanes. ---
 *
 * A chunk of n new rows over a sequence of ctx cached positions (the chunk's own K/V included, its
 * queries at positions ctx - n .. ctx - 1). A task is R = W / GL consecutive rows x one KV head x GL of its G
 * query heads (GL = G where G <= W, else W; the caller checks that W divides G then): their
 * R x GL query vectors sit in the lanes of one vector (transposed once per task), so each cached
 * element multiplies all of them at once (a broadcast and one FMA) and no dot product needs a horizontal
 * sum. Each KV head's K and V are first widened into float32 scratch in position order, once a call. Scores are kept
 * per position as a vector over the lanes; the softmax runs lane-wise; the weighted sum of V walks the
 * positions with PF_DIMS output dimensions' lane vectors in registers. The rows of a task differ only in
 * their last few visible positions, which are masked lane by lane. */

#define PF_TILE (ACC_REGS >= 16 ? 8 : 4) /* positions a pass of the scores: independent FMA chains */
#define PF_DIMS (ACC_REGS >= 16 ? 16 : 8) /* output dimensions a pass: lane vectors kept in registers */

static inline __attribute__((always_inline)) void prefill_task(
    int64_t D, int64_t L, const float *kf, const float *vals, const vf *qt, vf *s, const vf *mask_from,
    int64_t first_masked, const vf *mask_to, int64_t last_masked, float softcap, vf *acc_out) {
    /* scores s[t] = sum_d qt[d] * kf[t][d] */
    int64_t t = 0;
    for (; t + PF_TILE <= L; t += PF_TILE) {
        vf a[PF_TILE];
        for (int j = 0; j < PF_TILE; j++) a[j] = (vf){0};
        const float *k0 = kf + t * D;
        for (int64_t d = 0; d < D; d++) {
            const vf qd = qt[d];
            for (int j = 0; j < PF_TILE; j++) a[j] += qd * k0[j * D + d];
        }
        for (int j = 0; j < PF_TILE; j++) s[t + j] = a[j];
    }
    for (; t < L; t++) {
        vf a = {0};
        for (int64_t d = 0; d < D; d++) a += qt[d] * kf[t * D + d];
        s[t] = a;
    }
    if (softcap > 0.f)
        for (t = 0; t < L; t++) s[t] = vsoftcap(s[t], softcap);
    /* window: position t < last_masked is hidden from the lanes whose mask_to[t] is all ones (their windows
     * start after it) */
    for (t = 0; t < last_masked; t++)
        s[t] = (vf)(((vi)mask_to[t] & (vi)((vf){0} - INFINITY)) | (~(vi)mask_to[t] & (vi)s[t]));
    /* causal mask: position t >= first_masked is hidden from the lanes whose mask_from[t - first_masked]
     * is all ones (their rows end before it) */
    for (t = first_masked; t < L; t++)
        s[t] = (vf)(((vi)mask_from[t - first_masked] & (vi)((vf){0} - INFINITY)) |
                      (~(vi)mask_from[t - first_masked] & (vi)s[t]));
    vf m = (vf){0} - INFINITY;
    for (t = 0; t < L; t++) m = (vf)(((vi)(s[t] > m) & (vi)s[t]) | (~(vi)(s[t] > m) & (vi)m));
    vf sum = {0};
    for (t = 0; t < L; t++) {
        s[t] = vexp_nonpositive(s[t] - m);
        sum += s[t];
    }
    const vf inv = 1.f / sum;
    /* out[d] (a lane vector) = sum_t s[t] * vals[t][d], PF_DIMS dimensions at a time */
    for (int64_t d0 = 0; d0 < D; d0 += PF_DIMS) {
        vf o[PF_DIMS];
        for (int j = 0; j < PF_DIMS; j++) o[j] = (vf){0};
        for (t = 0; t < L; t++) {
            const vf p = s[t];
            const float *v = vals + t * D + d0;
            for (int j = 0; j < PF_DIMS; j++) o[j] += p * v[j];
        }
        for (int j = 0; j < PF_DIMS; j++) acc_out[d0 + j] = o[j] * inv;
    }
}

/* A task of the batched call: LANES / G rows (from `row`) of one chunk x one KV head, over `visible` positions. */
typedef struct {
    int64_t chunk, row, h, g0, visible;
} prefill_task_t;

static int longer_first(const void *a, const void *b) {
    const int64_t va = ((const prefill_task_t *)a)->visible, vb = ((const prefill_task_t *)b)->visible;
    return va < vb ? 1 : va > vb ? -1 : 0;
}

/* Every prefill chunk of a step in one call: chunk c is spans[c] = {first row in q/out, rows n, context ctx}
 * over the blocks tables[c][0 ..] (a row of max_blocks). One parallel region shares all chunks' tasks out,
 * longest first, so that threads do not finish each chunk's call unevenly and wait. q and out [rows, H, D] are float32, or bfloat16 where io_bf16 (read and
 * rounded here, in the tasks' transposes, instead of torch's conversions before and after: a pass less). */
#define DEFINE_PREFILL(NAME, ELEM, LOADW)                                                                      \
void NAME(const void *q, const ELEM *k_pool, const ELEM *v_pool, const int64_t *tables, int64_t max_blocks,    \
          const int64_t *spans, int64_t num_chunks, void *out, int io_bf16, int64_t H, int64_t KVH, int64_t D, \
          int64_t block_size, float scale, int64_t window, float softcap, int num_threads) {                   \
    CHECK(num_chunks >= 0, num_chunks);                                                                        \
    CHECK(KVH > 0, KVH);                                                                                       \
    CHECK(H > 0 && H % KVH == 0, H);                                                                           \
    CHECK(H / KVH <= W || H / KVH % W == 0, H / KVH);                                                          \
    CHECK(D > 0 && D % W == 0, D);                                                                             \
    CHECK(block_size > 0, block_size);                                                                         \
    CHECK(max_blocks >= 0, max_blocks);                                                                        \
    CHECK_PTR(q, num_chunks);                                                                                  \
    CHECK_PTR(k_pool, num_chunks);                                                                             \
    CHECK_PTR(v_pool, num_chunks);                                                                             \
    CHECK_PTR(tables, num_chunks);                                                                             \
    CHECK_PTR(spans, num_chunks);                                                                              \
    CHECK_PTR(out, num_chunks);                                                                                \
    CHECK_EACH(c, num_chunks, spans[3 * c] >= 0, spans[3 * c]);                                                \
    CHECK_EACH(c, num_chunks, spans[3 * c + 1] >= 0 && spans[3 * c + 1] <= spans[3 * c + 2], spans[3 * c + 1]); \
    CHECK_EACH(c, num_chunks, spans[3 * c + 2] <= max_blocks * block_size, spans[3 * c + 2]);                  \
    CHECK_EACH(i, num_chunks * max_blocks, tables[i] >= 0, tables[i]);                                         \
    const int64_t G = H / KVH, GL = G <= W ? G : W, R = W / GL, row = KVH * D;                                   \
    int64_t total_ctx = 0, tasks = 0, max_ctx = 0;                                                              \
    for (int64_t c = 0; c < num_chunks; c++) {                                                                  \
        const int64_t n = spans[3 * c + 1], ctx = spans[3 * c + 2];                                             \
        total_ctx += ctx;                                                                                       \
        tasks += (n + R - 1) / R * KVH * (G / GL);                                                              \
        if (ctx > max_ctx) max_ctx = ctx;                                                                       \
    }                                                                                                           \
    /* rows[p]: pool offset of the p-th position of all chunks in turn (chunk c's from base[c]) */             \
    int64_t *rows = (int64_t *)malloc(sizeof(int64_t) * (size_t)(total_ctx + 1));                              \
    int64_t *base = (int64_t *)malloc(sizeof(int64_t) * (size_t)(num_chunks + 1));                             \
    prefill_task_t *list = (prefill_task_t *)malloc(sizeof(prefill_task_t) * (size_t)(tasks + 1));              \
    for (int64_t c = 0, p = 0, k = 0; c < num_chunks; c++) {                                                    \
        const int64_t n = spans[3 * c + 1], ctx = spans[3 * c + 2];                                             \
        const int64_t *table = tables + c * max_blocks;                                                         \
        base[c] = p;                                                                                            \
        for (int64_t blk = 0, t = 0; t < ctx; blk++) {                                                          \
            const int64_t at = table[blk] * block_size * row;                                                   \
            for (int64_t j = 0; j < block_size && t < ctx; j++, t++) rows[p++] = at + j * row;                  \
        }                                                                                                       \
        for (int64_t r0 = 0; r0 < n; r0 += R)                                                                   \
            for (int64_t h = 0; h < KVH; h++)                                                                   \
                for (int64_t g0 = 0; g0 < G; g0 += GL)                                                          \
                    list[k++] = (prefill_task_t){c, r0, h, g0, ctx - n + (n - r0 < R ? n : r0 + R)};            \
    }                                                                                                           \
    base[num_chunks] = total_ctx;                                                                               \
    qsort(list, (size_t)tasks, sizeof *list, longer_first);                                                     \
    /* every chunk's K and V per KV head, widened to float32 in position order: chunk c's head h at            \
     * (base[c] * KVH + h * ctx) * D */                                                                         \
    float *kf = (float *)aligned_alloc(64, sizeof(float) * (size_t)(KVH * total_ctx * D + 64));                \
    float *vfb = (float *)aligned_alloc(64, sizeof(float) * (size_t)(KVH * total_ctx * D + 64));               \
    _Pragma("omp parallel num_threads(tasks < num_threads ? (int)tasks : num_threads)")                        \
    {                                                                                                           \
        _Pragma("omp for schedule(static)")                                                                     \
        for (int64_t p = 0; p < total_ctx; p++) {                                                               \
            int64_t c = 0;                                                                                      \
            while (base[c + 1] <= p) c++;                                                                       \
            const int64_t ctx = spans[3 * c + 2], t = p - base[c];                                              \
            for (int64_t h = 0; h < KVH; h++)                                                                   \
                for (int64_t d = 0; d < D; d += W) {                                                           \
                    const int64_t at = (base[c] * KVH + h * ctx + t) * D + d;                                   \
                    *(vf *)(kf + at) = LOADW(k_pool + rows[p] + h * D + d);                                  \
                    *(vf *)(vfb + at) = LOADW(v_pool + rows[p] + h * D + d);                                 \
                }                                                                                               \
        }                                                                                                       \
        vf *qt = (vf *)aligned_alloc(64, sizeof(vf) * (size_t)D);                                         \
        vf *s = (vf *)aligned_alloc(64, sizeof(vf) * (size_t)(max_ctx + 1));                              \
        vf *acc = (vf *)aligned_alloc(64, sizeof(vf) * (size_t)D);                                        \
        vf mask_from[W], mask_to[W];                                                                          \
        _Pragma("omp for schedule(dynamic, 1)")                                                                 \
        for (int64_t i = 0; i < tasks; i++) {                                                                   \
            const prefill_task_t task = list[i];                                                                \
            const int64_t c = task.chunk, h = task.h, g0 = task.g0, r0 = task.row, L = task.visible;            \
            const int64_t first = spans[3 * c], n = spans[3 * c + 1], ctx = spans[3 * c + 2];                   \
            const int64_t nr = n - r0 < R ? n - r0 : R;                                                         \
            const int64_t first_masked = L - nr + 1;             /* the first row sees up to here */           \
            const int64_t lo = window_start(L - nr + 1, window);  /* the first row sees from here */           \
            const int64_t last_masked = window_start(L, window);  /* the last row sees from here */            \
            for (int64_t d = 0; d < D; d++) {                                                                   \
                vf col = {0};                                                                                 \
                for (int64_t r = 0; r < nr; r++)                                                                \
                    for (int64_t g = 0; g < GL; g++) {                                                          \
                        const int64_t at = ((first + r0 + r) * H + h * G + g0 + g) * D + d;                     \
                        col[r * GL + g] = (io_bf16 ? bf16_to_f32(((const uint16_t *)q)[at]) : ((const float *)q)[at]) * scale; \
                    }                                                                                           \
                qt[d] = col;                                                                                    \
            }                                                                                                   \
            for (int64_t t = first_masked; t < L; t++) {          /* hidden from rows ending before t */       \
                vi m = {0};                                                                                   \
                for (int64_t r = 0; r < nr; r++)                                                                \
                    if (ctx - n + r0 + r + 1 <= t)                                                              \
                        for (int64_t g = 0; g < GL; g++) m[r * GL + g] = -1;                                    \
                mask_from[t - first_masked] = (vf)m;                                                          \
            }                                                                                                   \
            for (int64_t t = lo; t < last_masked; t++) {          /* before the window of rows after t */      \
                vi m = {0};                                                                                   \
                for (int64_t r = 0; r < nr; r++)                                                                \
                    if (window_start(ctx - n + r0 + r + 1, window) > t)                                         \
                        for (int64_t g = 0; g < GL; g++) m[r * GL + g] = -1;                                    \
                mask_to[t - lo] = (vf)m;                                                                      \
            }                                                                                                   \
            const int64_t at = (base[c] * KVH + h * ctx + lo) * D;                                              \
            prefill_task(D, L - lo, kf + at, vfb + at, qt, s, mask_from, first_masked - lo, mask_to,            \
                         last_masked - lo, softcap, acc);                                                       \
            for (int64_t r = 0; r < nr; r++)                                                                    \
                for (int64_t g = 0; g < GL; g++) {                                                              \
                    const int64_t at = ((first + r0 + r) * H + h * G + g0 + g) * D;                             \
                    if (io_bf16)                                                                                \
                        for (int64_t d = 0; d < D; d++) ((uint16_t *)out)[at + d] = f32_to_bf16(acc[d][r * GL + g]); \
                    else                                                                                        \
                        for (int64_t d = 0; d < D; d++) ((float *)out)[at + d] = acc[d][r * GL + g];            \
                }                                                                                               \
        }                                                                                                       \
        free(qt);                                                                                               \
        free(s);                                                                                                \
        free(acc);                                                                                              \
    }                                                                                                           \
    free(kf);                                                                                                   \
    free(vfb);                                                                                                  \
    free(rows);                                                                                                 \
    free(base);                                                                                                 \
    free(list);                                                                                                 \
}

DEFINE_PREFILL(paged_prefill_attention_f32, float, vload_f32)
DEFINE_PREFILL(paged_prefill_attention_bf16, uint16_t, vload_bf16)
