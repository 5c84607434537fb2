"""loader: a drop-in `torch.utils.data.DataLoader` that plans every epoch's reads, caches
raw sample bytes in shared memory / local disk (Belady placement), and prefetches in
exact order.

The names below load on first use, so that `loader.sizes` (which the server's command line
reads) does not import torch."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from loader.dataloader import DataLoader
    from loader.errors import SampleError
    from loader.file_dataset import FileDataset
    from loader.sizes import parse_size

_HOMES = {
    "DataLoader": "loader.dataloader",
    "SampleError": "loader.errors",
    "FileDataset": "loader.file_dataset",
    "parse_size": "loader.sizes",
}

__all__ = ["DataLoader", "FileDataset", "SampleError", "parse_size"]


def __getattr__(name: str):
    if name not in _HOMES:
        raise AttributeError(f"module 'loader' has no attribute {name!r}")
    value = getattr(importlib.import_module(_HOMES[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
