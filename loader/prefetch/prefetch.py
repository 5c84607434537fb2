"""Prefetch in exact plan order into shared memory, bounded by bytes.

One coordinator thread walks the epoch's plan ahead of consumption: for each position it
finds the sample held (RAM) or on the disk tier, or publishes it as absent for the worker
to read and hand to the cache (fill_ring.py); under peer exchange it asks the peers first
(prefetch_peers.py) and reader threads read the rest (prefetch_reads.py). Placement
decisions (Belady, see placement.py) are made in plan order, exactly as the plan predicts.
A position is published in the `ready` ring once its bytes are in place (or it is known
absent); a worker marks it in the `done` ring after copying, and only then may the bytes
go. Staged bytes (read ahead but not cached) plus reads in flight stay under `staging`
bytes. An epoch whose samples all fit in RAM needs none of this per sample: it is kept
in bulk (resident.py).
"""

from __future__ import annotations

import logging
import queue
import threading
import warnings

import numpy as np

from loader.cache import resident
from loader.cache.disk import DiskTier
from loader.cache.holdings import Holdings
from loader.cache.ram import (
    ABSENT,
    DIRECT,
    GEN_BASE,
    MODE,
    PLANNED,
    SharedState,
)
from loader.peers.exchange import PeerExchange, PeerFailure, SizeRule
from loader.peers.prefetch import PeerWindows
from loader.plan.placement import first_use, next_use
from loader.prefetch.reads import StorageReads
from loader.source import ByteSource

log = logging.getLogger("loader")
BUSY_POLL_SECONDS = 0.001  # how often to look at the done ring while workers hold positions
RESIDENT_POLL_SECONDS = 0.004  # a resident epoch published whole: only fills and consumption to follow
IDLE_WAIT_SECONDS = 0.05


