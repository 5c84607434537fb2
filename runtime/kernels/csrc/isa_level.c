/* What a build of the kernels says about itself: whether this CPU can run it, and its vector width.
 *
 * runtime/kernels/library.py builds every kernel once per instruction-set level and, at load, asks each
 * library in turn, best level first. prescient_cpu_supports() is compiled for the x86-64 baseline whatever
 * the library's -march, so calling it is safe on any x86-64 CPU; it checks (through libgcc's CPUID reader,
 * which also asks the OS whether it saves the wide registers) every feature the build's flags enabled. */
#include "kernels.h"
#include "vector_exp.h"

#if defined(__x86_64__) || defined(__i386__)
__attribute__((target("arch=x86-64"))) int prescient_cpu_supports(void) {
    __builtin_cpu_init();
    int ok = 1;
#if defined(__AVX512F__)
    ok = ok && __builtin_cpu_supports("x86-64-v4");
#elif defined(__AVX2__)
    ok = ok && __builtin_cpu_supports("x86-64-v3");
#endif
#if defined(__AVX512VNNI__)
    ok = ok && __builtin_cpu_supports("avx512vnni");
#endif
#if defined(__AVX512BF16__)
    ok = ok && __builtin_cpu_supports("avx512bf16");
#endif
    return ok;
}
#else
int prescient_cpu_supports(void) { return 1; } /* the portable build: the compiler's default target */
#endif

int prescient_vector_lanes(void) { return W; }
