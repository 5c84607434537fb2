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


def matmul_flops(dtype: torch.dtype, m: int = 512, k: int = 576, n: int = 1536) -> float:
    """FLOP/s of a GEMM shaped like the model's projections during prefill."""
    x = torch.randn(m, k).to(dtype)
    w = torch.randn(n, k).to(dtype)
    return 2 * m * k * n / median_seconds(lambda: F.linear(x, w), repeat=7)
