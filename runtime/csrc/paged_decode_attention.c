/* Decode attention straight from the paged KV pool (float32, CPU).
 *
 * One query token per sequence. For each (sequence, kv head) the kernel walks
 * the sequence's block table, so no K/V is gathered or copied: each cached
 * vector is read once and shared by the query heads of its group (GQA).
 *
 * Layouts (all contiguous):
 *   q            [B, H, D]
 *   k_pool/v_pool [num_blocks, block_size, KVH, D]
 *   block_tables [B, max_blocks] (int64), context_lens [B] (int64)
 *   out          [B, H, D]
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define MAX_GROUP 16

void paged_decode_attention_f32(const float *q, const float *k_pool, const float *v_pool,
                                const int64_t *block_tables, const int64_t *context_lens, float *out,
                                int64_t B, int64_t H, int64_t KVH, int64_t D, int64_t block_size,
                                int64_t max_blocks, float scale, int num_threads) {
    const int64_t G = H / KVH;
    int64_t max_ctx = 0;
    for (int64_t b = 0; b < B; b++) if (context_lens[b] > max_ctx) max_ctx = context_lens[b];

#pragma omp parallel num_threads(num_threads)
    {
        float *scores = (float *)malloc(sizeof(float) * (size_t)(G * max_ctx + 1));
        float *acc = (float *)malloc(sizeof(float) * (size_t)(G * D));
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < B * KVH; task++) {
            const int64_t b = task / KVH, h = task % KVH;
            const int64_t ctx = context_lens[b];
            const int64_t *table = block_tables + b * max_blocks;
            const float *qh = q + (b * H + h * G) * D;
            float maxs[MAX_GROUP];
            for (int64_t g = 0; g < G; g++) maxs[g] = -INFINITY;
            /* pass 1: scores q.k for every cached position */
            for (int64_t t = 0; t < ctx; t++) {
                const float *k = k_pool + ((table[t / block_size] * block_size + t % block_size) * KVH + h) * D;
                for (int64_t g = 0; g < G; g++) {
                    const float *qg = qh + g * D;
                    float s = 0.f;
#pragma omp simd reduction(+ : s)
                    for (int64_t d = 0; d < D; d++) s += qg[d] * k[d];
                    s *= scale;
                    scores[g * ctx + t] = s;
                    if (s > maxs[g]) maxs[g] = s;
                }
            }
            /* softmax */
            float sums[MAX_GROUP];
            for (int64_t g = 0; g < G; g++) {
                float sum = 0.f;
                float *sg = scores + g * ctx;
                for (int64_t t = 0; t < ctx; t++) { sg[t] = expf(sg[t] - maxs[g]); sum += sg[t]; }
                sums[g] = sum;
            }
            /* pass 2: weighted sum of v */
            memset(acc, 0, sizeof(float) * (size_t)(G * D));
            for (int64_t t = 0; t < ctx; t++) {
                const float *v = v_pool + ((table[t / block_size] * block_size + t % block_size) * KVH + h) * D;
                for (int64_t g = 0; g < G; g++) {
                    const float p = scores[g * ctx + t];
                    float *ag = acc + g * D;
#pragma omp simd
                    for (int64_t d = 0; d < D; d++) ag[d] += p * v[d];
                }
            }
            for (int64_t g = 0; g < G; g++) {
                float *o = out + (b * H + h * G + g) * D;
                const float inv = 1.f / sums[g];
                for (int64_t d = 0; d < D; d++) o[d] = acc[g * D + d] * inv;
            }
        }
        free(scores);
        free(acc);
    }
}
