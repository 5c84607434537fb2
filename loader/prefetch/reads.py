"""The prefetcher's storage readers: threads in the main process that read what the peers
could not provide (with fill rings the workers read everything else themselves,
fill_ring.py). Reads start in plan order; results go back to the coordinator through a
queue, and it takes them in plan order.

A mixin of Prefetcher (prefetch.py); the readers never take the prefetcher's lock.
"""

from __future__ import annotations

import queue

from loader.cache.ram import STORAGE_BYTES, STORAGE_READS


class StorageReads:
    def _average(self) -> int:
        return self.read_bytes // self.read_count if self.read_count else 1 << 20

    def _request(self, index: int, estimate: int) -> None:
        self.inflight[index] = estimate
        self.inflight_bytes += estimate
        self.requests.put(index)

    def _read_loop(self) -> None:
        while True:
            index = self.requests.get()
            if index is None:
                return
            try:
                raw: bytes | BaseException = self.source.read(index)
            except BaseException as error:  # noqa: BLE001 - handed to the worker, which raises it
                raw = error
            self.delivered.put((index, raw))
            self.wakeup.set()

    def _collect(self) -> bool:
        """Take the readers' results (coordinator thread, lock held)."""
        progressed = False
        while True:
            try:
                index, raw = self.delivered.get_nowait()
            except queue.Empty:
                return progressed
            progressed = True
            if not isinstance(raw, BaseException):
                self.shared.counters[0, STORAGE_READS] += 1
                self.shared.counters[0, STORAGE_BYTES] += len(raw)
                self.read_bytes += len(raw)
                self.read_count += 1
            if index in self.inflight:
                self.results[index] = raw
