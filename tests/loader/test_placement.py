"""Belady placement against an exhaustive search for the fewest misses, and the shared
data area's allocator against overlap and leaks."""

from __future__ import annotations

import itertools
import random

import numpy as np
import pytest

from loader.cache.arena import ALIGN, Arena
from loader.plan.placement import optimal_reads


def fewest_misses(stream: list[int], capacity: int) -> int:
    """Dynamic programming over every possible cache content: the true optimum."""
    states = {frozenset(): 0}
    for item in stream:
        after: dict[frozenset, int] = {}
        for content, misses in states.items():
            if item in content:
                options = [(content, misses)]
            else:
                options = [(content, misses + 1)]  # bypass
                if len(content) < capacity:
                    options.append((content | {item}, misses + 1))
                options += [((content - {old}) | {item}, misses + 1) for old in content]
            for state, cost in options:
                if cost < after.get(state, 1 << 30):
                    after[state] = cost
        states = after
    return min(states.values())


@pytest.mark.parametrize("seed", range(12))
def test_belady_reads_equal_the_optimum(seed):
    rng = random.Random(seed)
    items, capacity = rng.randint(3, 7), rng.randint(1, 3)
    epochs = [np.array([rng.randrange(items) for _ in range(rng.randint(4, 12))]) for _ in range(3)]
    reads = optimal_reads(epochs, lambda i: 100, capacity * 100)
    assert sum(reads) == fewest_misses([int(i) for e in epochs for i in e], capacity)


def test_arena_never_overlaps_and_coalesces():
    rng = random.Random(1)
    arena = Arena(64 * 1024)
    live: dict[int, int] = {}
    for _ in range(3000):
        if live and rng.random() < 0.45:
            offset = rng.choice(list(live))
            arena.free(offset)
            del live[offset]
        elif rng.random() < 0.5:
            size = rng.randint(0, 3000)
            offset = arena.alloc(size)
            if offset is not None:
                live[offset] = max(ALIGN, -(-size // ALIGN) * ALIGN)
        else:  # a run of blocks carved at once, each freed on its own later
            sizes = [rng.randint(0, 1500) for _ in range(rng.randint(0, 6))]
            offsets = arena.alloc_run(sizes)
            if offsets is not None:
                assert len(offsets) == len(sizes)
                live.update((o, max(ALIGN, -(-n // ALIGN) * ALIGN)) for o, n in zip(offsets, sizes))
        spans = sorted(live.items())
        assert all(a + n <= b for (a, n), (b, _) in itertools.pairwise(spans))
        assert all(o + n <= arena.size for o, n in spans)
        assert arena.used == sum(live.values())
    for offset in list(live):
        arena.free(offset)
    assert arena.alloc(arena.size) == 0
