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
    """The set of kept samples and their next use; `capacity` and sizes in bytes."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.used = 0  # bytes of kept samples
        self.peak = 0  # the most bytes ever kept
        self.kept: dict[int, tuple[int, int]] = {}  # index -> (size, next use)
        self._heap: list[tuple[int, int]] = []  # (-next use, index); stale rows skipped lazily

    def __contains__(self, index: int) -> bool:
        return index in self.kept

    def __len__(self) -> int:
        return len(self.kept)

    def touch(self, index: int, next_use_at: int) -> None:
        """A kept sample was used; remember when it is needed next."""
        size, _ = self.kept[index]
        self.kept[index] = (size, next_use_at)
        heapq.heappush(self._heap, (-next_use_at, index))

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
                    heapq.heappush(self._heap, (-row[0], row[1]))
                return None
            heapq.heappop(self._heap)
            if can_evict is not None and not can_evict(top[1]):
                vetoed.append(top)
                continue
            victims.append(top)
            freed += self.kept[top[1]][0]
        for row in vetoed:
            heapq.heappush(self._heap, (-row[0], row[1]))
        for _, victim in victims:
            self.remove(victim)
        self.kept[index] = (size, next_use_at)
        self.used += size
        self.peak = max(self.peak, self.used)
        heapq.heappush(self._heap, (-next_use_at, index))
        return [victim for _, victim in victims]

    def remove(self, index: int) -> None:
        size, _ = self.kept.pop(index)
        self.used -= size

    def renumber(self, next_use_of: Callable[[int], int]) -> None:
        """Positions restart with each epoch's plan: recompute every kept sample's next use."""
        self.kept = {i: (size, next_use_of(i)) for i, (size, _) in self.kept.items()}
        self._heap = [(-nu, i) for i, (_, nu) in self.kept.items()]
        heapq.heapify(self._heap)

    def _farthest(self) -> tuple[int, int] | None:
        while self._heap:
            neg, index = self._heap[0]
            row = self.kept.get(index)
            if row is not None and row[1] == -neg:
                return -neg, index
            heapq.heappop(self._heap)
        return None


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
