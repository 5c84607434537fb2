"""Pick the device and the default dtype for it.

bfloat16 halves the bytes read per token, but only pays where the hardware
computes in it: CUDA, or a CPU with AVX-512 BF16 / AMX. On a CPU without
them (AVX2 only), PyTorch emulates bf16 matmuls about eight times slower than
float32, so float32 is the default there.
"""
from __future__ import annotations

from functools import lru_cache

import torch

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
          "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}


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
    return torch.bfloat16 if cpu_has_native_bf16() else torch.float32


@lru_cache(maxsize=1)
def cpu_has_native_bf16() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "").split()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags
