"""The loader's options beyond torch's, with their defaults (DataLoader's keyword-only
arguments, checked where they enter in dataloader.py)."""

from __future__ import annotations

from dataclasses import dataclass

READS_IN_FLIGHT = 64  # the most storage reads a worker keeps in flight when prefetch_threads is not set
PEER_READ_THREADS = 16  # the prefetcher's storage readers under peer exchange, prefetch_threads unset


@dataclass
class CacheOptions:
    cache_ram: int = 0  # bytes of samples kept in shared memory across epochs
    cache_disk: str | None = None  # directory for the local-disk tier
    cache_disk_bytes: int = 0  # bytes the disk tier may hold
    cache_items: bool = False  # the dataset's items are deterministic: cache them whole
    prefetch_bytes: int = 64 << 20  # bytes read ahead and not cached, plus reads in flight
    prefetch_threads: int | None = None  # concurrent storage reads in all (None: a batch's per worker)
    horizon_epochs: int = 2  # epochs the placement looks ahead when the order is seeded
    peer_exchange: bool = False  # fetch samples other ranks hold (torch.distributed, gloo)
    peer_window: int = 128  # samples per exchange window
    peer_timeout: float = 60.0  # seconds a window may wait for the other ranks before storage takes over
    read_attempts: int = 3  # storage reads tried per sample on an OSError, the first included
    read_retry_delay: float = 0.05  # seconds before the second try, doubled before each further one
