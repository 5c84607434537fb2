/* Argument checks of the exported kernels, compiled only into the debug build (-DPRESCIENT_KERNEL_DEBUG:
 * `python -m runtime.kernels.build --debug`, loaded where PRESCIENT_KERNEL_DEBUG=1). A violated check prints
 * one line naming the kernel, the argument and its value to stderr and aborts, instead of letting the kernel
 * read or write out of bounds. In the release build every macro here expands to nothing: no cost.
 *
 *   CHECK(cond, arg)            arg (an integer) must satisfy cond
 *   CHECK_PTR(p, n)             p must not be NULL where it holds n > 0 elements
 *   CHECK_EACH(i, n, cond, arg) cond holds for i = 0 .. n - 1 (arg: the element, e.g. context_lens[i])
 */
#ifndef PRESCIENT_CHECK_H
#define PRESCIENT_CHECK_H

#ifdef PRESCIENT_KERNEL_DEBUG
#include <stdio.h>
#include <stdlib.h>

#define KERNEL_FAIL(what, value, cond)                                                                         \
    do {                                                                                                       \
        fprintf(stderr, "prescient kernel %s: argument %s = %lld violates %s\n", __func__, what,              \
                (long long)(value), cond);                                                                     \
        abort();                                                                                               \
    } while (0)
#define CHECK(cond, arg)                                                                                       \
    do {                                                                                                       \
        if (!(cond)) KERNEL_FAIL(#arg, (arg), #cond);                                                          \
    } while (0)
#define CHECK_PTR(p, n)                                                                                        \
    do {                                                                                                       \
        if ((n) > 0 && (p) == NULL) KERNEL_FAIL(#p, 0, #p " != NULL");                                         \
    } while (0)
#define CHECK_EACH(i, n, cond, arg)                                                                            \
    do {                                                                                                       \
        for (int64_t i = 0; i < (n); i++)                                                                      \
            if (!(cond)) {                                                                                     \
                fprintf(stderr, "prescient kernel %s: argument %s = %lld at %s = %lld violates %s\n",          \
                        __func__, #arg, (long long)(arg), #i, (long long)i, #cond);                            \
                abort();                                                                                       \
            }                                                                                                  \
    } while (0)
#else
#define CHECK(cond, arg) ((void)0)
#define CHECK_PTR(p, n) ((void)0)
#define CHECK_EACH(i, n, cond, arg) ((void)0)
#endif

#endif
