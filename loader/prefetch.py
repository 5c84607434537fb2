"""Prefetch in exact plan order into shared memory, bounded by bytes.

One coordinator thread walks the epoch's plan ahead of consumption: for each position it
either finds the sample held (RAM), on the disk tier, or asks a reader thread to fetch it
from storage. Reads start in plan order; their results are taken in plan order too, so
the placement decisions (Belady, see placement.py) are made exactly as the plan predicts.
A position is published in the `ready` ring once its bytes are in place; a worker marks
it in the `done` ring after copying, and only then may the bytes go. Staged bytes (read
ahead but not cached) plus reads in flight stay under `staging` bytes.
"""
from __future__ import annotations

import queue
import threading
import warnings
from dataclasses import dataclass

import numpy as np

from loader.arena import Arena
from loader.cache_disk import DiskTier, read_file
from loader.cache_ram import (ABSENT, DIRECT, DISK, DISK_HITS, FAILED, GEN_BASE, LENGTH, MODE, PEER_READS, PLANNED,
                              RAM,
                              RAM_HITS, STORAGE_BYTES, STORAGE_READS, SharedState)
from loader.exchange import PeerExchange
from loader.placement import NEVER, BeladyCache, first_use, next_use
from loader.source import ByteSource

BUSY_POLL_SECONDS = 0.001   # how often to look at the done ring while workers hold positions
IDLE_WAIT_SECONDS = 0.05


@dataclass
class _Held:
    """A sample's bytes in the shared data area."""
    offset: int
    size: int
    pending: int = 0          # published positions not yet consumed
    next_use: int = NEVER     # plan position of its next use after the last one published


