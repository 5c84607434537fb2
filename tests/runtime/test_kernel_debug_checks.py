"""The debug build of the C kernels (PRESCIENT_KERNEL_DEBUG=1) checks each exported kernel's shape arguments:
a bad one aborts the process with one line naming the kernel, the argument and its value, instead of reading
or writing out of bounds; good ones give the release build's results. Each call runs in its own process, which
imports the kernels' loader alone (tests/runtime/kernels_only.py). The checks are the same C at every level:
the tests build and compare the lowest level, the fastest to compile."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import pytest

from runtime.kernels import library as native_kernels
from tests.runtime import kernels_only

ROOT = Path(__file__).resolve().parents[2]
LOWEST = native_kernels.levels()[0]

# Calls each kernel through the library load() gives, with the shape named on the command line ("good" or one
# bad case), and prints the outputs (one line of floats a kernel) and the library's file name.
SCRIPT = r"""
import ctypes, sys
import numpy as np
from runtime.kernels import library

lib = library.load()
print("library", lib._name)
case = sys.argv[1]
p = lambda a: a.ctypes.data_as(ctypes.c_void_p)
rng = np.random.default_rng(0)

# paged decode attention: B=2 sequences, H=4, KVH=2, D=64, blocks of 4, 3 blocks a row
B, H, KVH, D, BS, MB = 2, 4, 2, 64, 4, 3
q = rng.standard_normal((B, H, D), dtype=np.float32)
k = rng.standard_normal((8, BS, KVH, D), dtype=np.float32)
v = rng.standard_normal((8, BS, KVH, D), dtype=np.float32)
tables = np.array([[0, 1, 2], [3, 4, 5]], dtype=np.int64)
lens = np.array([12 if case != "attention_context" else 13, 7], dtype=np.int64)
out = np.zeros((B, H, D), dtype=np.float32)
lib.paged_decode_attention_f32(p(q), p(k), p(v), p(tables), p(lens), p(out), B, H, KVH, D, BS, MB, 0.125, 0, 0.0, 2)
print("attention", *out.ravel()[:64].tolist())

# quantized matmul (8-bit codes, one scale and offset a block of 32)
M, K, N = 2, 64 if case != "matmul_k" else 48, 16
x = rng.standard_normal((M, K), dtype=np.float32)
codes = rng.integers(0, 256, (N, 64), dtype=np.uint8)
scale = np.full((N, 2), 0x2000, dtype=np.uint16)
offset = np.full((N, 2), 0xA000, dtype=np.uint16)
y = np.zeros((M, N), dtype=np.float32)
lib.quantized_matmul(p(x), 0, M, K, p(codes), p(scale), p(offset), N, 8, p(y), 0, 0, 2)
print("matmul", *y.ravel().tolist())

# add_rms_norm: T=3 rows of D=40
T, Dn = 3, 40 if case != "norm_d" else 0
h = rng.standard_normal((3, 40), dtype=np.float32)
delta = rng.standard_normal((3, 40), dtype=np.float32)
w = rng.standard_normal(40, dtype=np.float32)
normed = np.zeros((3, 40), dtype=np.float32)
lib.add_rms_norm(p(h), p(delta), p(w), p(normed), T, Dn, 1e-5, 0, 2)
print("norm", *normed.ravel().tolist())
"""

BAD = [
    ("attention_context", "paged_decode_attention_f32", "context_lens[b] = 13"),
    ("matmul_k", "quantized_matmul", "K = 48"),
    ("norm_d", "add_rms_norm", "D = 0"),
]


@pytest.fixture(scope="module")
def debug_cache(tmp_path_factory) -> tuple[Path, str]:
    """A kernel cache holding the debug library of the lowest level, built once for the module where a build
    at first use would put it; and the compiler's warnings of that build."""
    cache = tmp_path_factory.mktemp("debug-cache")
    level = LOWEST
    saved = os.environ.get("PRESCIENT_CACHE")
    os.environ["PRESCIENT_CACHE"] = str(cache)
    try:
        target = native_kernels.cache_target(level, debug=True)
    finally:
        os.environ.pop("PRESCIENT_CACHE") if saved is None else os.environ.update(PRESCIENT_CACHE=saved)
    target.parent.mkdir(parents=True)
    warnings = native_kernels.build_level(level, target, timeout=600, debug=True)
    return cache, warnings


def run(case: str, debug: bool, cache: Path | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PRESCIENT_KERNEL_DEBUG", "PRESCIENT_NATIVE")}
    env["PYTHONPATH"] = str(ROOT)
    env["PRESCIENT_ISA"] = LOWEST.name
    env["PRESCIENT_NATIVE_BUILD_TIMEOUT"] = "600"  # a build at first use on a loaded machine
    if debug:
        env["PRESCIENT_KERNEL_DEBUG"] = "1"
        env["PRESCIENT_CACHE"] = str(cache)
    return subprocess.run(
        kernels_only.command(SCRIPT, case), cwd=ROOT, env=env, capture_output=True, text=True, timeout=900
    )


@pytest.fixture(scope="module")
def debug_good(debug_cache) -> subprocess.CompletedProcess:
    """The good shapes under the debug library."""
    return run("good", debug=True, cache=debug_cache[0])


@pytest.fixture(scope="module")
def release_good() -> subprocess.CompletedProcess:
    """The good shapes under the release library."""
    return run("good", debug=False)


def test_debug_flag_loads_the_debug_library(debug_cache, debug_good, release_good):
    assert debug_good.returncode == 0, debug_good.stderr
    name = debug_good.stdout.splitlines()[0]
    assert name.endswith(f"{LOWEST.name}-debug.so") and str(debug_cache[0]) in name, name  # not rebuilt
    assert release_good.returncode == 0, release_good.stderr
    assert not release_good.stdout.splitlines()[0].endswith("-debug.so")


def test_good_shapes_give_the_release_results(debug_good, release_good):
    release = release_good
    assert release.returncode == 0, release.stderr
    assert debug_good.returncode == 0, debug_good.stderr
    assert debug_good.stdout.splitlines()[1:] == release.stdout.splitlines()[1:]
    assert len(release.stdout.splitlines()) == 4


@pytest.mark.parametrize(("case", "kernel", "named"), BAD, ids=[case for case, _, _ in BAD])
def test_a_bad_shape_aborts_naming_kernel_and_argument(debug_cache, debug_good, case, kernel, named):
    assert debug_good.returncode == 0, debug_good.stderr
    bad = run(case, debug=True, cache=debug_cache[0])
    assert bad.returncode == -signal.SIGABRT, (bad.returncode, bad.stderr)
    line = next(line for line in bad.stderr.splitlines() if line.startswith("prescient kernel"))
    assert line.startswith(f"prescient kernel {kernel}: argument {named}"), line


@pytest.mark.parametrize(("case", "kernel", "named"), BAD[1:], ids=[case for case, _, _ in BAD[1:]])
def test_release_build_has_no_checks(case, kernel, named):
    """The release library compiles the checks away: the same bad calls do not abort there (these two only
    compute garbage within their buffers; the bad attention call would read past the block table)."""
    release = run(case, debug=False)
    assert "prescient kernel" not in release.stderr
    assert release.returncode == 0, release.stderr


def test_the_debug_build_is_warning_free(debug_cache):
    assert debug_cache[1].strip() == ""
