"""Workers fill the cache: each hands the raw bytes it read from storage to the prefetch
coordinator through a ring of its own in shared memory (one writer, one reader).

With a cache, a planned sample the node does not hold is published to the workers as
absent: the worker that decodes it reads storage itself (in its own process, beside the
other workers, never behind the main process's GIL), then copies the raw bytes into its
fill ring before it marks the position consumed. The coordinator takes the rings' records
and offers each sample to the cache (Belady, holdings.py), so the next epoch finds it in RAM.
A full ring is skipped, never waited on: that sample is simply not cached this time.

Rings belong to iterators, not to worker ids: one writer per ring must hold even while an
old iterator's workers still run beside a new iterator's (`it = iter(loader)` makes the new
one before the old is dropped). With num_workers=0 there is one ring, the main process's;
otherwise the workers' rings come in SETS sets of num_workers, and an iterator claims a free set for its workers
(RingSets, in the main process) and gives it back only once all of them have exited. An
iterator that finds no free set starts workers without a ring: they read and decode as
usual and the samples they read are simply not cached.

Per ring (the main process's, or s * num_workers + w: worker w of the set s):
  ctl     [4]           HEAD records written, TAIL records taken, FREED bytes given back,
                        WRITTEN bytes handed out (the writer's cursor, kept here so that the
                        worker process of the next epoch continues where the last one stopped)
  records [R, 4]        plan position, dataset index, byte cursor, length
  data    [S]           the bytes; a record never wraps (the cursor skips to the next lap)
Order: the writer stores bytes and the record, then HEAD; the reader loads HEAD, then the
record and bytes, then stores TAIL and FREED (x86 keeps stores in order, as the ready/done
rings of cache_ram.py also assume).
"""

from __future__ import annotations

import numpy as np

HEAD, TAIL, FREED, WRITTEN = 0, 1, 2, 3
POS, INDEX, CURSOR, LENGTH = 0, 1, 2, 3
RECORDS = 1024  # records per ring
SETS = 2  # workers' ring sets: iterators of one loader whose workers may run at once


def ring_count(num_workers: int) -> int:
    return SETS * num_workers if num_workers else 1


class RingSets:
    """Main process only: which ring sets an iterator's workers own."""

    def __init__(self):
        self.owned = [False] * SETS

    def claim(self) -> int | None:
        for ring_set, owned in enumerate(self.owned):
            if not owned:
                self.owned[ring_set] = True
                return ring_set
        return None

    def release(self, ring_set: int) -> None:
        self.owned[ring_set] = False

    @staticmethod
    def rings(ring_set: int, num_workers: int) -> list[int]:
        """The ring of each worker of an iterator that owns `ring_set`."""
        return [ring_set * num_workers + w for w in range(num_workers)]


class FillRings:
    def __init__(self, ctl: np.ndarray, records: np.ndarray, data: memoryview, ring_bytes: int):
        self.ctl = ctl  # [rings, 4] int64
        self.records = records  # [rings, RECORDS, 4] int64
        self.data = data  # rings * ring_bytes
        self.ring_bytes = ring_bytes

    def put(self, ring: int, pos: int, index: int, raw: bytes) -> bool:
        """Worker side: hand over one sample's bytes; False when the ring has no room."""
        size, ctl = self.ring_bytes, self.ctl[ring]
        n = len(raw)
        head = int(ctl[HEAD])
        if n > size or head - int(ctl[TAIL]) >= RECORDS:
            return False
        cursor = int(ctl[WRITTEN])
        if cursor % size + n > size:
            cursor += size - cursor % size  # to the start of the next lap
        if cursor + n - int(ctl[FREED]) > size:
            return False
        start = ring * size + cursor % size
        self.data[start : start + n] = raw
        self.records[ring, head % RECORDS] = (pos, index, cursor, n)
        ctl[WRITTEN] = cursor + n
        ctl[HEAD] = head + 1
        return True

    def take(self) -> list[tuple[int, int, bytes]]:
        """Coordinator side: every record written since the last call, (position, index, bytes)."""
        out = []
        size = self.ring_bytes
        for ring in range(len(self.ctl)):
            ctl = self.ctl[ring]
            head, tail = int(ctl[HEAD]), int(ctl[TAIL])
            for record in range(tail, head):
                pos, index, cursor, n = (int(v) for v in self.records[ring, record % RECORDS])
                start = ring * size + cursor % size
                out.append((pos, index, bytes(self.data[start : start + n])))
                ctl[FREED] = cursor + n
            ctl[TAIL] = head
        return out