class Prefetcher:
    def __init__(self, shared: SharedState, source: ByteSource, cache_ram: int, staging: int,
                 threads: int, disk: DiskTier | None, peers: PeerExchange | None = None):
        self.shared, self.source, self.disk, self.peers = shared, source, disk, peers
        self.windows_started = 0              # peer-exchange windows of this epoch begun
        self.staging = staging
        self.ram = BeladyCache(cache_ram)
        self.disk_set = BeladyCache(disk.budget) if disk else None
        self.disk_pending: dict[int, int] = {}
        self.arena = Arena(shared.layout.arena)
        self.held: dict[int, _Held] = {}
        self.staged_bytes = self.staged_peak = 0  # held bytes outside the RAM cache set
        self.inflight: dict[int, int] = {}        # index -> estimated bytes, read asked and not yet placed
        self.inflight_bytes = 0
        self.results: dict[int, bytes | BaseException] = {}
        self.read_bytes = self.read_count = 0
        self.stream = np.empty(0, dtype=np.int64)
        self.upcoming = self.stream
        self.holder = np.zeros(0, dtype=np.int8)
        self.base = 0
        self.sched = self.done = self.consumed = 0
        self.failure: BaseException | None = None
        self.closed = False
        # The coordinator's state is guarded by `lock`, held while it works and released while
        # it waits; reader threads never take it: they hand results over through `delivered`.
        self.lock = threading.Lock()
        self.wakeup = threading.Event()
        self.requests: queue.SimpleQueue = queue.SimpleQueue()
        self.delivered: queue.SimpleQueue = queue.SimpleQueue()
        self.readers = [threading.Thread(target=self._read_loop, name=f"prescient-reader-{n}", daemon=True)
                        for n in range(threads)]
        self.coordinator = threading.Thread(target=self._run, name="prescient-prefetch", daemon=True)
        for thread in self.readers + [self.coordinator]:
            thread.start()

    # --- called from the main thread ---------------------------------------------------------
    def begin_epoch(self, stream: np.ndarray, following: list[np.ndarray], base: int) -> None:
        """Switch to a new epoch's stream, whose first entry is global plan position `base`
        (larger than any position used before, so old ring entries never match)."""
        with self.lock:
            if self.peers is not None:
                self.peers.finish(self._holding)     # every rank ends the window in flight alike
            self.windows_started = 0
            self.shared.header[GEN_BASE] = base    # first: workers stop trusting older positions
            self.shared.header[MODE] = PLANNED if self.failure is None else DIRECT
            for position in range(self.consumed, self.done):   # published, never consumed: a break
                self._release(position)
            while True:                                         # reads not started yet: not needed now
                try:
                    self.requests.get_nowait()
                except queue.Empty:
                    break
            self.inflight.clear()
            self.inflight_bytes = 0
            self.results.clear()
            horizon = np.concatenate([stream, *following]) if following else stream
            self.upcoming = next_use(horizon)[: len(stream)]
            first = first_use(horizon)
            self.ram.renumber(lambda i: first.get(i, NEVER))
            if self.disk_set is not None:
                self.disk_set.renumber(lambda i: first.get(i, NEVER))
            for index, held in self.held.items():
                held.next_use = first.get(index, NEVER)
            self.stream = stream
            self.holder = np.zeros(len(stream), dtype=np.int8)
            self.sched = self.done = self.consumed = 0
            self.base = base
        self.wakeup.set()

    def usage(self) -> dict:
        with self.lock:
            disk_used = self.disk_set.used if self.disk_set else 0
            return {"cache_ram_bytes": self.ram.used, "cache_ram_peak_bytes": self.ram.peak,
                    "cache_ram_samples": len(self.ram), "staging_bytes": self.staged_bytes,
                    "staging_peak_bytes": self.staged_peak, "cache_disk_bytes": disk_used,
                    "cache_disk_peak_bytes": self.disk_set.peak if self.disk_set else 0,
                    "cache_disk_samples": len(self.disk_set) if self.disk_set else 0,
                    "disk_tier_enabled": bool(self.disk and self.disk.enabled)}

    def close(self) -> None:
        with self.lock:
            self.closed = True
        self.wakeup.set()
        for _ in self.readers:
            self.requests.put(None)
        self.coordinator.join(timeout=5)
        for thread in self.readers:
            thread.join(timeout=5)
        if self.disk is not None:
            self.disk.close()

    # --- the coordinator -------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while True:
                with self.lock:
                    if self.closed:
                        return
                    progressed = self._collect()
                    progressed = self._consume() or progressed
                    progressed = self._finalize() or progressed
                    progressed = self._exchange() or progressed
                    progressed = self._schedule() or progressed
                    busy = self.consumed < self.done or self.done < self.sched
                if not progressed:
                    self.wakeup.wait(BUSY_POLL_SECONDS if busy else IDLE_WAIT_SECONDS)
                    self.wakeup.clear()
        except BaseException as error:  # noqa: BLE001 - workers must never wait on a dead thread
            self.failure = error
            self.shared.header[MODE] = DIRECT
            warnings.warn(f"prescient loader: the prefetch thread failed ({type(error).__name__}: {error}); "
                          "workers now read from storage directly", RuntimeWarning, stacklevel=1)

    def _schedule(self) -> bool:
        progressed = False
        ring = len(self.shared.ready)
        end = len(self.stream)
        if self.peers is not None:            # only where the window's peers were asked first
            end = min(end, self.windows_started * self.peers.window)
        while self.sched < end and self.sched - self.consumed < ring:
            index = int(self.stream[self.sched])
            if not (index in self.held or index in self.inflight or self._on_disk(index)):
                estimate = self.source.nbytes(index) or self._average()
                outstanding = self.staged_bytes + self.inflight_bytes
                if outstanding > 0 and outstanding + estimate > self.staging:
                    break
                self._request(index, estimate)
            self.sched += 1
            progressed = True
        return progressed

    def _finalize(self) -> bool:
        progressed = False
        while self.done < self.sched:
            position = self.done
            index, upcoming = int(self.stream[position]), int(self.upcoming[position])
            held = self.held.get(index)
            if held is not None:
                self._use_held(index, held, upcoming)
                self.holder[position] = RAM
            elif self._on_disk(index):
                self.disk_pending[index] = self.disk_pending.get(index, 0) + 1
                if index in self.disk_set:
                    self.disk_set.touch(index, upcoming)
                self.shared.counters[0, DISK_HITS] += 1
                self.holder[position] = DISK
            elif index in self.results:
                if not self._place(index, upcoming):
                    break
                self.holder[position] = RAM if index in self.held else ABSENT
            else:
                if index not in self.inflight:      # held earlier in the window, since freed: read again
                    self._request(index, self.source.nbytes(index) or self._average())
                break
            ring = len(self.shared.ready)
            self.shared.ready[(self.base + position) % ring] = self.base + position + 1
            self.done += 1
            progressed = True
        return progressed

    def _consume(self) -> bool:
        progressed = False
        ring = len(self.shared.done)
        while self.consumed < self.done:
            tag = self.base + self.consumed
            if self.shared.done[tag % ring] != tag + 1:
                break
            self._release(self.consumed)
            self.consumed += 1
            progressed = True
        return progressed

    # --- peers ---------------------------------------------------------------------------------
    def _exchange(self) -> bool:
        peers = self.peers
        if peers is None:
            return False
        if peers.busy:
            received = peers.poll(self._holding)
            if received is None:
                return False
            for index, raw in received.items():
                if index in self.inflight and index not in self.results:
                    self.results[index] = raw
                    self.shared.counters[0, PEER_READS] += 1
            for index in self._asked:
                if index not in received:
                    self.requests.put(index)      # no peer holds it: storage
            return True
        size = peers.window
        windows = -(-len(self.stream) // size)
        start = self.windows_started * size
        if self.windows_started >= windows or self.sched < start - size:
            return False
        needs = []
        for index in dict.fromkeys(self.stream[start: start + size].tolist()):
            if not (index in self.held or index in self.inflight or self._on_disk(index)):
                estimate = self.source.nbytes(index) or self._average()
                self.inflight[index] = estimate
                self.inflight_bytes += estimate
                needs.append(index)
        self._asked = needs
        peers.start(needs)
        self.windows_started += 1
        return True

    def _holding(self, index: int) -> bytes | None:
        """This rank's copy of a sample, if it has one."""
        held = self.held.get(index)
        if held is not None:
            return self.shared.read(held.offset, held.size)
        if self._on_disk(index):
            return read_file(self.disk.path(index), int(self.shared.table[index, LENGTH]))
        return None

    # --- placement -------------------------------------------------------------------------------
    def _place(self, index: int, upcoming: int) -> bool:
        """Put a fresh read into shared memory; False when it must wait for room."""
        raw = self.results[index]
        if isinstance(raw, BaseException):
            self.shared.set_entry(index, FAILED)          # the worker re-reads and raises with index and path
        else:
            offset = self.arena.alloc(len(raw))
            while offset is None and self.consumed == self.done and self._evict_one():
                offset = self.arena.alloc(len(raw))
            if offset is None:
                if self.consumed < self.done:
                    return False                          # consumption will free room
                self.shared.set_entry(index, ABSENT)      # larger than the whole area: the worker reads it
            else:
                self.shared.write(offset, raw)
                held = _Held(offset, len(raw), pending=1, next_use=upcoming)
                self.held[index] = held
                self.shared.set_entry(index, RAM, offset, len(raw))
                victims = self.ram.offer(index, len(raw), upcoming)
                if victims is None:
                    self._add_staged(len(raw))
                else:
                    self._evict(victims)
        del self.results[index]
        self.inflight_bytes -= self.inflight.pop(index)
        return True

    def _use_held(self, index: int, held: _Held, upcoming: int) -> None:
        held.pending += 1
        held.next_use = upcoming
        if index in self.ram:
            self.ram.touch(index, upcoming)
        else:
            victims = self.ram.offer(index, held.size, upcoming)
            if victims is not None:
                self.staged_bytes -= held.size
                self._evict(victims)
        self.shared.counters[0, RAM_HITS] += 1

    def _evict(self, victims: list[int]) -> None:
        for victim in victims:
            held = self.held[victim]
            self._add_staged(held.size)       # out of the cache set; its bytes stay while pending
            if held.pending == 0:
                self._drop(victim)

    def _evict_one(self) -> bool:
        """Make room for a sample needed now: evict the farthest-used cached one (not pending)."""
        for index, _ in sorted(self.ram.kept.items(), key=lambda kv: -kv[1][1]):
            if self.held[index].pending == 0:
                self.ram.remove(index)
                self._add_staged(self.held[index].size)
                self._drop(index)
                return True
        return False

    def _drop(self, index: int) -> None:
        """Free a sample's shared bytes; keep it on the disk tier if placement says so."""
        held = self.held.pop(index)
        self.staged_bytes -= held.size
        tier = ABSENT
        if self.disk_set is not None and self.disk.enabled:
            victims = self.disk_set.offer(index, held.size, held.next_use,
                                          can_evict=lambda victim: not self.disk_pending.get(victim))
            if victims is not None:
                for victim in victims:
                    self._disk_evict(victim)
                if self.disk.write(index, self.shared.read(held.offset, held.size)):
                    tier = DISK
                else:
                    self.disk_set.remove(index)
        self.shared.set_entry(index, tier, 0, held.size if tier == DISK else 0)
        self.arena.free(held.offset)

    def _disk_evict(self, index: int) -> None:
        self.shared.set_entry(index, ABSENT)
        self.disk.remove(index)

    def _release(self, position: int) -> None:
        index, kind = int(self.stream[position]), int(self.holder[position])
        if kind == RAM:
            held = self.held[index]
            held.pending -= 1
            if held.pending == 0 and index not in self.ram:
                self._drop(index)
        elif kind == DISK:
            left = self.disk_pending[index] - 1
            if left:
                self.disk_pending[index] = left
            else:
                del self.disk_pending[index]

    # --- helpers ---------------------------------------------------------------------------------
    def _on_disk(self, index: int) -> bool:
        return self.disk_set is not None and index in self.disk_set

    def _add_staged(self, nbytes: int) -> None:
        self.staged_bytes += nbytes
        self.staged_peak = max(self.staged_peak, self.staged_bytes)

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
