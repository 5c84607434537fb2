"""The project's small C kernels (runtime/csrc/*.c), compiled on first use into one library.

The kernels are built with the system C compiler (-O3 -march=native) into a
per-user cache, keyed by their sources and the CPU, and loaded with ctypes.
One library for all of them: one build, one load, and one warning when it
cannot be had. Whenever it cannot be built or loaded, the engine keeps the
PyTorch paths (see load()); each kernel's wrapper (native_attention,
native_matmul, native_layer_ops) says what it does.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from functools import lru_cache
from pathlib import Path

log = logging.getLogger("prescient.runtime")
SOURCES = [
    Path(__file__).parent / "csrc" / name
    for name in (
        "paged_decode_attention.c",
        "quantized_matmul.c",
        "decode_layer_ops.c",
        "nucleus_sampling.c",
        "decode_layers.c",
    )
]
HEADERS = [Path(__file__).parent / "csrc" / name for name in ("vector_exp.h", "kernels.h", "bf16.h")]


def _cache_dir() -> Path:
    root = os.environ.get("PRESCIENT_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "prescient"
    )
    return Path(root) / "kernels"


def _cpu_key() -> str:
    try:
        flags = next((line for line in open("/proc/cpuinfo") if line.startswith("flags")), "")
    except OSError:
        flags = ""
    return platform.machine() + flags


BUILD_TIMEOUT_SECONDS = 60.0
"""How long the compiler may run (PRESCIENT_NATIVE_BUILD_TIMEOUT overrides): a hung compiler must not hang
the server's start."""


class _Unavailable(Exception):
    """Why the kernel cannot be used here; the engine then keeps the PyTorch path."""


@lru_cache(maxsize=1)
def load() -> ctypes.CDLL | None:
    """The compiled kernel, or None when it cannot be built or loaded here (then PyTorch does the work).

    Nothing about the kernel may stop the server from starting: no compiler, a hung one, an unwritable
    cache directory, a noexec mount or a corrupt cached library each end here with one warning line."""
    if os.environ.get("PRESCIENT_NATIVE", "1") == "0":
        return None
    try:
        return _load()
    except Exception as exc:  # any failure means "use PyTorch", said once
        reason = str(exc) if isinstance(exc, _Unavailable) else f"{type(exc).__name__}: {exc}"
        log.warning(
            "native kernels unavailable (%s); decode attention and quantized matmuls run in PyTorch (slower)",
            " ".join(reason.split())[:300],
        )
        return None


def _target() -> Path:
    sources = b"".join(source.read_bytes() for source in SOURCES + HEADERS)
    key = hashlib.sha256(sources + _cpu_key().encode()).hexdigest()[:16]
    return _cache_dir() / f"prescient-kernels-{key}.so"


def _load() -> ctypes.CDLL:
    target = _target()
    if target.exists():
        try:
            return _open(target)
        except OSError:  # a truncated or corrupt cached build (or an unloadable one): build it again
            target.unlink(missing_ok=True)
    _build(target)
    try:
        return _open(target)
    except OSError as exc:
        raise _Unavailable(
            f"cannot load {target} ({exc}); a noexec mount? set PRESCIENT_CACHE elsewhere"
        ) from exc


def _build(target: Path) -> None:
    compiler = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if compiler is None:
        raise _Unavailable("no C compiler found")
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = tempfile.TemporaryDirectory(dir=target.parent)
    except OSError as exc:
        raise _Unavailable(
            f"cache directory {target.parent} is not writable ({exc.strerror}); "
            f"set PRESCIENT_CACHE to a writable one"
        ) from exc
    timeout = float(os.environ.get("PRESCIENT_NATIVE_BUILD_TIMEOUT", BUILD_TIMEOUT_SECONDS))
    with tmp:
        built = Path(tmp.name) / target.name
        cmd = [
            compiler,
            "-O3",
            "-march=native",
            "-fopenmp",
            "-shared",
            "-fPIC",
            *map(str, SOURCES),
            "-o",
            str(built),
            "-lm",
        ]
        try:
            result = subprocess.run(
                cmd, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL
            )
        except subprocess.TimeoutExpired as exc:
            raise _Unavailable(f"the C compiler did not finish in {timeout:g} s") from exc
        if result.returncode != 0:
            first = next(
                (line for line in result.stderr.splitlines() if "error" in line), result.stderr[:200]
            )
            raise _Unavailable(f"building it failed: {first.strip()}")
        os.replace(built, target)


def _open(path: Path) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(path))
    i64, ptr, cint = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
    try:
        attention = (lib.paged_decode_attention_f32, lib.paged_decode_attention_bf16)
        prefill = (lib.paged_prefill_attention_f32, lib.paged_prefill_attention_bf16)
        matmul, gemm, vectorized = lib.quantized_matmul, lib.quantized_gemm, lib.quantized_matmul_vectorized
        norm, silu_mul, rope = lib.add_rms_norm, lib.silu_mul, lib.rope_write_kv
        nucleus, layers = lib.nucleus_sample, lib.decode_layers
    except AttributeError as exc:  # some other library under our name
        raise OSError(f"{path} lacks the kernels' symbols") from exc
    for fn in attention:
        fn.argtypes = [ptr, ptr, ptr, ptr, ptr, ptr, i64, i64, i64, i64, i64, i64, ctypes.c_float, cint]
        fn.restype = None
    for fn in prefill:
        fn.argtypes = [ptr, ptr, ptr, ptr, i64, ptr, i64, ptr, cint, i64, i64, i64, i64, ctypes.c_float, cint]
        fn.restype = None
    matmul.argtypes = [ptr, cint, i64, i64, ptr, ptr, ptr, i64, cint, ptr, cint, cint, cint]
    matmul.restype = None
    gemm.argtypes = [ptr, cint, i64, i64, ptr, ptr, ptr, i64, cint, ptr, cint, cint, cint, cint]
    gemm.restype = None
    vectorized.argtypes = []
    vectorized.restype = cint
    norm.argtypes = [ptr, ptr, ptr, ptr, i64, i64, ctypes.c_float, cint, cint]
    silu_mul.argtypes = [ptr, ptr, i64, i64, cint, cint]
    rope.argtypes = [ptr, ptr, ptr, ptr, ptr, ptr, ptr, ptr, i64, i64, i64, i64, cint, cint, cint]
    nucleus.argtypes = [ptr, i64, i64, i64, ptr, ptr, ptr, ptr, ptr, cint]
    layers.argtypes = [ptr, ptr, i64, ptr, cint]
    for fn in (norm, silu_mul, rope, nucleus, layers):
        fn.restype = None
    return lib
