/* Calls one kernel of runtime/kernels/csrc on inputs from a file and writes its buffers back: the aarch64 test
 * (tests/runtime/test_native_aarch64.py) runs it under qemu-user and compares the results with PyTorch.
 *
 *   kernel_driver NAME ARGS OUT
 *
 * ARGS is the kernel's arguments in order, each a tag byte and its value (little-endian): 'q' int64, 'i' int32,
 * 'f' float32, 'p' a buffer (uint64 length, then its bytes; the kernel gets a pointer to a copy), 'z' NULL.
 * OUT receives every buffer after the call, in order (uint64 length, bytes). */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"

#define MAX_ARGS 32

typedef struct {
    char tag;
    int64_t q;
    int32_t i;
    float f;
    uint64_t len;
    void *p;
} arg_t;

static arg_t args[MAX_ARGS];
static int nargs;

static void read_or_die(void *dst, size_t n, FILE *f) {
    if (fread(dst, 1, n, f) != n) {
        fprintf(stderr, "short argument file\n");
        exit(2);
    }
}

#define Q(k) args[k].q
#define I(k) args[k].i
#define F(k) args[k].f
#define P(k) args[k].p

int main(int argc, char **argv) {
    if (argc != 4) {
        fprintf(stderr, "usage: kernel_driver NAME ARGS OUT\n");
        return 2;
    }
    FILE *in = fopen(argv[2], "rb");
    if (!in) return 2;
    char tag;
    while (nargs < MAX_ARGS && fread(&tag, 1, 1, in) == 1) {
        arg_t *a = &args[nargs++];
        a->tag = tag;
        if (tag == 'q') read_or_die(&a->q, 8, in);
        else if (tag == 'i') read_or_die(&a->i, 4, in);
        else if (tag == 'f') read_or_die(&a->f, 4, in);
        else if (tag == 'p') {
            read_or_die(&a->len, 8, in);
            a->p = aligned_alloc(64, (a->len + 63) / 64 * 64 + 64);
            read_or_die(a->p, a->len, in);
        } else if (tag != 'z') return 2;
    }
    fclose(in);
    const char *name = argv[1];
    if (!strcmp(name, "add_rms_norm"))
        add_rms_norm(P(0), P(1), P(2), P(3), Q(4), Q(5), F(6), I(7), I(8));
    else if (!strcmp(name, "silu_mul"))
        silu_mul(P(0), P(1), Q(2), Q(3), I(4), I(5));
    else if (!strcmp(name, "rope_write_kv"))
        rope_write_kv(P(0), P(1), P(2), P(3), F(4), P(5), P(6), P(7), P(8), P(9), P(10), P(11), Q(12), Q(13), Q(14),
                      Q(15), I(16), I(17), I(18));
    else if (!strcmp(name, "gelu_mul"))
        gelu_mul(P(0), P(1), Q(2), Q(3), I(4), I(5));
    else if (!strcmp(name, "paged_decode_attention_f32"))
        paged_decode_attention_f32(P(0), P(1), P(2), P(3), P(4), P(5), Q(6), Q(7), Q(8), Q(9), Q(10), Q(11), F(12),
                                   Q(13), F(14), I(15));
    else if (!strcmp(name, "paged_decode_attention_bf16"))
        paged_decode_attention_bf16(P(0), P(1), P(2), P(3), P(4), P(5), Q(6), Q(7), Q(8), Q(9), Q(10), Q(11), F(12),
                                    Q(13), F(14), I(15));
    else if (!strcmp(name, "paged_prefill_attention_bf16"))
        paged_prefill_attention_bf16(P(0), P(1), P(2), P(3), Q(4), P(5), Q(6), P(7), I(8), Q(9), Q(10), Q(11), Q(12),
                                     F(13), Q(14), F(15), I(16));
    else if (!strcmp(name, "nucleus_sample"))
        nucleus_sample(P(0), Q(1), Q(2), Q(3), P(4), P(5), P(6), P(7), P(8), I(9));
    else if (!strcmp(name, "prescient_vector_lanes"))
        printf("%d\n", prescient_vector_lanes());
    else {
        fprintf(stderr, "unknown kernel %s\n", name);
        return 2;
    }
    FILE *out = fopen(argv[3], "wb");
    if (!out) return 2;
    for (int k = 0; k < nargs; k++)
        if (args[k].tag == 'p') {
            fwrite(&args[k].len, 8, 1, out);
            fwrite(args[k].p, 1, args[k].len, out);
        }
    fclose(out);
    return 0;
}
