"""Byte ranges of the shared-memory data area: first-fit allocation with coalescing.

Main-process bookkeeping only; workers never allocate, they read ranges the table names.
"""

from __future__ import annotations

import bisect
import itertools

ALIGN = 64  # bytes; keeps every sample on its own cache line


class Arena:
    def __init__(self, size: int):
        self.size = size - size % ALIGN
        self._starts: list[int] = [0] if self.size else []  # sorted starts of free blocks
        self._free: dict[int, int] = {0: self.size} if self.size else {}
        self._used: dict[int, int] = {}  # offset -> block bytes
        self.used = 0

    def alloc(self, nbytes: int) -> int | None:
        """Offset of a block of at least `nbytes`, or None when no free block is large enough."""
        need = max(ALIGN, -(-nbytes // ALIGN) * ALIGN)
        for position, start in enumerate(self._starts):
            block = self._free[start]
            if block >= need:
                del self._free[start]
                if block == need:
                    del self._starts[position]
                else:
                    self._starts[position] = start + need
                    self._free[start + need] = block - need
                self._used[start] = need
                self.used += need
                return start
        return None

    def alloc_run(self, sizes: list[int]) -> list[int] | None:
        """Offsets of one block per size, carved in a row from the first free block that holds them
        all (one search for a whole batch); None when no free block is that large. Each block is
        freed on its own later, as if alloc had made it."""
        if not sizes:
            return []
        needs = [max(ALIGN, -(-n // ALIGN) * ALIGN) for n in sizes]
        total = sum(needs)
        for position, start in enumerate(self._starts):
            block = self._free[start]
            if block >= total:
                del self._free[start]
                if block == total:
                    del self._starts[position]
                else:
                    self._starts[position] = start + total
                    self._free[start + total] = block - total
                offsets = list(itertools.accumulate(needs[:-1], initial=start))
                self._used.update(zip(offsets, needs))
                self.used += total
                return offsets
        return None

    def free(self, offset: int) -> None:
        size = self._used.pop(offset)
        self.used -= size
        position = bisect.bisect_left(self._starts, offset)
        start, end = offset, offset + size
        if position < len(self._starts) and self._starts[position] == end:  # merge the next block
            end += self._free.pop(end)
            del self._starts[position]
        if position > 0:
            before = self._starts[position - 1]
            if before + self._free[before] == start:  # merge the previous block
                self._free[before] += end - start
                return
        self._starts.insert(position, start)
        self._free[start] = end - start
