"""The dataset as the workers see it: planned reads come from shared memory or local disk.

The loader hands torch's workers this view instead of the user's dataset. An index that
the plan covers arrives as a Ticket (index, plan position, batch); the view waits until
the prefetcher has published that position, copies the raw bytes out of shared memory
(or reads the disk-tier file), marks the position consumed, and decodes in the worker as
the dataset would. Anything else is passed to the dataset untouched, exactly as torch
does. At batch edges a worker also records its RNG states, so that a resumed run can
restore them and decode with the same random augmentation.
"""

from __future__ import annotations

import multiprocessing.util
import os
import threading
import time

import torch
from torch.utils.data import Dataset, get_worker_info

from loader.cache.batch_reads import BatchReader
from loader.cache.disk import read_file
from loader.cache.fill_ring import RingSets
from loader.cache.ram import (
    COUNTERS,
    DIRECT_READS,
    DISK,
    FAILED,
    GEN_BASE,
    LENGTH,
    MODE,
    OFFSET,
    PLANNED,
    RAM,
    SAMPLES,
    STORAGE_BYTES,
    STORAGE_READS,
    TIER,
    WAIT_NS,
    SharedState,
)
from loader.plan.rng_state import capture_rng, restore_rng
from loader.source import ByteSource

# Ticket.edge bits: first / last of its batch; covered by the plan; among the epoch's last num_workers batches
FIRST, LAST, PLANNED_READ, NEAR_END = 1, 2, 4, 8
POLL_SECONDS = 0.0002  # how often a worker looks for a position it waits on
FILL_WAIT_SECONDS = 0.2  # how long a worker waits for room in its fill ring before it skips the fill
_MAIN_RING = threading.Lock()  # the main process's fill ring (num_workers=0), written from any thread
PARENT_CHECK_SECONDS = 0.5  # after this long waiting, a worker also checks that the main process lives


class Ticket:
    """A planned read: dataset `index` at global plan position `pos`, in batch `batch`
    (numbered within the epoch) whose first sample is at position `first`."""

    __slots__ = ("index", "pos", "batch", "first", "edge")

    def __init__(self, index: int, pos: int, batch: int, first: int, edge: int):
        self.index, self.pos, self.batch, self.first, self.edge = index, pos, batch, first, edge

    def __reduce__(self):
        return Ticket, (self.index, self.pos, self.batch, self.first, self.edge)

    def __repr__(self) -> str:
        return f"Ticket(index={self.index}, pos={self.pos})"


class TicketBatch:
    """A batch of Tickets as it travels to a worker: plain ints (a list of Ticket objects pickles many
    times slower, which on fast storage is most of what a worker does per batch)."""

    __slots__ = ("indices", "first", "batch", "flags")

    def __init__(self, indices: tuple, first: int, batch: int, flags: int):
        self.indices, self.first, self.batch, self.flags = indices, first, batch, flags

    def __reduce__(self):
        return TicketBatch, (self.indices, self.first, self.batch, self.flags)

    def __len__(self) -> int:
        return len(self.indices)

    def __iter__(self):
        return iter(self.tickets())

    def tickets(self) -> list[Ticket]:
        first, batch, flags, last = self.first, self.batch, self.flags, len(self.indices) - 1
        return [
            Ticket(
                index, first + j, batch, first, flags | (FIRST if j == 0 else 0) | (LAST if j == last else 0)
            )
            for j, index in enumerate(self.indices)
        ]


