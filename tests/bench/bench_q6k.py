"""Q6_K in its own 6-bit tiles against the Q8_0 re-quantization it replaced, A/B in one process: `python -m
tests.bench q6k` (`PRESCIENT_ISA=avx2` for the AVX2 level). The same random Q6_K matrix is multiplied by the
many-row kernel (every row count: both are C-kernel-only weights, Int4Linear.native_only) from its 6-bit
tiles and from its Q8_0 re-quantization's 8-bit tiles, rounds alternating between the two (medians of
ROUNDS). Shapes: Gemma 3 270M's ffn_down (2048 -> 640) and a 4096 x 4096, at 1, 32 and 512 rows, bfloat16
activations, torch's thread count. `time` is Q6_K's time over Q8_0's; `per byte` is Q6_K's weight bytes per
second over Q8_0's (6.5625 against 8.5 bits a weight: above 1 where the 6-bit tiles stream their bytes
faster)."""

from __future__ import annotations

import statistics
import time

import numpy as np
import torch

from runtime.kernels import library as native_kernels
from runtime.kernels.quantized_matmul import NativeMatmul
from runtime.quant.gguf_blocks import BLOCK_BYTES, GGUFBlocks
from tests.bench.bench_kernel_levels import at_one_thread

ROUNDS = 15
SHAPES = {"ffn_down 2048->640": (640, 2048), "4096 x 4096": (4096, 4096)}
ROWS = (1, 32, 512)


def random_q6_k(n: int, k: int, seed: int = 0) -> GGUFBlocks:
    """Random valid Q6_K blocks: random codes and scales, d a small float16."""
    rng = np.random.default_rng(seed)
    nb = n * k // 256
    raw = rng.integers(0, 256, (nb, BLOCK_BYTES["Q6_K"]), dtype=np.uint8)
    raw[:, 208:210] = (
        (np.abs(rng.standard_normal(nb)) * 1e-3).astype(np.float16).view(np.uint8).reshape(nb, 2)
    )
    return GGUFBlocks.parse("Q6_K", raw, (n, k))


def _seconds(fn, calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls


def run() -> dict:
    return at_one_thread(_run)


def _run() -> dict:
    rows_out = []
    for name, (n, k) in SHAPES.items():
        blocks = random_q6_k(n, k)
        six = NativeMatmul.q6_k(*blocks.q6_k_fields())
        eight = NativeMatmul(*blocks.kernel_blocks().affine(), one_row=False)
        for m in ROWS:
            x = torch.randn(m, k).to(torch.bfloat16)
            calls = max(1, int(2e8 // (n * k * m)) + 1)
            paths = {"Q6_K": lambda x=x, w=six: w.gemm(x), "Q8_0": lambda x=x, w=eight: w.gemm(x)}
            taken: dict[str, list[float]] = {p: [] for p in paths}
            for fn in paths.values():
                fn()
            for _ in range(ROUNDS):
                for p, fn in paths.items():
                    taken[p].append(_seconds(fn, calls))
            t6, t8 = statistics.median(taken["Q6_K"]), statistics.median(taken["Q8_0"])
            rows_out.append(
                {
                    "matrix": name,
                    "rows": m,
                    "Q6_K us": round(t6 * 1e6, 1),
                    "Q8_0 us": round(t8 * 1e6, 1),
                    "time": round(t6 / t8, 3),
                    "per byte": round((six.tiled_nbytes / t6) / (eight.tiled_nbytes / t8), 3),
                    "Q6_K GB/s": round(six.tiled_nbytes / t6 / 1e9, 2),
                    "fastest rounds": round(min(taken["Q6_K"]) / min(taken["Q8_0"]), 3),
                }
            )
    return {
        "title": f"Q6_K 6-bit tiles vs its Q8_0 re-quantization, level {native_kernels.chosen_level()}, "
        "one thread",
        "rows": rows_out,
        "notes": [
            "time: Q6_K / Q8_0 medians (below 1: faster); per byte: Q6_K's weight bytes per second / Q8_0's; "
            "fastest rounds: the time ratio of each path's least disturbed round",
        ],
    }
