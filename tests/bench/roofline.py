"""What this machine can do at best, measured now (it is shared and noisy, so never quoted from memory)."""

from __future__ import annotations

import statistics
import time

import torch
import torch.nn.functional as F


def median_seconds(fn, repeat: int = 5, warmup: int = 1) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def memory_bandwidth(nbytes: int = 1 << 30) -> float:
    """Read bandwidth in bytes/s: summing a tensor larger than any cache."""
    x = torch.ones(nbytes // 4, dtype=torch.float32)
    return nbytes / median_seconds(x.sum)


def matmul_flops(
    dtype: torch.dtype, m: int = 512, k: int = 576, n: int = 1536, rounds: int = 7, round_seconds: float = 0.2
) -> float:
    """FLOP/s of a GEMM shaped like the model's projections during prefill: the fastest of `rounds` rounds
    of about round_seconds each, after one warm-up round. Other work on a shared machine only ever slows
    a round down, so the fastest round is the least disturbed one: a ceiling that does not drop when the
    machine is busy (a median of a few single calls varied 2x between runs)."""
    x = torch.randn(m, k).to(dtype)
    w = torch.randn(n, k).to(dtype)
    best = float("inf")
    for r in range(rounds + 1):
        calls, start = 0, time.perf_counter()
        while (elapsed := time.perf_counter() - start) < round_seconds or calls < 3:
            F.linear(x, w)
            calls += 1
        if r:  # round 0 warms up (allocations, the thread team, caches)
            best = min(best, elapsed / calls)
    return 2 * m * k * n / best


def int8_dot_rate(threads: int, level: str, rounds: int = 7, round_seconds: float = 0.1) -> float:
    """Integer ops/s (2 per 8-bit product) of a kernel level's cheapest 8-bit products on registers alone
    (csrc/compute_peak.c): the compute ceiling of a quantized prefill at that level, which none of its
    kernels passes. The fastest of `rounds` rounds, after a warm-up (as matmul_flops)."""
    from runtime.kernels import library as native_kernels

    lib = native_kernels.load_level(level)
    iters, best = 1 << 16, 0.0
    for r in range(rounds + 1):
        start = time.perf_counter()
        products = lib.int8_dot_peak(iters, threads)
        elapsed = time.perf_counter() - start
        if r:
            best = max(best, 2 * products / elapsed)
        while elapsed < round_seconds:  # the next round long enough to time
            iters, elapsed = iters * 2, elapsed * 2
    return best
