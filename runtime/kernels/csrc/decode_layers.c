/* The layers of a step that only decodes, in one call: for each layer the same kernels, in the same order
 * and with the same arguments, as the model's Python loop (runtime/model/model.py, _forward_native) makes them,
 * so the result is the same bit for bit. From Python each call costs wrapping (tensor allocation, data_ptr,
 * ctypes) comparable to the smaller kernels themselves, a larger share of a one-sequence step
 * (`python -m tests.bench engine`, decode rows).
 *
 * A projection is GGUF-style blocks in the one-row kernel's layout (quantized_matmul) and/or the many-row
 * kernel's (quantized_gemm), routed by the row count as Int4Linear routes it: up to native_rows rows the
 * first, from gemm_rows rows the second (the caller checks that one of them takes M). */
#include <stddef.h>
#include <stdint.h>

#include "check.h"
#include "kernels.h"

typedef struct projection {
    const uint8_t *codes;      /* the one-row kernel's layout (NULL: none) */
    const uint16_t *scale, *offset;
    const uint8_t *tiles;      /* the many-row kernel's layout (NULL: none) */
    const uint16_t *tscale, *toffset;
    int64_t n, k, bits;
    int64_t native_rows;       /* the one-row kernel up to this many rows (-1: never) */
    int64_t gemm_rows;         /* the many-row kernel from this many rows (-1: never) */
    const struct projection *next; /* a projection stacked from parts of different kinds (StackedMatmul): the
                                    * next part, whose columns follow this one's, each part in its own tiles
                                    * (NULL: the last part, or a projection of one kind) */
} projection_t;

typedef struct decode_layer {
    projection_t qkv, o, gate_up, down;
    const void *post_norm;     /* post-attention RMSNorm weight (the MLP's input norm) */
    const void *next_norm;     /* the next layer's input norm, or the final norm after the last layer */
    void *k_cache, *v_cache;   /* [blocks, block_size, KVH, D] in the model dtype */
    const void *qkv_bias;      /* [(H + 2 KVH) D] or NULL (Qwen 2) */
    const void *q_norm, *k_norm;               /* [D] per-head RMSNorm before RoPE, or NULL (Qwen 3, Gemma 3) */
    const void *attn_out_norm, *mlp_out_norm;  /* sandwich norms on the branch outputs, or NULL (Gemma 2/3) */
    const void *cos, *sin_signed;              /* this layer's RoPE tables (Gemma 3's local layers: their own) */
    int64_t window;            /* sliding window in keys (<= 0: none) */
    float softcap;             /* attention score soft-cap (<= 0: none) */
} decode_layer_t;

typedef struct decode_model {
    int64_t hidden, heads, kv_heads, head_dim, intermediate, block_size;
    float eps, scale;
    int bf16;                  /* the model dtype: bfloat16 (1) or float32 (0); K/V likewise */
    int gelu;                  /* the MLP's activation: GELU's tanh approximation (1) or SiLU (0) */
} decode_model_t;

/* Scratch and the step's inputs, rows M; h holds the embeddings on entry, x receives the final normalised
 * hidden states. */
typedef struct decode_step {
    int64_t M, max_blocks;
    const int64_t *positions, *slots, *block_tables, *context_lens;
    const void *first_norm;
    void *h, *x, *qkv, *o, *gate_up, *act, *down;  /* model dtype */
    float *q, *attn;                              /* float32 */
} decode_step_t;

static int one_row(const projection_t *p, int64_t M) { return p->native_rows >= 0 && M <= p->native_rows; }

static void project(const projection_t *p, const void *x, int x_bf16, int64_t M, void *out, int out_bf16,
                    int threads) {
    if (p->next) { /* stacked parts: each into its own columns of the one output */
        int64_t width = 0, column = 0;
        for (const projection_t *part = p; part; part = part->next) width += part->n;
        for (const projection_t *part = p; part; part = part->next) {
            quantized_gemm(x, x_bf16, M, part->k, part->tiles, part->tscale, part->toffset, part->n,
                           (int)part->bits, (char *)out + column * (out_bf16 ? 2 : 4), width, out_bf16, 0, 0,
                           threads);
            column += part->n;
        }
        return;
    }
    if (one_row(p, M))
        quantized_matmul(x, x_bf16, M, p->k, p->codes, p->scale, p->offset, p->n, (int)p->bits, out, out_bf16,
                         0, threads);
    else
        quantized_gemm(x, x_bf16, M, p->k, p->tiles, p->tscale, p->toffset, p->n, (int)p->bits, out, 0, out_bf16,
                       0, 0, threads);
}

