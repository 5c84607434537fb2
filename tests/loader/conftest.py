"""Real files in a temporary directory, a storage that counts its reads, and helpers that
run torch's DataLoader and ours on the same seeds."""

from __future__ import annotations

import multiprocessing
import os
import random
import time

import numpy as np
import pytest
import torch
import torch.utils.data as tud

from loader import DataLoader, FileDataset

SAMPLE_BYTES = 64


def write_files(root, count: int, classes: int = 3, size=lambda i: SAMPLE_BYTES) -> str:
    """`count` files spread over `classes` class directories; file i holds bytes derived from i."""
    for i in range(count):
        directory = os.path.join(root, f"class{i % classes}")
        os.makedirs(directory, exist_ok=True)
        n, start = size(i), i * 7 % 251
        period = bytes((start + j) % 251 for j in range(min(n, 251)))  # byte j is (7 i + j) mod 251
        payload = (period * (n // 251 + 1))[:n]
        with open(os.path.join(directory, f"{i:05d}.bin"), "wb") as handle:
            handle.write(payload)
    return str(root)


def noisy_decode(raw: bytes) -> torch.Tensor:
    """Decode with random augmentation from all three RNGs a worker seeds (torch, random, numpy)."""
    head = torch.frombuffer(bytearray(raw[:8].ljust(8, b"\0")), dtype=torch.uint8).float()
    return head + torch.rand(8) + random.random() + float(np.random.rand())


class CountingFiles(FileDataset):
    """A FileDataset whose storage counts reads per index, across threads and processes."""

    def __init__(self, root, **kwargs):
        super().__init__(root, **kwargs)
        self.reads = multiprocessing.Array("q", len(self))

    def read(self, index: int) -> bytes:
        with self.reads.get_lock():
            self.reads[index] += 1
        return super().read(index)

    def read_counts(self) -> np.ndarray:
        with self.reads.get_lock():
            return np.array(self.reads[:], dtype=np.int64)


def shuffled(dataset, batch_size: int, seed: int, cls=DataLoader, **settings):
    """A loader of `cls` (ours, or torch's for a reference) that shuffles `dataset` in the order of
    torch.Generator().manual_seed(seed); settings as DataLoader takes."""
    return cls(
        dataset,
        batch_size=batch_size,
        shuffle=True,
        generator=torch.Generator().manual_seed(seed),
        **settings,
    )


class Sleeping(tud.Dataset):
    """Items 0 .. length - 1, each read after `seconds` of sleep: a slow storage, to catch a worker mid-read."""

    def __init__(self, length: int, seconds: float):
        self.length, self.seconds = length, seconds

    def __len__(self):
        return self.length

    def __getitem__(self, index):
        time.sleep(self.seconds)
        return index


@pytest.fixture(scope="session")
def programs():
    """Starts `python -c CODE ARGS...` programs forked from one interpreter that imported torch and
    the loader once (zygote.py): `programs.start(CODE, *ARGS)` -> a Popen-like Program."""
    from tests.loader.zygote import Zygote

    zygote = Zygote()
    yield zygote
    zygote.close()


@pytest.fixture(scope="session")
def files(tmp_path_factory) -> str:
    return write_files(tmp_path_factory.mktemp("files"), 45)


@pytest.fixture
def counting(tmp_path):
    def make(count: int = 60, **kwargs) -> CountingFiles:
        return CountingFiles(write_files(tmp_path / "data", count), decode=noisy_decode, **kwargs)

    return make


def same(a, b) -> bool:
    """Deep equality of batches: tensors exactly, containers element-wise."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    return a == b


def shm_names(pid: int | None = None) -> set[str]:
    prefix = f"prescient_{pid}_" if pid is not None else "prescient_"
    return {name for name in os.listdir("/dev/shm") if name.startswith(prefix)}
