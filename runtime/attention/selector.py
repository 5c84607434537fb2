"""Which attention backend a model runs, chosen once (by the runner) for its queries and KV pool: the C
kernels on CPU, the Triton kernel on CUDA, else plain PyTorch."""

from __future__ import annotations

import torch

from runtime.attention.backend import AttentionBackend
from runtime.attention.c_backend import CBackend
from runtime.attention.torch_backend import TorchBackend
from runtime.attention.triton_backend import TritonBackend

BACKENDS: tuple[type[AttentionBackend], ...] = (CBackend, TritonBackend, TorchBackend)
"""In order of preference: the first usable one is taken (TorchBackend always is)."""


def select_backend(q: torch.Tensor, k_cache: torch.Tensor) -> AttentionBackend:
    """The backend for queries like q ([T, heads, D], the model's dtype and device) over this pool."""
    return next(cls() for cls in BACKENDS if cls.usable(q, k_cache))
