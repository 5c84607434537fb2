"""The local-disk tier: one file per sample under a private directory.

The directory's owner file stays locked (flock) while its loader lives; if the owner is
killed, the next loader to start there removes it (reclaim.py), on this node or another
one sharing the volume. Files are written to a temporary name and renamed,
so a reader sees a whole sample or none; a reader also checks the length the table
recorded. A failed write (disk full, quota, I/O error) turns the tier off with a warning
and the loader carries on with RAM only: a full disk costs speed, never correctness.
"""

from __future__ import annotations

import os
import shutil
import warnings

from loader.cache.reclaim import create_directory, reclaim_directories, release

PREFIX = "prescient-"


class DiskTier:
    def __init__(self, root: str, budget: int):
        os.makedirs(root, exist_ok=True)
        reclaim_directories(root, PREFIX)  # left by loaders that were killed
        self.budget = budget  # bytes the tier may hold
        self.dir, self.lock = create_directory(root, PREFIX)  # the lock: an fd held until close()
        self.enabled = True

    def path(self, index: int) -> str:
        return os.path.join(self.dir, str(index))

    def write(self, index: int, raw: bytes) -> bool:
        """Store a sample; False (and the tier off) when the disk refuses it."""
        if not self.enabled:
            return False
        target = self.path(index)
        temp = f"{target}.tmp"
        try:
            with open(temp, "wb") as handle:
                handle.write(raw)
            os.replace(temp, target)
            return True
        except OSError as error:
            self.enabled = False
            for leftover in (temp, target):
                try:
                    os.unlink(leftover)
                except OSError:
                    pass
            warnings.warn(
                f"cache_disk: writing a sample to {self.dir} failed ({error}); the disk tier is "
                "off for the rest of this run and the loader goes on with the RAM cache only. "
                "Free space there or pass a larger volume as cache_disk.",
                RuntimeWarning,
                stacklevel=2,
            )
            return False

    def remove(self, index: int) -> None:
        try:
            os.unlink(self.path(index))
        except FileNotFoundError:
            pass

    def close(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)
        release(self.lock)
        self.lock = None


def read_file(path: str, length: int) -> bytes | None:
    """The bytes of a disk-tier file, or None if it is missing or not `length` bytes long."""
    try:
        with open(path, "rb") as handle:
            raw = handle.read()
    except OSError:
        return None
    return raw if len(raw) == length else None
