"""A dataset of files in a directory, split into I/O (`read`) and decoding (`decode`).

With an ImageFolder-like layout (root/<class>/<files>) each sample is (sample, label),
labels numbering the sorted class names; with files directly under root each sample is
just the decoded file. `read` returns the file's bytes (what the loader caches); `decode`
runs the user's decode and transform (random augmentation stays fresh every epoch).
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch
from torch.utils.data import Dataset

from loader.errors import SampleError, sample_error


def raw_tensor(raw: bytes) -> torch.Tensor:
    """Default decode: the file's bytes as a uint8 tensor."""
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8)


class FileDataset(Dataset):
    def __init__(
        self,
        root: str | os.PathLike,
        decode: Callable[[bytes], object] | None = None,
        transform: Callable[[object], object] | None = None,
        extensions: tuple[str, ...] | None = None,
    ):
        self.root = os.fspath(root)
        if not os.path.isdir(self.root):
            raise FileNotFoundError(f"FileDataset: root {self.root!r} is not a directory")
        self.decode_fn = decode or raw_tensor
        self.transform = transform
        wanted = tuple(e.lower() for e in extensions) if extensions else None
        entries = sorted(os.scandir(self.root), key=lambda e: e.name)
        self.classes = [e.name for e in entries if e.is_dir() and not e.name.startswith(".")]
        self.class_to_idx = {name: i for i, name in enumerate(self.classes)}
        self.paths: list[str] = []
        self.targets: list[int] | None = [] if self.classes else None
        if self.classes:
            for name in self.classes:
                for path in _walk(os.path.join(self.root, name), wanted):
                    self.paths.append(path)
                    self.targets.append(self.class_to_idx[name])
        else:
            self.paths = list(_walk(self.root, wanted))
        if not self.paths:
            raise FileNotFoundError(
                f"FileDataset: no files under {self.root!r}"
                + (f" with extensions {wanted}" if wanted else "")
            )
        self.sizes = [os.path.getsize(p) for p in self.paths]

    def __len__(self) -> int:
        return len(self.paths)

    def path(self, index: int) -> str:
        return self.paths[index]

    def nbytes(self, index: int) -> int:
        return self.sizes[index]

    def read(self, index: int) -> bytes:
        with open(self.paths[index], "rb") as handle:
            return handle.read()

    def decode(self, raw: bytes, index: int):
        sample = self.decode_fn(raw)
        if self.transform is not None:
            sample = self.transform(sample)
        return sample if self.targets is None else (sample, self.targets[index])

    def __getitem__(self, index: int):
        try:
            raw = self.read(index)
        except Exception as error:
            raise sample_error(index, f"path {self.paths[index]}", "read", error) from error
        try:
            return self.decode(raw, index)
        except SampleError:
            raise
        except Exception as error:
            raise sample_error(index, f"path {self.paths[index]}", "decode", error) from error


def _walk(directory: str, extensions: tuple[str, ...] | None):
    for base, dirs, files in os.walk(directory):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        for name in sorted(files):
            if name.startswith("."):
                continue
            if extensions is None or name.lower().endswith(extensions):
                yield os.path.join(base, name)
