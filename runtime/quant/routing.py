"""Load-time measurement of row routing: which of a packed weight's paths (the C kernel's one-row and
many-row loops, torch's packed kernel, the dense copy) multiplies a given number of rows fastest, timed
once on load and turned into the weight's `native_rows`, `gemm_rows` and `dense_rows`
(runtime.quant.linear)."""

from __future__ import annotations

import statistics
import time
from functools import lru_cache

import numpy as np
import torch
import torch.nn.functional as F

from runtime.kernels import quantized_matmul as native_matmul
from runtime.kernels.quantized_matmul import NativeMatmul
from runtime.quant.gguf_blocks import GROUP
from runtime.quant.linear import ALL_ROWS, Int4Linear

DENSE_ROW_CANDIDATES = (8, 16, 32, 64, 128, 256)


def measure_dense_rows(w: Int4Linear, rounds: int = 5) -> int | None:
    """The fewest rows (of DENSE_ROW_CANDIDATES) from which w's dense copy multiplied faster than its packed
    blocks in median seconds, packed and dense interleaved so load elsewhere hits both; None: never."""
    if w.dense is None:
        return None
    for rows in DENSE_ROW_CANDIDATES:
        x = torch.randn(rows, w.in_features).to(w.dense.dtype)
        packed, dense = [], []
        w.dense_rows = None
        w(x)
        F.linear(x, w.dense)
        for _ in range(rounds):
            start = time.perf_counter()
            w(x)
            packed.append(time.perf_counter() - start)
            start = time.perf_counter()
            F.linear(x, w.dense)
            dense.append(time.perf_counter() - start)
        if statistics.median(dense) < statistics.median(packed):
            return rows
    return None


ROW_CANDIDATES = (1, 2, 4, 8, 16, 32, 64)
"""Row counts at which the C kernels are timed against the other paths on load."""


def row_paths(timings: dict[int, dict[str, float]]) -> tuple[int | None, int | None]:
    """The rule that routes rows between a weight's paths, from its timings: {rows: {path: seconds}} with
    paths "one-row" (the C kernel's one-row loops), "loops" (its many-row loops on the tiled copy) and
    "rest" (what the weight does otherwise: the dense copy or torch's packed kernel), each where the weight
    has it. Returns (native_rows, gemm_rows): the one-row loops take up to native_rows rows, the most rows
    up to which they were the fastest path at every candidate (None: not at 1 row); the many-row loops take
    from gemm_rows, the fewest rows above those from which they were the fastest at every larger candidate
    timed (None: never; timing stops once they have won twice in a row). Where the many-row loops win
    right above the one-row kernel's rows, or beat the rest at every count up to where they win, they
    start right after the one-row kernel's rows, so no row count in between falls to a slower path."""
    counts = sorted(timings)

    def fastest(rows: int) -> str:
        return min(timings[rows], key=timings[rows].get)

    native = None
    for rows in counts:
        if "one-row" not in timings[rows] or fastest(rows) != "one-row":
            break
        native = rows
    above = [r for r in counts if native is None or r > native]
    gemm = None
    for i, rows in enumerate(above):
        if all("loops" in timings[r] and fastest(r) == "loops" for r in above[i:]):
            gemm = rows
            break
    # they also take the counts between where they beat the rest (the dense copy or torch's kernel)
    if gemm is not None and all(
        "loops" in timings[r] and timings[r]["loops"] <= timings[r].get("rest", float("inf"))
        for r in above
        if r < gemm
    ):
        gemm = (native or 0) + 1
    return native, gemm


