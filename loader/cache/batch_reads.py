"""A worker reads its own batch from storage, with as many reads in flight as hide the latency.

torch's worker reads a batch one sample after another, so slow storage (a network file
system, an object store) leaves the accelerator waiting however many workers there are.
Here a worker starts the reads of its whole batch at once on a small thread pool of its
own (the GIL is released while a read waits), then decodes in the batch's order, so the
random augmentation draws exactly what torch's sequential loop would draw.

On fast storage (the page cache, an NVMe disk) a thread hand-off costs more than the read
itself: the pool is used only while this process's reads take longer than FAST_READ_SECONDS
(the median read of each batch, averaged as it goes).
"""

from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor

FAST_READ_SECONDS = 200e-6  # below this a read is not worth a thread hand-off
_EMA = 0.5  # weight of the newest batch's median read in the average
LEARN_READS = 3  # reads made one by one before the first choice


class BatchReader:
    def __init__(self, threads: int):
        self.threads = max(1, threads)  # reads in flight in one process
        self.average: float | None = None  # seconds per read, this process
        self._pool: ThreadPoolExecutor | None = None
        self._pid = None

    def __getstate__(self):
        return {"threads": self.threads, "average": None, "_pool": None, "_pid": None}

    def read_all(self, read, indices: list[int]) -> list:
        """`read(i)` for each index, in order; the first exception (in index order) is raised."""
        if not indices:
            return []
        if self.average is None and len(indices) > LEARN_READS and self.threads > 1:
            head = self.read_all(read, indices[:LEARN_READS])  # learn from a few reads alone
            return head + self.read_all(read, indices[LEARN_READS:])
        if self.threads == 1 or len(indices) == 1 or self.average is None or self.average < FAST_READ_SECONDS:
            timed = [_timed(read, i) for i in indices]
        else:
            futures = [self.pool().submit(_timed, read, i) for i in indices]
            timed = [future.result() for future in futures]
        # the median read: one read delayed by the scheduler on a busy machine does not flip the choice
        per_read = sorted(seconds for _, seconds in timed)[len(timed) // 2]
        self.average = per_read if self.average is None else (1 - _EMA) * self.average + _EMA * per_read
        return [raw for raw, _ in timed]

    def pool(self) -> ThreadPoolExecutor:
        if self._pool is None or self._pid != os.getpid():  # a forked worker does not inherit threads
            self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="prescient-read")
            self._pid = os.getpid()
        return self._pool


def _timed(read, index: int) -> tuple[bytes, float]:
    start = time.perf_counter()
    raw = read(index)
    return raw, time.perf_counter() - start
