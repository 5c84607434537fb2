"""Where a sample's bytes come from and how they become the sample again.

A dataset that implements `read(index) -> bytes` and `decode(raw, index) -> sample`
separates I/O from decoding: the loader caches the raw bytes, and decode (with its random
augmentation) still runs every epoch in the workers, as it would without a cache. A plain
map-style dataset built with `cache_items=True` is declared deterministic: its items are
pickled whole. Every failure names the sample (index and path).
"""

from __future__ import annotations

import pickle

from loader.errors import SampleError, sample_error
from loader.retry import RetryPolicy


def has_read_decode(dataset) -> bool:
    return callable(getattr(dataset, "read", None)) and callable(getattr(dataset, "decode", None))


class ByteSource:
    def __init__(self, dataset, items: bool, retry: RetryPolicy | None = None):
        self.dataset = dataset
        self.items = items  # True: bytes are pickled items of a deterministic dataset
        self.retry = retry or RetryPolicy()  # transient storage errors (OSError) are read again

    def where(self, index: int) -> str:
        path = getattr(self.dataset, "path", None)
        if callable(path):
            try:
                return f"path {path(index)}"
            except Exception:  # noqa: BLE001 - the error message must not fail itself
                pass
        return f"{type(self.dataset).__name__}[{index}]"

    def nbytes(self, index: int) -> int | None:
        """The sample's size in bytes if the dataset can say so without reading it: exactly what
        read() returns, since a peer that sends another size is refused (exchange.py)."""
        size = getattr(self.dataset, "nbytes", None)
        if callable(size):
            try:
                return int(size(index))
            except Exception:  # noqa: BLE001 - only a hint for prefetch accounting
                return None
        return None

    def _read_once(self, index: int) -> bytes:
        if self.items:
            return pickle.dumps(self.dataset[index], protocol=pickle.HIGHEST_PROTOCOL)
        return self.dataset.read(index)

    def read(self, index: int) -> bytes:
        try:
            raw, _ = self.retry.call(lambda: self._read_once(index))
        except SampleError:
            raise
        except OSError as error:
            attempts = self.retry.attempts
            tried = f" (tried {attempts} times)" if attempts > 1 else ""
            raise sample_error(index, self.where(index), "read", error, tried) from error
        except Exception as error:
            raise sample_error(index, self.where(index), "read", error) from error
        if not isinstance(raw, (bytes, bytearray, memoryview)):
            raise SampleError(
                f"sample {index} ({self.where(index)}): read() returned "
                f"{type(raw).__name__}; it must return bytes (decode turns them into the sample)"
            )
        return bytes(raw)

    def decode(self, raw: bytes, index: int):
        try:
            if self.items:
                return pickle.loads(raw)
            return self.dataset.decode(raw, index)
        except SampleError:
            raise
        except Exception as error:
            raise sample_error(index, self.where(index), "decode", error) from error
