"""The many-row kernel alone (csrc/quantized_matmul.c, quantized_gemm) at the Llama 3.2 1B shapes, 512 rows:
`python -m tests.bench gemm_tile`. GOP/s (2 M N K / time) of each packed type's tiles, random codes and scales,
bfloat16 activations and output; the gate-up matrix with the fused SiLU epilogue, as prefill runs it. Beside it,
in the same run, torch's float32 matmul at the same shape (the `vs torch f32` ratio).

Two timings a shape: one thread by the thread's own CPU time (what the loops cost, not counting the time a shared
machine takes the core away) and `BENCH_TILE_THREADS` threads (default 2) by wall time; best of
`BENCH_TILE_ROUNDS` (default 5). `BENCH_TILE_BASELINE=path.so`: also that build of the kernels (e.g. the tree
before a change), rounds alternating, and its ratio. `BENCH_TILE_TYPES=q4_0,q4_k`: only those types."""

from __future__ import annotations

import functools
import os
import time
from pathlib import Path

import numpy as np
import torch

from runtime.kernels import library as native_kernels
from runtime.kernels.quantized_matmul import NativeMatmul
from tests.bench import llama_cpp_native

ROWS = 512
# (name, N, K, fused SiLU): the 1B shape's projections
SHAPES = [
    ("q / o 2048x2048", 2048, 2048, False),
    ("k / v 512x2048", 512, 2048, False),
    ("gate-up 16384x2048", 16384, 2048, True),
    ("down 2048x8192", 2048, 8192, False),
]
TYPES = os.environ.get("BENCH_TILE_TYPES", "q4_0,q4_k,q5_k,q6_k,q8_0").split(",")
ROUNDS = int(os.environ.get("BENCH_TILE_ROUNDS", "5"))
THREADS = int(os.environ.get("BENCH_TILE_THREADS", "2"))


def _weights(kind: str, n: int, k: int, rng: np.random.Generator) -> NativeMatmul:
    """Random codes and scales in the tiles the model makes for `kind` (q5_8bit: Q5_K's codes in the 8-bit
    tiles, the layout the portable level gives it)."""
    scale = (rng.random((n, k // 32)) * 0.01).astype(np.float16)
    if kind == "q4_0":
        return NativeMatmul(rng.integers(0, 16, (n, k), dtype=np.uint8), scale, -8.0, 4, one_row=False)
    if kind in ("q4_k", "q5_k"):
        six = rng.integers(0, 64, (2, n, k // 32))
        d = rng.random((2, n, k // 256)) * 1e-3
        make, top = (NativeMatmul.q4_k, 16) if kind == "q4_k" else (NativeMatmul.q5_k, 32)
        return make(rng.integers(0, top, (n, k), dtype=np.uint8), six[0], six[1], d[0], d[1])
    if kind == "q6_k":
        sc = rng.integers(-128, 128, (n, k // 16))
        return NativeMatmul.q6_k(
            rng.integers(0, 64, (n, k), dtype=np.uint8), sc, rng.random((n, k // 256)) * 1e-3
        )
    top = 32 if kind == "q5_8bit" else 256
    offset = -rng.random((n, k // 32)).astype(np.float16) * 0.1
    return NativeMatmul(rng.integers(0, top, (n, k), dtype=np.uint8), scale, offset, 8, one_row=False)


def _call(lib, w: NativeMatmul, x: torch.Tensor, out: torch.Tensor, silu: bool, threads: int) -> None:
    tiles, scale, offset = w.tiles
    lib.quantized_gemm(
        x.data_ptr(), 1, x.shape[0], w.in_features, tiles.data_ptr(), scale.data_ptr(), offset.data_ptr(),
        w.out_features, w.bits, out.data_ptr(), 0, 1, int(silu), 0, threads,
    )  # fmt: skip


def _best(fn, clock) -> float:
    times = []
    for _ in range(ROUNDS):
        start = clock()
        fn()
        times.append(clock() - start)
    return min(times)


def _shape_row(libs: dict, kind: str, name: str, n: int, k: int, silu: bool, x, rng) -> dict:
    w, ops = _weights(kind, n, k, rng), 2 * ROWS * n * k
    out = torch.empty(ROWS, n // 2 if silu else n, dtype=torch.bfloat16)
    row = {"type": kind, "shape": name}
    best: dict[str, float] = {}
    for threads, clock in ((1, time.thread_time), (THREADS, time.perf_counter)):
        label = "1 thread" if threads == 1 else f"{threads} threads"
        best = {}
        for _ in range(2):  # alternate the builds, each best of ROUNDS
            for lib_name, lib in libs.items():
                t = _best(functools.partial(_call, lib, w, x, out, silu, threads), clock)
                best[lib_name] = min(best.get(lib_name, t), t)
        row[f"GOP/s {label}"] = ops / best["ours"] / 1e9
        if "baseline" in best:
            row[f"vs baseline {label}"] = best["baseline"] / best["ours"]
    torch.set_num_threads(THREADS)
    wf, xf = torch.randn(n, k), x.float()
    row["vs torch f32"] = _best(lambda: xf @ wf.T, time.perf_counter) / best["ours"]
    return row


def run() -> dict:
    libs = {"ours": native_kernels.load()}
    if libs["ours"] is None or not libs["ours"].quantized_matmul_vectorized():
        return {"title": "gemm tile", "rows": [], "notes": ["no vector kernels on this CPU"]}
    baseline = os.environ.get("BENCH_TILE_BASELINE")
    if baseline:
        libs["baseline"] = native_kernels._open(Path(baseline))
    rng = np.random.default_rng(0)
    torch.manual_seed(0)
    xs = {k: torch.randn(ROWS, k).to(torch.bfloat16) for k in (2048, 8192)}
    previous = torch.get_num_threads()
    try:
        rows = [
            _shape_row(libs, kind, name, n, k, silu, xs[k], rng)
            for kind in TYPES
            for name, n, k, silu in SHAPES
        ]
    finally:
        torch.set_num_threads(previous)
    return {
        "title": f"Many-row kernel at the 1B shapes, {ROWS} rows ({native_kernels.chosen_level()} level)",
        "rows": rows,
        "notes": [
            f"CPU: {llama_cpp_native.cpu_description().split(';')[0]}; {os.cpu_count()} CPUs; best of {ROUNDS} x 2",
            "vs torch f32: torch's float32 matmul time over ours, same shape and threads (the epilogue aside)",
        ],
    }