void decode_layers(const decode_model_t *m, const decode_layer_t *layers, int64_t num_layers, const decode_step_t *s,
                   int threads) {
    CHECK(num_layers >= 0, num_layers);
    CHECK(threads > 0, threads);
    CHECK_PTR(m, 1);
    CHECK_PTR(s, 1);
    CHECK_PTR(layers, num_layers);
    const int64_t M = s->M, H = m->heads, KVH = m->kv_heads, D = m->head_dim;
    const int bf16 = m->bf16;
    add_rms_norm(s->h, NULL, s->first_norm, s->x, M, m->hidden, m->eps, bf16, threads);
    for (int64_t i = 0; i < num_layers; i++) {
        const decode_layer_t *l = &layers[i];
        project(&l->qkv, s->x, bf16, M, s->qkv, bf16, threads);
        rope_write_kv(s->qkv, l->qkv_bias, l->q_norm, l->k_norm, m->eps, s->positions, l->cos, l->sin_signed, s->q,
                      l->k_cache, l->v_cache, s->slots, M, H, KVH, D, bf16, 1, threads);
        if (bf16)
            paged_decode_attention_bf16(s->q, (const uint16_t *)l->k_cache, (const uint16_t *)l->v_cache,
                                        s->block_tables, s->context_lens, s->attn, M, H, KVH, D, m->block_size,
                                        s->max_blocks, m->scale, l->window, l->softcap, threads);
        else
            paged_decode_attention_f32(s->q, (const float *)l->k_cache, (const float *)l->v_cache, s->block_tables,
                                       s->context_lens, s->attn, M, H, KVH, D, m->block_size, s->max_blocks, m->scale,
                                       l->window, l->softcap, threads);
        project(&l->o, s->attn, 0, M, s->o, bf16, threads);
        if (l->attn_out_norm) { /* the normalised branch into the free `down` scratch, then added */
            add_rms_norm(s->o, NULL, l->attn_out_norm, s->down, M, m->hidden, m->eps, bf16, threads);
            add_rms_norm(s->h, s->down, l->post_norm, s->x, M, m->hidden, m->eps, bf16, threads);
        } else {
            add_rms_norm(s->h, s->o, l->post_norm, s->x, M, m->hidden, m->eps, bf16, threads);
        }
        if (m->gelu) {
            project(&l->gate_up, s->x, bf16, M, s->gate_up, bf16, threads);
            gelu_mul(s->gate_up, s->act, M, m->intermediate, bf16, threads);
        } else if (one_row(&l->gate_up, M) || l->gate_up.n % 64 || l->gate_up.next) {
            project(&l->gate_up, s->x, bf16, M, s->gate_up, bf16, threads);
            silu_mul(s->gate_up, s->act, M, m->intermediate, bf16, threads);
        } else { /* SiLU x up in the matmul's epilogue, as LlamaModel's loop (Int4Linear.silu_mul_into) */
            const projection_t *p = &l->gate_up;
            quantized_gemm(s->x, bf16, M, p->k, p->tiles, p->tscale, p->toffset, p->n, (int)p->bits, s->act, 0,
                           bf16, 1, 0, threads);
        }
        project(&l->down, s->act, bf16, M, s->down, bf16, threads);
        if (l->mlp_out_norm) { /* the normalised branch into the free `o` scratch, then added */
            add_rms_norm(s->down, NULL, l->mlp_out_norm, s->o, M, m->hidden, m->eps, bf16, threads);
            add_rms_norm(s->h, s->o, l->next_norm, s->x, M, m->hidden, m->eps, bf16, threads);
        } else {
            add_rms_norm(s->h, s->down, l->next_norm, s->x, M, m->hidden, m->eps, bf16, threads);
        }
    }
}

/* Rows row0 .. row1 - 1 of the same step, their whole layer loop on the calling thread. Where the cores are
 * shared with other processes (runtime/engine/cpu_share.py) the engine runs a step's rows in parts, each on a
 * thread of its own, with no barrier between them but the step's end: a thread the kernel deschedules delays
 * only its own rows instead of every kernel's end, at the price of each part reading the weights itself. The
 * parts must not depend on each other: a sequence verifying proposals has a row per proposal, each attending
 * to the keys the earlier ones write, so its rows stay in one part (the caller cuts at sequences). A row's
 * result is decode_layers's for the part's rows alone (the caller checks that the projections take the part's
 * row count). */
void decode_layers_rows(const decode_model_t *m, const decode_layer_t *layers, int64_t num_layers,
                        const decode_step_t *s, int64_t row0, int64_t row1) {
    CHECK(row0 >= 0 && row0 <= row1, row0);
    CHECK(row1 <= s->M, row1);
    const int64_t e = m->bf16 ? 2 : 4, H = m->heads, KVH = m->kv_heads, D = m->head_dim, r0 = row0;
    decode_step_t p = *s;
    p.M = row1 - row0;
    p.positions = s->positions + r0;
    p.slots = s->slots + r0;
    p.context_lens = s->context_lens + r0;
    p.block_tables = s->block_tables + r0 * s->max_blocks;
    p.h = (char *)s->h + r0 * m->hidden * e;
    p.x = (char *)s->x + r0 * m->hidden * e;
    p.o = (char *)s->o + r0 * m->hidden * e;
    p.down = (char *)s->down + r0 * m->hidden * e;
    p.qkv = (char *)s->qkv + r0 * (H + 2 * KVH) * D * e;
    p.gate_up = (char *)s->gate_up + r0 * 2 * m->intermediate * e;
    p.act = (char *)s->act + r0 * m->intermediate * e;
    p.q = s->q + r0 * H * D;
    p.attn = s->attn + r0 * H * D;
    if (p.M > 0) decode_layers(m, layers, num_layers, &p, 1);
}
