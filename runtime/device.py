"""Pick the device and the default dtype for it.

On CUDA the default is bfloat16. On a CPU the default is whichever dtype ran
a small model-shaped matmul fastest when measured, once per CPU (the answer
is cached on disk): CPU flags do not tell speed (on one CPU with AVX-512 BF16
bf16 matmuls ran at half the float32 rate, on another several times
faster). A dtype the CPU has no instructions for (bfloat16 without AVX-512
BF16 or AMX, float16 without AVX-512 FP16 or AMX-FP16) is emulated by
PyTorch and never a candidate, however the measurement came out.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import statistics
import time
from collections.abc import Callable
from functools import lru_cache
from pathlib import Path

import torch

log = logging.getLogger("prescient.runtime")

DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}
NATIVE_FLAGS = {torch.bfloat16: ("avx512_bf16", "amx_bf16"), torch.float16: ("avx512_fp16", "amx_fp16")}


def resolve_device(device: str | torch.device | None) -> torch.device:
    resolved = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device: 'cuda' requested but no CUDA device is available; use 'cpu'")
    if resolved.type not in ("cpu", "cuda"):
        raise ValueError(f"device: {str(device)!r} is not supported; use 'cpu' or 'cuda'")
    return resolved


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    if dtype is None or dtype == "auto":
        return default_dtype(device)
    if isinstance(dtype, torch.dtype):
        if dtype not in DTYPES.values():
            raise ValueError(f"dtype: {dtype} is not supported; choose one of {sorted(DTYPES)}")
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"dtype: {dtype!r} is not supported; choose 'auto' or one of {sorted(DTYPES)}")
    return DTYPES[dtype]


def default_dtype(device: torch.device) -> torch.dtype:
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return fastest_cpu_dtype()


def cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            return set(next((line for line in f if line.startswith("flags")), "").split())
    except OSError:
        return set()


def native_cpu_dtypes(flags: set[str]) -> list[torch.dtype]:
    """float32, plus the reduced-precision dtypes this CPU has instructions for."""
    return [torch.float32] + [dt for dt, needs in NATIVE_FLAGS.items() if any(f in flags for f in needs)]


def pick_fastest(seconds: dict[torch.dtype, float], native: list[torch.dtype]) -> torch.dtype:
    """The measured-fastest native dtype; float32 when nothing else was measured faster."""
    candidates = [dt for dt in native if dt in seconds]
    return min(candidates, key=lambda dt: (seconds[dt], dt != torch.float32), default=torch.float32)


def time_matmul(dtype: torch.dtype, rounds: int = 5) -> float:
    """Median seconds of a [64, 576] x [576, 1536] matmul (a small model's projection at a batch of 64)."""
    x = torch.randn(64, 576).to(dtype)
    w = torch.randn(1536, 576).to(dtype)
    torch.nn.functional.linear(x, w)
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(4):
            torch.nn.functional.linear(x, w)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


@lru_cache(maxsize=1)
def fastest_cpu_dtype(measure: Callable[[torch.dtype], float] = time_matmul) -> torch.dtype:
    """Measured once per CPU model, flags, torch version and thread count; cached on disk."""
    flags = cpu_flags()
    native = native_cpu_dtypes(flags)
    if len(native) == 1:
        return torch.float32
    key = hashlib.sha256(
        " ".join(
            [
                platform.processor(),
                _cpu_model(),
                *sorted(flags),
                torch.__version__,
                str(torch.get_num_threads()),
            ]
        ).encode()
    ).hexdigest()[:16]
    path = _cache_dir() / f"dtype-{key}.json"
    try:
        return DTYPES[json.loads(path.read_text())["dtype"]]
    except (OSError, ValueError, KeyError):
        pass
    seconds = {dt: [] for dt in native}
    for _ in range(3):  # interleaved, so a burst of load elsewhere hits every candidate alike
        for dt in native:
            seconds[dt].append(measure(dt))
    medians = {dt: statistics.median(s) for dt, s in seconds.items()}
    chosen = pick_fastest(medians, native)
    log.info("dtype auto: %s (matmul seconds %s)", chosen, {str(k): round(v, 6) for k, v in medians.items()})
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        seconds = {str(k).removeprefix("torch."): v for k, v in medians.items()}
        path.write_text(json.dumps({"dtype": str(chosen).removeprefix("torch."), "seconds": seconds}))
    except OSError:
        pass
    return chosen


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("model name")), "").strip()
    except OSError:
        return ""


def _cache_dir() -> Path:
    root = os.environ.get("PRESCIENT_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "prescient"
    )
    return Path(root)
