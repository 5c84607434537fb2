"""The main-process side of the loader: plan each epoch, run the prefetcher, keep the
shared state alive as long as the loader, and remember where the epoch is for resume.

Note [Loader protocol: main <-> workers <-> cache, shutdown and resume]
=======================================================================

Processes and what they share. The main process owns one shared-memory segment
(cache_ram.py: header, per-process counters, the sample table, the ready/done rings, RNG
snapshot slots, the workers' fill rings, the data arena) and, with a cache, the prefetcher
(prefetch.py: one coordinator thread; reader threads only for what peers could not give).
The loader's worker processes (worker_loop.py, started by multiprocess_iterator.py) get the
dataset view (view.py), which attaches to the segment by name. Nothing but plain ints and raw
sample bytes crosses a process boundary outside the iterator's queues; no pickle is read from
shared memory, from a peer or from a checkpoint.

      main process                                   worker w (worker_loop.py)
      ------------                                   -------------------------
      sampler --(first draw)--> plan the epoch
      PlannedSampler: TicketBatch(indices, first position, batch #, flags)
             -- index queue w: (task, batch) -->     view.__getitems__(batch):
      prefetcher (cache configured):                   FIRST: RNG snapshot -> slot batch % ring
        walks the plan in order: a held sample          planned position p:
        is pinned; for one not held it decides           wait ready[p % ring] == p + 1
        now whether the cache keeps it (Belady,          held: copy bytes (table: tier, offset, length)
        room reserved), then                             not held: read storage with the batch
        ready[p % ring] = p + 1  -------------------->     (batch_reads.py), bytes -> own fill ring
        fill ring records (p, index, bytes) <---------     (fill_ring.py)
          -> into the reserved room, table: RAM          done[p % ring] = p + 1
        done[p % ring] == p + 1  <--------------------   not planned / no cache: read storage here
        -> unpin, evict (Belady)                         then decode in the batch's order
             <-- result queue: (task, batch) --        LAST near the epoch's end: RNG snapshot
      __next__ times the wait (stall)                  -> slot ring + w (else at worker exit)

Iterators and workers (iterator.py, multiprocess_iterator.py, worker_loop.py). iter(loader)
makes an iterator: it makes the sampler's iterator, then draws the workers' base seed from
the loader's generator (torch's order, which the plan and resume rely on), then starts
num_workers processes with the chosen multiprocessing context. Task t, the t-th batch of
indices drawn, goes to the next live worker round robin; at most prefetch_factor x
num_workers tasks are out; results come back on one queue and are yielded in task order
(in_order=False: as they arrive). A result's plain CPU tensors do not travel as torch's do
(a shared-memory file per tensor, its descriptor passed over a socket): the worker copies
their storages into its ring of the iterator's result segment and the main process copies
them out as it takes the result, giving the room back (result_rings.py). A worker seeds
itself from the base seed and its id as torch's do, sets get_worker_info(), runs
worker_init_fn, and sends each batch or a WorkerError (its exception type and traceback,
raised again in the main process). A persistent worker gets NewEpoch at each epoch and
echoes it. The fill rings an iterator's workers write are a set it claims at start and gives
back when all of them have exited (fill_ring.py), so two iterators of one loader alive at
once never share a ring. torch internals the loader touches, each tested to exist
(test_contract.py) so that a torch upgrade fails loudly: get_worker_info() reads
torch.utils.data._utils.worker._worker_info, which a worker sets to a
torch.utils.data._utils.worker.WorkerInfo; and torch's DataLoader constructor (inherited)
sets _IterableDataset_len_called, which the length warning of an IterableDataset reads. Not
reproduced: torch's SIGCHLD handler (a thread waits on the workers' process sentinels
instead and wakes a waiting next() at once, worker_watch.py) and its C handlers for
SIGSEGV/SIGBUS in workers (the worker dies by the signal and is reported as killed by it);
DataPipes get no sharding of their own.

Positions are global: epoch e's plan starts at e * EPOCH_STRIDE, so a stale ring entry
never matches a new epoch. header[GEN_BASE] is the oldest position still valid and
header[MODE] says whether the plan is trusted (PLANNED) or every read is direct (DIRECT):
the main process sets DIRECT when the sampler departs from the plan, when the prefetcher
fails, and on close, so a worker never waits on a position that will not come.

Peers (exchange.py): under torch.distributed, each window of plan positions is four gloo
collectives on the loader's own group (needs, holders, sizes, payload); the payload is raw
bytes in a uint8 tensor, and a dataset cached with cache_items (pickled items) is refused.
Each sample has a home rank that keeps it for the others (peer_plan.py). A window that
fails or outlasts peer_timeout, or a peer whose sizes or CRC-32s are wrong, makes the rank
log who is at fault (heartbeats and accusations in the rendezvous store, peer_health.py)
and read the rest of the epoch itself; the survivors regroup at the next epoch's start
(peer_cluster.py).

Shutdown. An iterator stops its workers at the epoch's end (unless persistent), when it is
dropped, on close() and at interpreter exit: done event, None to each, join, then terminate
what is left after 0.5 s. The loader's close(), garbage collection (weakref.finalize) and
interpreter exit stop the prefetcher, set MODE = DIRECT, unlink the segment and remove the
disk tier. If the main process is SIGKILLed: an idle worker notices the dead parent within
WATCH_SECONDS (1 s), and a worker waiting on a ready position checks its parent pid after
0.5 s and exits; the resource tracker unlinks the segment; segments and disk-tier
directories stay flock-ed by their owner while it lives, and the next loader removes those
nobody locks (reclaim.py). Segments reserve their pages at creation (posix_fallocate), so
loaders on one node never overcommit /dev/shm: a segment that cannot fit is an error.

Resume. An epoch's order is fixed by the RNG states at its sampler's first draw
(resume.py). state_dict() holds those states (uint8 tensors), the batches yielded, and for
each worker the RNG state it must start its next batch with: the snapshot its upcoming
batch started with, or, if it never starts one (the iterator was dropped, or it has none
left this epoch), the state after its last batch. A new loader replays the sampler from
the saved states, skips the yielded batches, rotates the iterator's round robin so batch
b still goes to worker b % num_workers, and each worker restores its state before its first batch.
Under a DistributedSampler the state also records the world size; resumed under another
one (elastic), the rest of the epoch is what no old rank yielded, dealt out to the new ranks
(elastic.py), and the sampler's own stream takes over again from the next epoch.
"""

