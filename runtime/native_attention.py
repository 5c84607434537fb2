"""A small C kernel for decode attention on CPU (float32 or bfloat16 KV), compiled on first use.

Pure PyTorch has to gather each sequence's KV blocks into a contiguous copy
before its matmuls; for decode that copy costs more than the attention math.
The kernel (csrc/paged_decode_attention.c) reads the pool in place. It is
built with the system C compiler into a per-user cache, keyed by the source
and the CPU, and loaded with ctypes; without a compiler the engine keeps the
PyTorch path.
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
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "prescient")
    return Path(root) / "kernels"


def _cpu_key() -> str:
    try:
        flags = next((line for line in open("/proc/cpuinfo") if line.startswith("flags")), "")
    except OSError:
        flags = ""
    return platform.machine() + flags


@lru_cache(maxsize=1)
def load() -> ctypes.CDLL | None:
    """The compiled kernel, or None when it cannot be built here (then PyTorch does the work)."""
    if os.environ.get("PRESCIENT_NATIVE", "1") == "0":
        return None
    compiler = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    source = SOURCE.read_bytes()
    key = hashlib.sha256(source + _cpu_key().encode()).hexdigest()[:16]
    target = _cache_dir() / f"paged_decode_attention-{key}.so"
    if not target.exists():
        if compiler is None:
            log.warning("no C compiler found; decode attention runs in PyTorch (slower)")
            return None
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            built = Path(tmp) / target.name
            cmd = [compiler, "-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", str(SOURCE), "-o", str(built), "-lm"]
            result = subprocess.run(cmd, capture_output=True, text=True)
            if result.returncode != 0:
                log.warning("building the decode attention kernel failed; using PyTorch:\n%s", result.stderr)
                return None
            os.replace(built, target)
    lib = ctypes.CDLL(str(target))
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    for fn in (lib.paged_decode_attention_f32, lib.paged_decode_attention_bf16):
        fn.argtypes = [ptr, ptr, ptr, ptr, ptr, ptr, i64, i64, i64, i64, i64, i64, ctypes.c_float, ctypes.c_int]
        fn.restype = None
    return lib


def usable(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    heads, kv_heads, d = q.shape[1], k_cache.shape[2], k_cache.shape[3]
    return (q.device.type == "cpu" and k_cache.dtype in (torch.float32, torch.bfloat16) and d % 16 == 0
            and heads // kv_heads <= 16 and heads <= 1024   # the kernel's MAX_GROUP and per-head arrays
            and load() is not None)


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                     context_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """q [B, heads, D]; caches [blocks, block_size, kv_heads, D] (float32 or bfloat16); returns [B, heads, D] in
    q's dtype. The math is float32."""
    dtype = q.dtype
    q = q.to(torch.float32).contiguous()
    out = torch.empty_like(q)
    b, heads, d = q.shape
    lib = load()
    kernel = lib.paged_decode_attention_bf16 if k_cache.dtype == torch.bfloat16 else lib.paged_decode_attention_f32
    kernel(
        q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), block_tables.data_ptr(), context_lens.data_ptr(),
        out.data_ptr(), b, heads, k_cache.shape[2], d, k_cache.shape[1], block_tables.shape[1], scale,
        torch.get_num_threads())
    return out.to(dtype)