class Prefetcher(PeerWindows, StorageReads):
    def __init__(
        self,
        shared: SharedState,
        source: ByteSource,
        cache_ram: int,
        staging: int,
        threads: int,
        disk: DiskTier | None,
        peers: PeerExchange | None = None,
    ):
        self.shared, self.source, self.disk, self.peers = shared, source, disk, peers
        self.windows_started = 0  # peer-exchange windows of this epoch begun
        self.longest: int | None = None  # the longest stream of any rank this epoch, if not this one's
        self.peers_lost: str | None = None  # why this rank left the peer exchange, if it did
        self.lost: PeerFailure | None = None  # a loss the survivors have not regrouped after yet
        self.peer_failures = 0  # times this rank left the exchange
        self._asked: list[int] = []
        self.staging = staging
        self.holdings = Holdings(shared, cache_ram, disk)
        # what a peer may send (exchange.py): the dataset's own sizes, and no more than a peer holds (it
        # serves from its arena, cached or staged samples, and its disk tier)
        self.size_rule = SizeRule(
            source.nbytes, shared.layout.arena + (disk.budget if disk is not None else 0)
        )
        self.inflight: dict[int, int] = {}  # index -> estimated bytes, read asked and not yet placed
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
        # With fill rings the workers read what the node does not hold (fill_ring.py); reader threads
        # here serve only what peers could not provide.
        self.fills = shared.fills
        self.decided: set[int] = set()  # indices whose placement reserve() decided, bytes to come
        self.resident = False  # this epoch's samples all fit in RAM: bulk bookkeeping (resident.py)
        self.absent = 0  # positions of a resident epoch published while the node did not hold them
        self.readers = [
            threading.Thread(target=self._read_loop, name=f"prescient-reader-{n}", daemon=True)
            for n in range(threads if self.fills is None else 0)
        ]
        self.coordinator = threading.Thread(target=self._run, name="prescient-prefetch", daemon=True)
        for thread in self.readers + [self.coordinator]:
            thread.start()

    # --- called from the main thread ---------------------------------------------------------
    def begin_epoch(
        self,
        stream: np.ndarray,
        following: list[np.ndarray],
        base: int,
        home: np.ndarray | None = None,
        longest: int | None = None,
    ) -> None:
        """Switch to a new epoch's stream, whose first entry is global plan position `base`
        (larger than any position used before, so old ring entries never match). `home`: the
        samples this rank keeps for its peers (peer_plan.py), when they are decided. `longest`:
        the longest stream any rank has this epoch, when they differ (an elastic resume): every
        rank takes part in as many exchange windows as that one needs."""
        with self.lock:
            self._take_fills()  # the last epoch's reads, placed by its own plan before the renumbering
            self.holdings.cancel_reservations()
            self.decided.clear()
            self.longest = longest
            self.holdings.home = home
            if self.peers is not None:
                try:
                    self.peers.finish(self.holdings.copy_of, self.size_rule)  # every rank ends it alike
                except PeerFailure as failure:
                    self._lose_peers(failure)
            self.windows_started = 0
            self.shared.header[GEN_BASE] = base  # first: workers stop trusting older positions
            self.shared.header[MODE] = PLANNED if self.failure is None else DIRECT
            if not self.resident:  # a resident epoch pins nothing
                for position in range(self.consumed, self.done):  # published, never consumed: a break
                    self.holdings.release(int(self.stream[position]), int(self.holder[position]))
            while True:  # reads not started yet: not needed now
                try:
                    self.requests.get_nowait()
                except queue.Empty:
                    break
            self.inflight.clear()
            self.inflight_bytes = 0
            self.results.clear()
            horizon = np.concatenate([stream, *following]) if following else stream
            self.resident = (
                self.fills is not None
                and self.peers is None
                and resident.fits(self.holdings, self.source, horizon)
            )
            if not self.resident:  # a resident epoch needs no next uses: nothing is evicted
                self.upcoming = next_use(horizon)[: len(stream)]
                self.holdings.renumber(first_use(horizon))
            self.stream = stream
            self.holder = np.zeros(len(stream), dtype=np.int8)
            self.sched = self.done = self.consumed = self.absent = 0
            self.base = base
        self.wakeup.set()

    def usage(self) -> dict:
        with self.lock:
            return self.holdings.usage()

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
                self.wakeup.clear()  # before working: a wake-up during the work is not lost
                with self.lock:
                    if self.closed:
                        return
                    progressed = self._collect()
                    progressed = self._take_fills() or progressed
                    progressed = self._consume() or progressed
                    progressed = self._finalize() or progressed
                    progressed = self._exchange() or progressed
                    progressed = self._schedule() or progressed
                    busy = self.consumed < self.done or self.done < self.sched
                    poll = None
                    if self.resident and self.done == len(self.stream):  # published whole
                        poll = RESIDENT_POLL_SECONDS if self.absent else IDLE_WAIT_SECONDS
                if not progressed:
                    self.wakeup.wait(poll or (BUSY_POLL_SECONDS if busy else IDLE_WAIT_SECONDS))
        except BaseException as error:  # noqa: BLE001 - workers must never wait on a dead thread
            self.failure = error
            self.shared.header[MODE] = DIRECT
            warnings.warn(
                f"prescient loader: the prefetch thread failed ({type(error).__name__}: {error}); "
                "workers now read from storage directly",
                RuntimeWarning,
                stacklevel=1,
            )

    def _schedule(self) -> bool:
        progressed = False
        ring = len(self.shared.ready)
        end = len(self.stream)
        if self.peers is not None:  # only where the window's peers were asked first
            end = min(end, self.windows_started * self.peers.window)
        if self.fills is not None:  # the workers read what is absent: nothing to start here
            sched = max(self.sched, min(end, self.consumed + ring))
            progressed, self.sched = sched > self.sched, sched
            return progressed
        while self.sched < end and self.sched - self.consumed < ring:
            index = int(self.stream[self.sched])
            if not (index in self.inflight or self.holdings.has(index)):
                estimate = self.source.nbytes(index) or self._average()
                outstanding = self.holdings.staged_bytes + self.inflight_bytes
                if outstanding > 0 and outstanding + estimate > self.staging:
                    break
                self._request(index, estimate)
            self.sched += 1
            progressed = True
        return progressed

    def _finalize(self) -> bool:
        if self.resident:
            if self.done == self.sched:
                return False
            self.absent += resident.publish(self.shared, self.stream, self.base, self.done, self.sched)
            self.done = self.sched
            return True
        progressed = False
        while self.done < self.sched:
            position = self.done
            index, upcoming = int(self.stream[position]), int(self.upcoming[position])
            tier = self.holdings.use(index, upcoming)
            if tier == ABSENT and self.fills is not None and index not in self.holdings.reserved:
                # Decided now, in plan order; unknown size or no room now: placed when the bytes come.
                # Never waits for consumption: a worker holds its batch's fills until all are read.
                size = self.source.nbytes(index)
                if size is not None and self.holdings.reserve(index, size, upcoming):
                    self.decided.add(index)
            if tier == ABSENT and self.fills is None:
                if index not in self.results:
                    if index not in self.inflight:  # held earlier in the window, since freed: read again
                        self._request(index, self.source.nbytes(index) or self._average())
                    break
                tier = self.holdings.place(
                    index, self.results[index], upcoming, can_wait=self.consumed < self.done
                )
                if tier is None:
                    break  # consumption will free room
                del self.results[index]
                self.inflight_bytes -= self.inflight.pop(index)
            self.holder[position] = tier
            ring = len(self.shared.ready)
            self.shared.ready[(self.base + position) % ring] = self.base + position + 1
            self.done += 1
            progressed = True
        return progressed

    def _consume(self) -> bool:
        if self.resident:
            if self.sched == len(self.stream):
                return False  # published whole: consumption frees nothing and bounds nothing now
            consumed = resident.consumed_up_to(self.shared, self.base, self.consumed, self.done)
            progressed, self.consumed = consumed > self.consumed, consumed
            return progressed
        progressed = False
        ring = len(self.shared.done)
        while self.consumed < self.done:
            tag = self.base + self.consumed
            if self.shared.done[tag % ring] != tag + 1:
                break
            self.holdings.release(int(self.stream[self.consumed]), int(self.holder[self.consumed]))
            self.consumed += 1
            progressed = True
        return progressed

    def _take_fills(self) -> bool:
        """Offer the samples workers read this epoch to the cache (coordinator, lock held)."""
        if self.fills is None:
            return False
        if self.resident:
            return resident.take_fills(self.fills, self.holdings)
        taken = self.fills.take()
        for pos, index, raw in sorted(taken):
            position = pos - self.base
            if 0 <= position < len(self.stream) and not self.holdings.has(index):
                decided = index in self.decided  # reserve() ran when its use was published
                self.decided.discard(index)
                self.holdings.filled(index, raw, int(self.upcoming[position]), decided)
        return bool(taken)
