/* Every function the kernel library exports, declared once: the files that define them include this (a
 * changed signature fails to compile instead of mismatching), decode_layers.c calls the others through it,
 * and runtime/kernels/library.py's ctypes signatures are checked against it (tests/runtime/
 * test_native_signatures.py). */
#ifndef PRESCIENT_KERNELS_H
#define PRESCIENT_KERNELS_H
#include <stdint.h>

void quantized_matmul(const void *x, int x_bf16, int64_t M, int64_t K, const uint8_t *codes,
                      const uint16_t *scale, const uint16_t *offset, int64_t N, int bits, void *out, int out_bf16,
                      int portable, int num_threads);
void quantized_gemm(const void *x, int x_bf16, int64_t M, int64_t K, const uint8_t *tiles, const uint16_t *tscale,
                    const uint16_t *toffset, int64_t N, int bits, void *out, int64_t ldo, int out_bf16, int silu,
                    int portable, int num_threads);
void add_rms_norm(void *h, const void *delta, const void *weight, void *out, int64_t T, int64_t D, float eps,
                  int bf16, int num_threads);
void silu_mul(const void *gate_up, void *out, int64_t T, int64_t I, int bf16, int num_threads);
void gelu_mul(const void *gate_up, void *out, int64_t T, int64_t I, int bf16, int num_threads);
void rope_write_kv(const void *qkv, const void *bias, const void *q_norm, const void *k_norm, float eps,
                   const int64_t *positions, const void *cos, const void *sin_signed, void *q_out, void *k_cache,
                   void *v_cache, const int64_t *slots, int64_t T, int64_t H, int64_t KVH, int64_t D, int bf16,
                   int q_f32, int num_threads);
/* paged_attention.c: window <= 0 is no sliding window, softcap <= 0 no logit soft-cap */
void paged_decode_attention_f32(const float *q, const float *k_pool, const float *v_pool,
                                const int64_t *block_tables, const int64_t *context_lens, float *out, int64_t B,
                                int64_t H, int64_t KVH, int64_t D, int64_t block_size, int64_t max_blocks,
                                float scale, int64_t window, float softcap, int num_threads);
void paged_decode_attention_bf16(const float *q, const uint16_t *k_pool, const uint16_t *v_pool,
                                 const int64_t *block_tables, const int64_t *context_lens, float *out,
                                 int64_t B, int64_t H, int64_t KVH, int64_t D, int64_t block_size,
                                 int64_t max_blocks, float scale, int64_t window, float softcap, int num_threads);

void paged_prefill_attention_f32(const void *q, const float *k_pool, const float *v_pool, const int64_t *tables,
                                 int64_t max_blocks, const int64_t *spans, int64_t num_chunks, void *out,
                                 int io_bf16, int64_t H, int64_t KVH, int64_t D, int64_t block_size, float scale,
                                 int64_t window, float softcap, int num_threads);
void paged_prefill_attention_bf16(const void *q, const uint16_t *k_pool, const uint16_t *v_pool,
                                  const int64_t *tables, int64_t max_blocks, const int64_t *spans,
                                  int64_t num_chunks, void *out, int io_bf16, int64_t H, int64_t KVH, int64_t D,
                                  int64_t block_size, float scale, int64_t window, float softcap, int num_threads);
int quantized_matmul_vectorized(void);
/* rows ids[0..R) of a weight held only in the tiles, as float32 [R][K] */
void quantized_tiles_rows(const uint8_t *tiles, const uint16_t *tscale, const uint16_t *toffset, int64_t K, int bits,
                          const int64_t *ids, int64_t R, float *out, int num_threads);
/* gguf_relayout.c: a GGUF matrix's blocks into the many-row kernel's tiles; returns the scales float16 misses */
int64_t gguf_relayout(int kind, const uint8_t *src, int64_t row_bytes, const int64_t *rows, int64_t N, int64_t K,
                      void *tiles, void *scale, void *offset, int num_threads);
/* gguf_dequantize.c: a GGUF matrix's blocks to float32 rows; returns -1 for a kind or K it does not take */
int gguf_dequantize(int kind, const uint8_t *src, int64_t row_bytes, const int64_t *rows, int64_t N, int64_t K,
                    float *dst, int num_threads);
void nucleus_sample(const float *logits, int64_t R, int64_t V, int64_t stride, const float *temperature,
                    const float *top_p, const double *uniforms, float *work, int64_t *out, int num_threads);
void greedy_sample(const float *logits, int64_t R, int64_t V, int64_t stride, int64_t *out, int num_threads);

struct decode_model;
struct decode_layer;
struct decode_step;
void decode_layers(const struct decode_model *m, const struct decode_layer *layers, int64_t num_layers,
                   const struct decode_step *s, int threads);
void decode_layers_rows(const struct decode_model *m, const struct decode_layer *layers, int64_t num_layers,
                        const struct decode_step *s, int64_t row0, int64_t row1);

/* compute_threads.c: the kernel threads' Linux thread ids (out[num_threads]); returns how many ran */
int compute_thread_ids(int num_threads, int64_t *out);

/* compute_peak.c: the level's 8-bit products on registers alone, iters rounds a thread; returns how many */
int64_t int8_dot_peak(int64_t iters, int num_threads);

/* isa_level.c: whether this CPU runs this build's instruction-set level, and its vector width in floats */
int prescient_cpu_supports(void);
int prescient_vector_lanes(void);

#endif
