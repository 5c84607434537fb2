"""A small C kernel for decode attention on CPU (float32 or bfloat16 KV), compiled on first use.

Pure PyTorch has to gather each sequence's KV blocks into a contiguous copy
before its matmuls; for decode that copy costs more than the attention math.
The kernel (csrc/paged_decode_attention.c) reads the pool in place. It is
built with the system C compiler into a per-user cache, keyed by the source
and the CPU, and loaded with ctypes; whenever it cannot be built or loaded the
engine keeps the PyTorch path (see load()).
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

import torch

log = logging.getLogger("prescient.runtime")
SOURCE = Path(__file__).parent / "csrc" / "paged_decode_attention.c"


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
            "decode attention kernel unavailable (%s); decode attention runs in PyTorch (slower)",
            " ".join(reason.split())[:300],
        )
        return None


def _target() -> Path:
    key = hashlib.sha256(SOURCE.read_bytes() + _cpu_key().encode()).hexdigest()[:16]
    return _cache_dir() / f"paged_decode_attention-{key}.so"


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
            str(SOURCE),
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
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    try:
        kernels = (lib.paged_decode_attention_f32, lib.paged_decode_attention_bf16)
    except AttributeError as exc:  # some other library under our name
        raise OSError(f"{path} lacks the kernel's symbols") from exc
    for fn in kernels:
        fn.argtypes = [
            ptr,
            ptr,
            ptr,
            ptr,
            ptr,
            ptr,
            i64,
            i64,
            i64,
            i64,
            i64,
            i64,
            ctypes.c_float,
            ctypes.c_int,
        ]
        fn.restype = None
    return lib


def usable(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    heads, kv_heads, d = q.shape[1], k_cache.shape[2], k_cache.shape[3]
    return (
        q.device.type == "cpu"
        and k_cache.dtype in (torch.float32, torch.bfloat16)
        and d % 16 == 0
        and heads // kv_heads <= 16
        and heads <= 1024  # the kernel's MAX_GROUP and per-head arrays
        and load() is not None
    )


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """q [B, heads, D]; caches [blocks, block_size, kv_heads, D] (float32 or bfloat16); returns [B, heads, D] in
    q's dtype. The math is float32."""
    dtype = q.dtype
    q = q.to(torch.float32).contiguous()
    out = torch.empty_like(q)
    b, heads, d = q.shape
    lib = load()
    kernel = (
        lib.paged_decode_attention_bf16 if k_cache.dtype == torch.bfloat16 else lib.paged_decode_attention_f32
    )
    kernel(
        q.data_ptr(),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        block_tables.data_ptr(),
        context_lens.data_ptr(),
        out.data_ptr(),
        b,
        heads,
        k_cache.shape[2],
        d,
        k_cache.shape[1],
        block_tables.shape[1],
        scale,
        torch.get_num_threads(),
    )
    return out.to(dtype)