from __future__ import annotations

import logging
import threading
import warnings
import weakref
from dataclasses import dataclass, field

import numpy as np
import torch
from torch.utils.data import BatchSampler, IterableDataset

from loader.cache.disk import DiskTier
from loader.cache.fill_ring import ring_count
from loader.cache.ram import DIRECT, GEN_BASE, MODE, Layout, SharedState, shm_free_bytes
from loader.cache.view import CachedItemsView, CachedView
from loader.options import PEER_READ_THREADS, READS_IN_FLIGHT, CacheOptions
from loader.peers.cluster import PeerCluster
from loader.plan.plan import EpochPlan, plan_epoch
from loader.plan.resume import EpochStart, ResumePoint, capture, restore
from loader.prefetch.prefetch import Prefetcher
from loader.retry import RetryPolicy
from loader.source import ByteSource, has_read_decode
from loader.workers.snapshots import worker_snapshots

log = logging.getLogger("loader")
EPOCH_STRIDE = 1 << 40  # plan positions of epoch e start at e * EPOCH_STRIDE
RING = 1 << 16  # plan positions that may be published and unconsumed at once
SHM_SHARE = 0.8  # of /dev/shm's free space the loader may take (torch's workers need some)


@dataclass
class EpochState:
    start: EpochStart  # RNG states at the sampler's first draw
    plan: EpochPlan | None
    pos0: int  # plan position of the epoch's sample 0
    skipped: int  # batches skipped because of a resume
    num_batches: int | None
    yielded: int = 0  # batches handed to the caller, skipped ones included
    batch_first: list[int] = field(default_factory=list)  # sample offset of each dispatched batch
    expected: list[int] | None = None  # the plan's indices while it still matches the sampler
    override: list | None = None  # elastic resume: this rank's batches instead of the sampler's (elastic.py)


class _Resources:
    """What must be released even if the loader is never closed (weakref.finalize calls close)."""

    def __init__(self):
        self.shared: SharedState | None = None
        self.prefetcher: Prefetcher | None = None

    def close(self) -> None:
        if self.prefetcher is not None:
            self.prefetcher.close()
            self.prefetcher = None
        if self.shared is not None:
            self.shared.close()
            self.shared = None


