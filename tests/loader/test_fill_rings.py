"""Fill rings have one writer each: iterators of one loader alive at once (`it = iter(loader)`
makes the new one before the old is dropped) give their workers different rings, a third gets
none and caches nothing, and a ring set is free again once its workers have exited."""

from __future__ import annotations

import gc

import torch
import torch.utils.data as tud

from loader import DataLoader, FileDataset
from loader.cache.fill_ring import SETS, RingSets, ring_count
from tests.loader.conftest import noisy_decode, same, shuffled


def test_ring_sets_have_one_owner_each():
    sets = RingSets()
    claimed = [sets.claim() for _ in range(SETS)]
    assert sorted(claimed) == list(range(SETS)) and sets.claim() is None
    sets.release(claimed[0])
    assert sets.claim() == claimed[0]
    rings = [r for s in range(SETS) for r in RingSets.rings(s, 3)]
    assert sorted(rings) == list(range(ring_count(3)))  # disjoint, and all of the segment's rings
    assert ring_count(0) == 1  # num_workers=0: the main process's ring


def run(cls, files, **extra):
    """Three iterators alive at once, then whole epochs; a training step draws from the global RNG."""
    torch.manual_seed(0)
    dl = shuffled(FileDataset(files, decode=noisy_decode), 4, seed=5, cls=cls, num_workers=2, **extra)
    old = iter(dl)
    batches = [next(old)]
    new, third = iter(dl), iter(dl)
    rings = (old.fill_rings, new.fill_rings, third.fill_rings) if cls is DataLoader else None
    for it in (new, third, old):
        for batch in it:
            batches.append(batch)
            torch.rand(1)
    del old, new, third, it
    gc.collect()
    owned = list(dl._engine.view.ring_sets.owned) if cls is DataLoader else None
    for _ in range(2):
        batches += list(dl)
    stats = dl.stats() if cls is DataLoader else None
    return batches, rings, owned, stats


def test_live_iterators_write_separate_rings_and_the_cache_stays_right(files):
    theirs, _, _, _ = run(tud.DataLoader, files)
    ours, rings, owned, stats = run(DataLoader, files, cache_ram="1MiB")
    assert same(theirs, ours), "a batch differs from torch's: bytes in the cache were mixed up"
    (old_set, new_set, third) = (r[1] if r else None for r in rings)
    assert {old_set, new_set} == set(range(SETS)) and third is None
    assert owned == [False] * SETS, "ring sets are given back once their workers exited"
    assert stats["ram_hits"] > 0  # the fills reached the cache
