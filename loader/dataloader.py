"""`loader.DataLoader`: torch's DataLoader, same arguments and batches, plus a cache that
knows the future.

What it inherits from torch and what it owns: the class subclasses the public
`torch.utils.data.DataLoader` for its constructor (the same arguments, defaults and errors for
the same misuse), its attributes and `len()`. It owns its iterators (iterator.py,
multiprocess_iterator.py) and its worker loop (worker_loop.py) rather than subclassing torch's
private iterators, so that nothing here depends on how torch arranges their attributes. The
samplers and `default_collate` / `default_convert` are torch's public ones. The epoch's index
sampler is observed (planned at its first draw; indices go to the workers as Tickets), the
workers get a view of the dataset that reads planned samples from shared memory, and the time
the caller waits in `__next__` is counted. The protocol between the processes is the note at
the top of clairvoyant.py.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from typing import TypeVar

import torch
import torch.utils.data as tud

from loader.cache.view import FIRST, LAST, NEAR_END, PLANNED_READ, Ticket, TicketBatch
from loader.clairvoyant import Clairvoyant
from loader.options import CacheOptions
from loader.plan.elastic import distributed_state, elastic_batches
from loader.plan.resume import ResumePoint, capture, from_dict, restore, to_dict
from loader.retry import check_retry_options
from loader.sizes import parse_size
from loader.stats import collect_stats, register_loader
from loader.workers.iterator import SingleProcessIterator
from loader.workers.multiprocess_iterator import MultiProcessIterator

T_co = TypeVar("T_co", covariant=True)


class PlannedSampler:
    """torch's index sampler, observed: plans the epoch just before its first draw and hands
    out Tickets (index + plan position) while the sampler agrees with the plan."""

    def __init__(self, inner, engine: Clairvoyant, batched: bool):
        self.inner, self.engine, self.batched = inner, engine, batched

    def __len__(self) -> int:
        return len(self.inner)

    def __iter__(self) -> Iterator:
        return self._epoch()

    def _epoch(self) -> Iterator:
        epoch, after_first_draw = self.engine.begin_epoch(self.inner)
        offset, batch = 0, 0
        for item in self.inner if epoch.override is None else epoch.override:
            if after_first_draw is not None:
                after_first_draw()
                after_first_draw = None
            keys = list(item) if self.batched else [item]
            # recorded before the batch goes out (and for skipped batches too, so that the list is indexed
            # by batch number): state_dict() may need it before the sampler is asked for another batch
            epoch.batch_first.append(offset)
            if batch < epoch.skipped:
                offset, batch = offset + len(keys), batch + 1
                continue
            planned = epoch.expected is not None and keys == epoch.expected[offset : offset + len(keys)]
            if epoch.expected is not None and not planned:
                self.engine.plan_broken()
            if not all(type(k) is int for k in keys):
                yield item  # not dataset indices we can reason about
            else:
                flag = PLANNED_READ if planned else 0
                if epoch.num_batches is None or batch >= epoch.num_batches - self.engine.num_workers:
                    flag |= NEAR_END
                first = epoch.pos0 + offset
                if self.batched:
                    yield TicketBatch(tuple(keys), first, batch, flag)
                else:
                    yield Ticket(keys[0], first, batch, first, flag | FIRST | LAST)
            offset, batch = offset + len(keys), batch + 1
        if after_first_draw is not None:
            after_first_draw()


class DataLoader(tud.DataLoader[T_co]):
    """Drop-in for `torch.utils.data.DataLoader` (same arguments, defaults, errors, batches).

    Extra keyword-only options (all off by default except prefetching):
      cache_ram: bytes (int or "8GiB") of raw samples kept in shared memory across epochs.
      cache_disk / cache_disk_bytes: a local directory and how many bytes it may hold.
      cache_items: the dataset has no read/decode but its items are deterministic: cache them.
      prefetch_bytes: with a cache, bytes read ahead of the workers and not cached (default 64 MiB).
      prefetch_threads: concurrent storage reads in all, shared out among the workers, each reading its
        batch with that many reads in flight when storage is slow; with peer_exchange, also the
        prefetcher's reads of what no peer holds. Default: each worker reads a whole batch at once
        (up to 64 reads in flight), so a batch costs one read's latency; 16 for peer_exchange's reads.
      peer_exchange: under torch.distributed, take samples another rank holds from it (gloo)
        instead of storage; all ranks must build the loader together and iterate whole epochs.
      peer_window: samples per exchange window (default 128).
      peer_timeout: seconds a window waits for the other ranks (default 60); a rank that died or
        stalls that long is logged by rank and the others read its samples from storage instead.
      read_attempts / read_retry_delay: a read() that raises OSError is tried read_attempts times in
        all (default 3), waiting read_retry_delay seconds (default 0.05) and twice as long before each
        further try, then raises SampleError naming the index and path.
      name: label of this loader's Prometheus series.
    Shared memory used: cache_ram + prefetch_bytes when there is a cache, for a dataset that
    implements read(index) -> bytes and decode(raw, index), or with cache_items=True; reserved
    when the loader starts. The protocol between processes is described in clairvoyant.py.
    """

    def __init__(
        self,
        dataset,
        batch_size=1,
        shuffle=None,
        sampler=None,
        batch_sampler=None,
        num_workers=0,
        collate_fn=None,
        pin_memory=False,
        drop_last=False,
        timeout=0,
        worker_init_fn=None,
        multiprocessing_context=None,
        generator=None,
        *,
        prefetch_factor=None,
        persistent_workers=False,
        pin_memory_device="",
        in_order=True,
        cache_ram: int | str | None = None,
        cache_disk: str | None = None,
        cache_disk_bytes: int | str | None = None,
        cache_items: bool = False,
        prefetch_bytes: int | str = "64MiB",
        prefetch_threads: int | None = None,
        peer_exchange: bool = False,
        peer_window: int = 128,
        peer_timeout: float = 60.0,
        read_attempts: int = 3,
        read_retry_delay: float = 0.05,
        name: str | None = None,
    ):
        super().__init__(
            dataset,
            batch_size,
            shuffle,
            sampler,
            batch_sampler,
            num_workers,
            collate_fn,
            pin_memory,
            drop_last,
            timeout,
            worker_init_fn,
            multiprocessing_context,
            generator,
            prefetch_factor=prefetch_factor,
            persistent_workers=persistent_workers,
            pin_memory_device=pin_memory_device,
            in_order=in_order,
        )
        options = _options(
            cache_ram, cache_disk, cache_disk_bytes, cache_items, prefetch_bytes, prefetch_threads
        )
        if not isinstance(peer_window, int) or isinstance(peer_window, bool) or peer_window < 1:
            raise ValueError(f"peer_window: expected an int >= 1 (samples per exchange), got {peer_window!r}")
        options.peer_exchange, options.peer_window = bool(peer_exchange), peer_window
        if (
            isinstance(peer_timeout, bool)
            or not isinstance(peer_timeout, (int, float))
            or not peer_timeout > 0
        ):
            raise ValueError(f"peer_timeout: expected seconds > 0 (a number), got {peer_timeout!r}")
        options.peer_timeout = float(peer_timeout)
        retry = check_retry_options(read_attempts, read_retry_delay)
        options.read_attempts, options.read_retry_delay = retry.attempts, retry.base_delay
        self._engine = Clairvoyant(self, options)
        self.name = name or f"loader{id(self):x}"
        register_loader(self)

    @property
    def _index_sampler(self):
        """What the fetcher is given per step, as in torch: the batch sampler when batching, else the sampler."""
        return self.batch_sampler if self.batch_sampler is not None else self.sampler

    def _planned_sampler(self):
        """The index sampler the iterators draw from: torch's, observed by the plan (map-style)."""
        inner = self._index_sampler
        if not self._engine.map_style:
            return inner
        return PlannedSampler(inner, self._engine, self.batch_sampler is not None)

    def _new_iterator(self):
        engine = self._engine
        dataset = engine.dataset_view(self.dataset)
        rotation, engine.rotation = engine.rotation, 0
        if self.num_workers == 0:
            return SingleProcessIterator(self, dataset, self._planned_sampler(), engine)
        self.check_worker_number_rationality()
        view = engine.view
        fills = view is not None and view.shared is not None and view.shared.fills is not None
        rings = view.ring_sets if fills else None  # the workers fill the cache (fill_ring.py)
        return MultiProcessIterator(self, dataset, self._planned_sampler(), engine, rotation, rings)

    def _iterate(self):
        if self.persistent_workers and self.num_workers > 0:
            if self._iterator is None:
                self._iterator = self._new_iterator()
            else:
                self._iterator.restart(self)
            return self._iterator
        return self._new_iterator()

    def __iter__(self):
        engine = self._engine
        if engine.resume is None:
            return self._iterate()
        if self._iterator is not None:  # persistent workers from before the resume: restart them
            self._iterator.shutdown()
            self._iterator = None
        callers = torch.get_rng_state()
        engine.dataset_view(self.dataset)
        if engine.view is not None and engine.num_workers:
            engine.view.resume_rng = engine.resume.worker_rng
            engine.rotation = engine.resume.batches_done % engine.num_workers
        try:
            iterator = self._iterate()
        finally:
            if engine.view is not None:
                engine.view.resume_rng = None
        if self.generator is None:
            torch.set_rng_state(callers)  # the new iterator's base-seed draw was made in the past run
        return iterator

    # --- beyond torch -------------------------------------------------------------------------
    def stats(self) -> dict:
        """Counters since the loader was made: samples, storage_reads, storage_bytes, ram_hits,
        disk_hits, peer_reads, stall_seconds (time the caller waited in next()), and more."""
        return collect_stats(self._engine)

    def state_dict(self) -> dict:
        """Where this loader is: resume with load_state_dict in a new process (same arguments)."""
        if not self._engine.map_style:
            raise ValueError(
                "state_dict: resuming is supported for map-style datasets; an IterableDataset "
                "owns its own position"
            )
        engine = self._engine
        epoch = engine.epoch
        point = None
        if epoch is not None and epoch.num_batches is not None and epoch.yielded < epoch.num_batches:
            point = ResumePoint(epoch.start, epoch.yielded, engine.worker_snapshots(self.in_order))
        now = capture(self.generator, self._index_sampler)
        state = to_dict(point, now, len(self.dataset), self.num_workers)
        state["distributed"] = distributed_state(self._index_sampler)  # for a resume on another world size
        return state

    def load_state_dict(self, state: dict) -> None:
        """Continue from `state`: the next iteration yields the rest of that epoch."""
        point, now = from_dict(state, len(self.dataset), self.num_workers)
        if point is None:  # between epochs: only the generators move on
            restore(replace(now, global_rng=None, sampler_epoch=None), self.generator, self._index_sampler)
        else:
            elastic = elastic_batches(state, self._index_sampler, point.batches_done)
            if elastic is not None:  # another world size: this rank's share of what no rank has seen
                point = replace(point, batches_done=0, worker_rng={})
            else:
                self._check_batches_done(point.batches_done)
            self._engine.elastic = elastic
        self._engine.resume = point

    def _check_batches_done(self, done: int) -> None:
        try:
            num_batches = len(self._index_sampler)
        except TypeError:  # a sampler without a length: the epoch ends where it ends
            return
        if done > num_batches:
            raise ValueError(
                f"load_state_dict: _num_yielded must be at most the epoch's {num_batches} batches, got "
                f"{done}; resume with the same sampler and batch_size"
            )

    def close(self) -> None:
        """Stop workers and prefetch threads, release shared memory and the disk tier."""
        if self._iterator is not None:
            self._iterator.shutdown()
            self._iterator = None
        self._engine.close()

    def __enter__(self) -> DataLoader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _options(
    cache_ram, cache_disk, cache_disk_bytes, cache_items, prefetch_bytes, prefetch_threads
) -> CacheOptions:
    if cache_disk is not None and not isinstance(cache_disk, str):
        cache_disk = str(cache_disk)
    disk_bytes = parse_size(cache_disk_bytes, "cache_disk_bytes")
    if disk_bytes and cache_disk is None:
        raise ValueError("cache_disk_bytes is set but cache_disk is not: pass cache_disk='/local/dir' too")
    if cache_disk is not None and not disk_bytes:
        raise ValueError("cache_disk needs a budget: pass cache_disk_bytes (e.g. '100GiB')")
    if not isinstance(cache_items, bool):
        raise TypeError(f"cache_items: expected True or False, got {cache_items!r}")
    if prefetch_threads is not None and (
        not isinstance(prefetch_threads, int) or isinstance(prefetch_threads, bool) or prefetch_threads < 1
    ):
        raise ValueError(f"prefetch_threads: expected an int >= 1 or None, got {prefetch_threads!r}")
    staging = parse_size(prefetch_bytes, "prefetch_bytes")
    if staging < 1:
        raise ValueError("prefetch_bytes: must be > 0 (at least the largest sample)")
    return CacheOptions(
        cache_ram=parse_size(cache_ram, "cache_ram") or 0,
        cache_disk=cache_disk,
        cache_disk_bytes=disk_bytes or 0,
        cache_items=cache_items,
        prefetch_bytes=staging,
        prefetch_threads=prefetch_threads,
    )