def measure_row_paths(w: Int4Linear, rounds: int = 5, calls: int = 2) -> tuple[int | None, int | None]:
    """Times w's paths at each of ROW_CANDIDATES (the fastest round's seconds of `calls` calls, the
    paths interleaved round by round) and routes rows by row_paths. The fastest round, not the median: on
    an oversubscribed host a round of a multi-threaded kernel also pays its team's waits for a descheduled
    thread, which only ever slows a round down, sometimes by orders of magnitude, enough to tip a median
    to a path many times slower. Wall time,
    not CPU time: the waiting thread of an OpenMP team spins, so CPU time charges those waits too. Stops
    timing once the many-row loops won at two candidates in a row (their lead grows with the rows) or the
    one-row kernel is all that is left to beat."""
    if w.native is None:
        return None, None
    if w.packed is None:  # Int4Linear.native_only: one layout, which takes every row count
        return (ALL_ROWS, None) if w.native.tiles is None else (None, 1)
    w.native_rows, w.gemm_rows = None, None
    paths = {"one-row": w.native, "rest": w}
    if w.native.tiles is not None:
        paths["loops"] = w.native.gemm

    def seconds(fn, x) -> float:
        start = time.perf_counter()
        for _ in range(calls):
            fn(x)
        return time.perf_counter() - start

    timings: dict[int, dict[str, float]] = {}
    loops_won = 0
    for rows in ROW_CANDIDATES:
        x = torch.randn(rows, w.in_features).to(w.scales_and_zeros.dtype)
        taken = {name: [] for name in paths}
        for fn in paths.values():
            fn(x)
        for _ in range(rounds):
            for name, fn in paths.items():
                taken[name].append(seconds(fn, x))
        timings[rows] = {name: min(t) for name, t in taken.items()}
        loops_won = loops_won + 1 if min(timings[rows], key=timings[rows].get) == "loops" else 0
        if loops_won == 2:
            break
        if "one-row" in paths and timings[rows]["one-row"] > min(timings[rows].values()):
            paths.pop("one-row", None)  # it is out from here on; keep timing the others
    return row_paths(timings)


@lru_cache(maxsize=1)
def packed_measures_faster(rounds: int = 7, calls: int = 8) -> bool:
    """Whether the C kernel multiplies one row of float32 activations by a model-shaped 4-bit weight (1,536 x
    576, blocks of 32) faster than the dense float32 matmul does (fastest round's seconds, interleaved): the
    step a single stream's decode repeats, bound by reading weights (0.56 bytes a weight packed, 4 dense).
    False without the kernel or its vector loops (the portable loops are no match for a dense matmul).

    Timed on one thread: the answer is the same at two quiet (the packed many-row loops 3.1x / 3.8x ahead
    at one / two threads on a Zen 3), but beside busy processes every round of a two-thread team waited
    for a descheduled thread, the dense matmul sometimes won, and the whole engine then ran on dense copies
    (a sixth of the decode speed, for its lifetime)."""
    if not native_matmul.vector_loops():
        return False
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _packed_measures_faster(rounds, calls)
    finally:
        torch.set_num_threads(threads)


def _packed_measures_faster(rounds: int, calls: int) -> bool:
    rng = np.random.default_rng(0)
    n, k = 1536, 576
    codes = rng.integers(0, 16, (n, k), dtype=np.uint8)
    scale = rng.uniform(0.001, 0.01, (n, k // GROUP)).astype(np.float32)
    offset = -8 * scale
    packed = NativeMatmul(codes, scale, offset, 4)
    dense = torch.from_numpy(
        ((codes.reshape(n, -1, GROUP) - 8.0) * scale[..., None]).reshape(n, k).astype(np.float32)
    )
    x = torch.randn(1, k)
    paths = {"packed": lambda: packed(x), "dense": lambda: F.linear(x, dense)}
    if packed.tiles is not None:
        paths["packed many-row"] = lambda: packed.gemm(x)
    taken: dict[str, list[float]] = {name: [] for name in paths}
    for fn in paths.values():
        fn()
    for _ in range(rounds):
        for name, fn in paths.items():
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            taken[name].append(time.perf_counter() - start)
    best = {name: min(t) for name, t in taken.items()}  # the least disturbed round (measure_row_paths)
    return min(best, key=best.get) != "dense"
