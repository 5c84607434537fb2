"""Which samples a node keeps, decided from the plan: Belady's MIN within a byte budget.

On a miss the new sample is kept only if some kept sample is next used later than it;
then the samples used farthest ahead are evicted until it fits. With equal sample sizes
this is the optimal policy (fewest storage reads), so simulating it over the plan gives
the number of reads no cache of that size can beat. Pure bookkeeping: no I/O.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable

import numpy as np

NEVER = np.iinfo(np.int64).max  # "next use": not within the plan's horizon


def next_use(stream: np.ndarray) -> np.ndarray:
    """next_use[p] = the first position q > p with stream[q] == stream[p], else NEVER."""
    n = len(stream)
    order = np.lexsort((np.arange(n), stream))
    result = np.full(n, NEVER, dtype=np.int64)
    same = stream[order[1:]] == stream[order[:-1]]
    result[order[:-1][same]] = order[1:][same]
    return result


def first_use(stream: np.ndarray) -> dict[int, int]:
    """Index -> position of its first occurrence in `stream`."""
    values, positions = np.unique(stream, return_index=True)
    return dict(zip(values.tolist(), positions.tolist()))


class BeladyCache:
    """The set of kept samples and their next use; `capacity` and sizes in bytes.

    Kept per sample as plain ints only (dicts of int to int, heap entries packed into one int):
    tuples or objects that live as long as the cache would be tracked by Python's garbage
    collector, and a growing number of them sets off full collections of the whole process
    (torch's objects included), several microseconds a sample."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.used = 0  # bytes of kept samples
        self.peak = 0  # the most bytes ever kept
        self.size: dict[int, int] = {}  # index -> bytes, for each kept sample
        self.next: dict[int, int] = {}  # index -> next use
        self._heap: list[int] = []  # _entry(next use, index): farthest first; stale ones skipped lazily

    def __contains__(self, index: int) -> bool:
        return index in self.size

    def __len__(self) -> int:
        return len(self.size)

    def touch(self, index: int, next_use_at: int) -> None:
        """A kept sample was used; remember when it is needed next."""
        self.next[index] = next_use_at
        heapq.heappush(self._heap, _entry(next_use_at, index))

    def add_free(self, indices: list[int], sizes: list[int]) -> None:
        """Keep samples that fit in free room, without next uses (a resident epoch, resident.py:
        nothing is evicted until renumber() gives every kept sample its next use again)."""
        self.size.update(zip(indices, sizes))
        self.next.update(dict.fromkeys(indices, NEVER))
        self.used += sum(sizes)
        self.peak = max(self.peak, self.used)

    def offer(
        self, index: int, size: int, next_use_at: int, can_evict: Callable[[int], bool] | None = None
    ) -> list[int] | None:
        """Keep a sample just read? Returns the evicted indices, or None to bypass it.

        A sample with no known next use is kept only in free space (the future beyond the
        plan's horizon may still want it); it is the first to go when room is needed.
        `can_evict` vetoes victims that are still in use (then the next farthest is tried).
        """
        if size > self.capacity or (next_use_at == NEVER and self.used + size > self.capacity):
            return None
        victims: list[tuple[int, int]] = []
        vetoed: list[tuple[int, int]] = []
        freed = 0
        while self.used - freed + size > self.capacity:
            top = self._farthest()
            if top is None or top[0] <= next_use_at:
                for row in victims + vetoed:
                    heapq.heappush(self._heap, _entry(*row))
                return None
            heapq.heappop(self._heap)
            if can_evict is not None and not can_evict(top[1]):
                vetoed.append(top)
                continue
            victims.append(top)
            freed += self.size[top[1]]
        for row in vetoed:
            heapq.heappush(self._heap, _entry(*row))
        for _, victim in victims:
            self.remove(victim)
        self.size[index] = size
        self.next[index] = next_use_at
        self.used += size
        self.peak = max(self.peak, self.used)
        heapq.heappush(self._heap, _entry(next_use_at, index))
        return [victim for _, victim in victims]

    def remove(self, index: int) -> None:
        self.used -= self.size.pop(index)
        del self.next[index]

    def renumber(self, next_use_of: Callable[[int], int]) -> None:
        """Positions restart with each epoch's plan: recompute every kept sample's next use."""
        self.next = {i: next_use_of(i) for i in self.size}
        self._heap = [_entry(nu, i) for i, nu in self.next.items()]
        heapq.heapify(self._heap)

    def farthest_first(self) -> list[int]:
        """The kept samples, the one used farthest ahead first."""
        return sorted(self.next, key=self.next.__getitem__, reverse=True)

    def _farthest(self) -> tuple[int, int] | None:
        while self._heap:
            next_use_at, index = _unpack(self._heap[0])
            if self.next.get(index) == next_use_at:
                return next_use_at, index
            heapq.heappop(self._heap)
        return None


_INDEX_BITS = 40  # sample indices below 2**40


def _entry(next_use_at: int, index: int) -> int:
    """A heap entry as one int: the largest next use sorts first, then the smallest index."""
    return (-next_use_at << _INDEX_BITS) + index


def _unpack(entry: int) -> tuple[int, int]:
    return -(entry >> _INDEX_BITS), entry & ((1 << _INDEX_BITS) - 1)


def optimal_reads(streams: list[np.ndarray], size_of: Callable[[int], int], capacity: int) -> list[int]:
    """Storage reads per epoch when a `capacity`-byte cache follows Belady over these epochs."""
    stream = np.concatenate(streams) if streams else np.empty(0, dtype=np.int64)
    upcoming = next_use(stream)
    cache = BeladyCache(capacity)
    reads, position = [], 0
    for epoch in streams:
        count = 0
        for p in range(position, position + len(epoch)):
            index = int(stream[p])
            if index in cache:
                cache.touch(index, int(upcoming[p]))
            else:
                count += 1
                cache.offer(index, size_of(index), int(upcoming[p]))
        reads.append(count)
        position += len(epoch)
    return reads
