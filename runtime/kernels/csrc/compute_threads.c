/* The kernel threads' Linux thread ids, so the engine can read each one's scheduler statistics
 * (/proc/self/task/TID/schedstat: time run and time spent runnable but waiting for a core) and tell whether
 * it shares its cores (runtime/engine/cpu_share.py). The OpenMP runtime keeps one pool of threads for
 * every parallel region of a process, so the ids one region sees are those every kernel runs on. */
#define _GNU_SOURCE
#include <omp.h>
#include <stdint.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "kernels.h"

int compute_thread_ids(int num_threads, int64_t *out) {
    int n = 1;
    if (num_threads < 1) return 0;
    _Pragma("omp parallel num_threads(num_threads)")
    {
        const int i = omp_get_thread_num();
        if (i < num_threads) out[i] = (int64_t)syscall(SYS_gettid);
        _Pragma("omp single")
        n = omp_get_num_threads();
    }
    return n;
}