class Clairvoyant:
    def __init__(self, loader, options: CacheOptions):
        self.loader_ref = weakref.ref(loader)
        self.options = options
        dataset = loader.dataset
        self.map_style = not isinstance(dataset, IterableDataset)
        own_batching = callable(getattr(dataset, "__getitems__", None))
        cacheable = self.map_style and not own_batching and (has_read_decode(dataset) or options.cache_items)
        retry = RetryPolicy(options.read_attempts, options.read_retry_delay)
        self.source = (
            ByteSource(dataset, items=not has_read_decode(dataset), retry=retry) if cacheable else None
        )
        self.num_workers = loader.num_workers
        self.persistent = loader.persistent_workers and loader.num_workers > 0
        self.snap_ring = (loader.prefetch_factor or 0) * loader.num_workers + 2 * loader.num_workers
        self.reads_in_flight = self._reads_in_flight(loader)
        self.resources = _Resources()
        self._finalizer = weakref.finalize(self, self.resources.close)
        self.view: CachedView | None = None
        self.start_lock = threading.Lock()
        self.epoch: EpochState | None = None
        self.epochs_begun = 0
        self.resume: ResumePoint | None = None
        self.rotation = 0
        self.stall_seconds = 0.0
        self.batches = 0
        self.cluster: PeerCluster | None = None  # the ranks exchanging samples (peer_cluster.py)
        self.elastic: tuple[list, int] | None = None  # a resume under another world size (elastic.py)
        if options.peer_exchange and self.source is not None and self.source.items:
            raise ValueError(
                "peer_exchange: a dataset cached with cache_items=True is cached as pickled "
                "items, and bytes from another process are never unpickled; implement "
                "read(index) -> bytes and decode(raw, index) to exchange raw samples with peers"
            )
        if options.peer_exchange and self.source is not None:
            import torch.distributed as dist

            if not (dist.is_available() and dist.is_initialized()):
                raise ValueError(
                    "peer_exchange=True needs torch.distributed initialized (e.g. under torchrun, "
                    "after dist.init_process_group); build the loader after that"
                )
            self.cluster = PeerCluster(options.peer_window, options.peer_timeout)

    @property
    def shared(self) -> SharedState | None:
        return self.resources.shared

    @property
    def prefetcher(self) -> Prefetcher | None:
        return self.resources.prefetcher

    def dataset_view(self, dataset):
        """What torch's iterator (and so its workers) use as the dataset."""
        if not self.map_style:
            return dataset
        with self.start_lock:  # iterators may be made in two threads at once (num_workers=0)
            return self._view(dataset)

    def _view(self, dataset):
        if self.view is None:
            self._start(dataset)
            kind = CachedItemsView if callable(getattr(dataset, "__getitems__", None)) else CachedView
            self.view = kind(
                dataset,
                self.source,
                self.shared,
                self.prefetcher.disk.dir if self.prefetcher and self.prefetcher.disk else None,
                max(self.snap_ring, 1),
                read_threads=self.reads_in_flight,
            )
        return self.view

    def _start(self, dataset) -> None:
        opts = self.options
        # Nothing to keep across epochs: the workers read their batches themselves (batch_reads.py) and
        # the main process only plans; the prefetcher runs where there is a cache to place samples in.
        placing = self.source is not None and bool(opts.cache_ram or opts.cache_disk or self.cluster)
        if placing:
            self._fit_shared_memory()
        arena = opts.cache_ram + opts.prefetch_bytes if placing else 0
        # Without peers the workers read what the node does not hold and fill the cache themselves
        # (fill_ring.py); half of prefetch_bytes is their rings, the rest room for evicted bytes still in use.
        fill_rings = ring_count(self.num_workers) if placing and self.cluster is None else 0
        fill_bytes = opts.prefetch_bytes // 2 // fill_rings if fill_rings else 0
        layout = Layout(
            samples=len(dataset),
            rows=self.num_workers + 2,
            ring=RING,
            snap_slots=max(self.snap_ring, 1) + self.num_workers,
            arena=arena - fill_bytes * fill_rings,
            fill_rings=fill_rings,
            fill_bytes=fill_bytes,
        )
        self.resources.shared = SharedState(layout)
        if placing:
            disk = DiskTier(opts.cache_disk, opts.cache_disk_bytes) if opts.cache_disk else None
            peers = self.cluster.exchange() if self.cluster is not None else None
            self.resources.prefetcher = Prefetcher(
                self.shared,
                self.source,
                opts.cache_ram,
                opts.prefetch_bytes,
                opts.prefetch_threads or PEER_READ_THREADS,
                disk,
                peers,
            )

    def _reads_in_flight(self, loader) -> int:
        """Storage reads each worker keeps in flight while it reads its batch (batch_reads.py). Sized to
        hide the storage's latency, not to the worker count: a whole batch in one round trip, so a
        batch takes one read's latency however slow the storage (up to READS_IN_FLIGHT), unless
        prefetch_threads says how many reads the node may have in flight in all."""
        if self.options.prefetch_threads is not None:
            return -(-self.options.prefetch_threads // max(1, self.num_workers))
        batch = loader.batch_size or getattr(loader.batch_sampler, "batch_size", None)
        return max(1, min(READS_IN_FLIGHT, batch if isinstance(batch, int) else READS_IN_FLIGHT))

    def _fit_shared_memory(self) -> None:
        """/dev/shm is often small (64 MiB in a default Docker container) and a write beyond it
        is a SIGBUS, not an error: shrink the RAM cache to what is free, with a warning."""
        opts = self.options
        free = shm_free_bytes()  # what other loaders reserved is already taken off
        if free is None:
            return
        free = int(free * SHM_SHARE)
        if opts.cache_ram + opts.prefetch_bytes <= free:
            return
        opts.prefetch_bytes = min(opts.prefetch_bytes, max(free // 2, 1 << 20))
        fitted = max(0, free - opts.prefetch_bytes)
        warnings.warn(
            f"cache_ram: {opts.cache_ram:,} bytes plus prefetch_bytes do not fit in the free space of "
            f"/dev/shm ({free:,} usable bytes); using cache_ram={fitted:,} and prefetch_bytes="
            f"{opts.prefetch_bytes:,}. Enlarge /dev/shm (docker run --shm-size=...) to cache more.",
            RuntimeWarning,
            stacklevel=4,
        )
        opts.cache_ram = fitted

    # --- epochs -------------------------------------------------------------------------------------
    def begin_epoch(self, index_sampler):
        """At the epoch's first draw: restore a resume point, plan, start prefetching.

        Returns the epoch's state and a function to call right after the first draw (or None).
        """
        loader = self.loader_ref()
        generator = loader.generator if loader is not None else None
        after_first_draw, skip = None, 0
        if self.resume is not None:
            point, self.resume = self.resume, None
            after_first_draw = restore(point.start, generator, index_sampler)
            skip = point.batches_done
            elastic, self.elastic = self.elastic, None
            override, longest = elastic if elastic is not None else (None, None)
        else:
            override = longest = None
        start = capture(generator, index_sampler)
        self.epochs_begun += 1
        base = self.epochs_begun * EPOCH_STRIDE
        plan = None
        if self.prefetcher is not None and override is not None:
            batched = type(index_sampler) is BatchSampler
            flat = [i for batch in override for i in batch] if batched else list(override)
            plan = EpochPlan(np.asarray(flat, dtype=np.int64), index_sampler.batch_size if batched else None)
        elif self.prefetcher is not None:
            plan = plan_epoch(
                index_sampler,
                loader_generator=generator,
                new_iterator_each_epoch=not self.persistent,
                horizon_epochs=self.options.horizon_epochs,
            )
        try:
            num_batches = len(index_sampler) if override is None else len(override)
        except TypeError:
            num_batches = None
        pos0 = base
        if plan is not None:
            skip_pos = min(plan.batch_bounds(skip)[0], len(plan.indices))
            pos0 = base - skip_pos
            self.prefetcher.begin_epoch(
                plan.indices[skip_pos:], plan.following, base, self._homes(index_sampler), longest
            )
        elif self.shared is not None:
            self.shared.header[GEN_BASE] = base
            self.shared.header[MODE] = DIRECT
        self.epoch = EpochState(
            start,
            plan,
            pos0,
            skip,
            num_batches,
            yielded=skip,
            expected=plan.indices.tolist() if plan is not None else None,
            override=override,
        )
        return self.epoch, after_first_draw

    def _homes(self, index_sampler):
        """Which samples this rank keeps for its peers (None: no exchange). After a lost rank, the
        survivors regroup here, at an epoch's start (peer_cluster.py)."""
        prefetcher = self.prefetcher
        if self.cluster is None:
            return None
        if prefetcher.peers is None and prefetcher.lost is not None:
            suspects, prefetcher.lost = prefetcher.lost.suspects, None
            prefetcher.rejoin(self.cluster.regroup(suspects))
            outcome = f"exchanging with ranks {self.cluster.members}" if prefetcher.peers else "storage alone"
            log.warning(
                "prescient loader, rank %d: regrouped after a lost rank: %s", self.cluster.me, outcome
            )
        if prefetcher.peers is None:
            return None
        return self.cluster.homes(index_sampler, self.shared.layout.samples)

    def plan_broken(self) -> None:
        """The sampler yielded something the plan did not predict: stop trusting the plan."""
        self.epoch.expected = None
        if self.prefetcher is not None:
            self.prefetcher.begin_epoch(np.empty(0, dtype=np.int64), [], self.epoch.pos0 + EPOCH_STRIDE // 2)
        self.shared.header[MODE] = DIRECT

    def batch_yielded(self, waited: float) -> None:
        self.stall_seconds += waited
        self.batches += 1
        if self.epoch is not None:
            self.epoch.yielded += 1

    # --- resume -------------------------------------------------------------------------------------
    def worker_snapshots(self, in_order: bool) -> dict[int, torch.Tensor]:
        """Each worker's RNG state where a resumed run's worker of the same id must start."""
        return worker_snapshots(self.epoch, self.shared, self.snap_ring, self.num_workers, in_order)

    def close(self) -> None:
        self._finalizer()