class CachedView(Dataset):
    def __init__(
        self,
        dataset,
        source: ByteSource | None,
        shared: SharedState | None,
        disk_dir: str | None,
        snap_ring: int,
        read_threads: int = 1,
    ):
        self.dataset = dataset
        self.reader = BatchReader(read_threads)  # storage reads in flight in one worker
        self.source = source
        self.shared = shared
        self.disk_dir = disk_dir
        self.snap_ring = snap_ring  # start-of-batch snapshot slots; then one end slot per worker
        self.resume_rng: dict[int, torch.Tensor] | None = None  # worker id -> RNG state to start from
        self._resumed = False
        self._parent = os.getpid()  # the main process: workers are its children
        self._exit_hook: int | None = None  # pid that registered the exit snapshot
        self._last_end: int | None = None  # tag of this worker's last finished batch
        self.fill_ring: int | None = None  # in a worker: its fill ring, set by worker_loop (None: no fills)
        self.ring_sets = RingSets()  # in the main process: which iterator's workers own which rings

    def __getattr__(self, name: str):
        # worker_init_fn and collate functions reach the dataset through get_worker_info().dataset
        if name.startswith("__") or "dataset" not in self.__dict__:
            raise AttributeError(name)
        return getattr(self.__dict__["dataset"], name)

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitems__(self, keys: list) -> list:
        """A whole batch (torch's fetcher hands it over in one call): planned positions are copied
        from the cache, the rest read from storage together (batch_reads.py), then all decoded in
        the batch's order."""
        if type(keys) is TicketBatch:
            keys = keys.tickets()
        if self.source is None or not keys or not all(type(k) is Ticket for k in keys):
            return [self[k] for k in keys]
        row, worker = self._row()
        self._batch_start(keys[0], worker)
        raws = [self._planned_raw(k, row, defer=True) if k.edge & PLANNED_READ else None for k in keys]
        unread = [j for j, raw in enumerate(raws) if raw is None]  # not held, or not planned
        fills = [j for j in unread if keys[j].edge & PLANNED_READ]
        try:
            for j, raw in zip(
                unread, self.reader.read_all(self.source.read, [keys[j].index for j in unread])
            ):
                raws[j] = raw
            for j in fills:
                self._fill(keys[j], row, raws[j])
        finally:
            done = self.shared.fast["done"]
            for j in fills:  # after the fill: the coordinator finds the bytes when it sees the use
                done[keys[j].pos % len(done)] = keys[j].pos + 1
        if unread:
            self._count_direct(row, len(unread), sum(len(raws[j]) for j in unread), len(unread) - len(fills))
        samples = [self.source.decode(raw, k.index) for raw, k in zip(raws, keys)]
        self.shared.fast["counters"][row * COUNTERS + SAMPLES] += len(keys)
        self._batch_end(keys[-1], worker)
        return samples

    def __getitem__(self, key):
        row, worker = self._row()
        if type(key) is not Ticket:
            self.shared.fast["counters"][row * COUNTERS + SAMPLES] += 1
            return self.dataset[key]
        self._batch_start(key, worker)
        if key.edge & PLANNED_READ:
            sample = self.source.decode(self._planned_raw(key, row), key.index)
        elif self.source is not None:
            sample = self.source.decode(self._direct(key.index, row), key.index)
        else:
            sample = self.dataset[key.index]
        self.shared.fast["counters"][row * COUNTERS + SAMPLES] += 1
        self._batch_end(key, worker)
        return sample

    def _batch_start(self, ticket: Ticket, worker: int | None) -> None:
        if worker is None:
            return
        if self.resume_rng is not None and not self._resumed:
            self._resumed = True
            if worker in self.resume_rng:
                restore_rng(self.resume_rng[worker])
        if ticket.edge & FIRST:
            self.shared.put_snapshot(ticket.batch % self.snap_ring, ticket.first + 1, capture_rng())

    def _batch_end(self, ticket: Ticket, worker: int | None) -> None:
        """The worker's state after its batch, for a resume whose next batch this worker never starts:
        taken now near the epoch's end (a worker with no batch left), else when the worker exits (the
        training loop dropped the iterator); a snapshot costs as much as reading a few samples."""
        if worker is None or not ticket.edge & LAST:
            return
        if ticket.edge & NEAR_END:
            self.shared.put_snapshot(self.snap_ring + worker, ticket.first + 1, capture_rng())
            self._last_end = None  # the exit must not overwrite it with an older batch's
            return
        if self._exit_hook != os.getpid():
            self._exit_hook = os.getpid()
            multiprocessing.util.Finalize(None, self._exit_snapshot, args=(worker,), exitpriority=10)
        self._last_end = ticket.first + 1

    def _exit_snapshot(self, worker: int) -> None:
        if self._last_end is not None and self.shared is not None and self.shared.snaps is not None:
            self.shared.put_snapshot(self.snap_ring + worker, self._last_end, capture_rng())

    def _row(self) -> tuple[int, int | None]:
        info = get_worker_info()
        return (1, None) if info is None else (2 + info.id, info.id)

    def _planned_raw(self, ticket: Ticket, row: int, defer: bool = False) -> bytes | None:
        """The planned sample's bytes from the cache; one the node does not hold is read from storage
        here and handed to the cache (fill_ring.py), or with `defer` left to the caller: None, and the
        caller marks the position done after the fill."""
        shared = self.shared
        fast = shared.fast
        header, ready = fast["header"], fast["ready"]
        slot = ticket.pos % len(ready)
        waited = None
        while True:
            if header[MODE] != PLANNED or header[GEN_BASE] > ticket.pos:
                return self._direct(ticket.index, row)  # the plan no longer covers this read
            if ready[slot] == ticket.pos + 1:
                break
            if waited is None:
                waited = time.perf_counter()
            elif (
                row >= 2
                and time.perf_counter() - waited > PARENT_CHECK_SECONDS
                and os.getppid() != self._parent
            ):
                os._exit(1)  # a worker whose main process is gone: nothing will come
            time.sleep(POLL_SECONDS)
        if waited is not None:
            fast["counters"][row * COUNTERS + WAIT_NS] += int((time.perf_counter() - waited) * 1e9)
        deferred = False
        try:
            table, base = fast["table"], ticket.index * 4
            tier, offset, length = table[base + TIER], table[base + OFFSET], table[base + LENGTH]
            raw = None
            if tier == RAM:
                raw = shared.read(offset, length)
            elif tier == DISK:
                raw = read_file(f"{self.disk_dir}/{ticket.index}", length)
            if raw is not None and header[GEN_BASE] > ticket.pos:
                raw = None  # released while we copied: do not trust it
            elif raw is None and shared.fills is not None and tier != FAILED:
                if defer:
                    deferred = True
                    return None
                raw = self._read_fill(ticket, row)
            return raw if raw is not None else self._direct(ticket.index, row)
        finally:
            if not deferred:
                fast["done"][slot] = ticket.pos + 1

    def _read_fill(self, ticket: Ticket, row: int) -> bytes:
        raw = self.source.read(ticket.index)
        self._count_direct(row, 1, len(raw), 0)
        self._fill(ticket, row, raw)
        return raw

    def _fill(self, ticket: Ticket, row: int, raw: bytes) -> None:
        """Hand a planned sample read from storage to the cache, unless the plan moved on meanwhile."""
        fills, header = self.shared.fills, self.shared.fast["header"]
        # the main process has a ring only when it reads (num_workers=0: the only ring)
        ring = self.fill_ring if row != 1 else (0 if len(fills.ctl) == 1 else None)
        if ring is None or len(raw) > fills.ring_bytes:
            return
        deadline = None
        while header[MODE] == PLANNED and header[GEN_BASE] <= ticket.pos:
            if row == 1:  # one writer per ring: iterators of a num_workers=0 loader may run in two threads
                with _MAIN_RING:
                    put = fills.put(ring, ticket.pos, ticket.index, raw)
            else:
                put = fills.put(ring, ticket.pos, ticket.index, raw)
            if put:
                return
            now = time.perf_counter()  # the ring is full: the coordinator takes it every millisecond or so
            if deadline is None:
                deadline = now + FILL_WAIT_SECONDS
            elif now > deadline:
                return  # not cached this time
            time.sleep(POLL_SECONDS)

    def _direct(self, index: int, row: int) -> bytes:
        raw = self.source.read(index)
        self._count_direct(row, 1, len(raw))
        return raw

    def _count_direct(self, row: int, reads: int, nbytes: int, direct: int | None = None) -> None:
        """Storage reads made here; `direct` of them (default all) outside the plan."""
        counters, base = self.shared.fast["counters"], row * COUNTERS
        counters[base + STORAGE_READS] += reads
        counters[base + STORAGE_BYTES] += nbytes
        counters[base + DIRECT_READS] += reads if direct is None else direct


class CachedItemsView(CachedView):
    """For datasets with their own `__getitems__` (torch then fetches a batch in one call):
    never cached, the batch goes to the dataset in one call as torch would pass it."""

    def __getitems__(self, keys: list):
        row, worker = self._row()
        if type(keys) is TicketBatch:
            keys = keys.tickets()
        tickets = [k for k in keys if type(k) is Ticket]
        if tickets:
            self._batch_start(tickets[0], worker)
        samples = self.dataset.__getitems__([k.index if type(k) is Ticket else k for k in keys])
        self.shared.fast["counters"][row * COUNTERS + SAMPLES] += len(keys)
        if tickets:
            self._batch_end(tickets[-1], worker)
        return samples
