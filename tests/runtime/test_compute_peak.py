"""csrc/compute_peak.c, the benchmarks' 8-bit compute ceiling (tests/bench/roofline.py's int8_dot_rate): at
every level this CPU runs, the products it reports are those its loop computes (the level's vector of
products per round and chain, every round, every thread), so a rate from it is products over wall time."""

from __future__ import annotations

from runtime.kernels import library as native_kernels
from tests.runtime.native_levels import kernel_level  # noqa: F401 (a fixture)

# products a round: VNNI 8 chains of 64, AVX2 6 of 32, the portable loop 64
PER_ROUND = {"avx512": 8 * 64, "avx2": 6 * 32, "generic": 64}


def test_products_counted_are_rounds_times_width_times_threads(kernel_level):  # noqa: F811
    lib = native_kernels.load()
    for iters in (1, 7, 1000):
        for threads in (1, 2):
            assert lib.int8_dot_peak(iters, threads) == iters * PER_ROUND[kernel_level] * threads
    assert lib.int8_dot_peak(0, 2) == 0
