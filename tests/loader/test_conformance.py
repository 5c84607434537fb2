"""The conformance matrix: torch's own DataLoader is the oracle. Same dataset, same seeds,
every batch and every RNG state (global, generator, and the workers' random augmentation
seen through the batches) must be equal, whatever the cache configuration."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
import torch.utils.data as tud
from torch.utils.data import (
    BatchSampler,
    DistributedSampler,
    RandomSampler,
    SubsetRandomSampler,
    WeightedRandomSampler,
)

from loader import DataLoader, FileDataset
from tests.loader.conftest import noisy_decode, same

CASES = {
    "sequential": lambda ds, g: dict(batch_size=4),
    "sequential_drop_last": lambda ds, g: dict(batch_size=4, drop_last=True),
    "random_generator": lambda ds, g: dict(batch_size=4, shuffle=True, generator=g),
    "random_global": lambda ds, g: dict(batch_size=4, shuffle=True),
    "random_replacement": lambda ds, g: dict(
        batch_size=4, sampler=RandomSampler(ds, replacement=True, num_samples=50, generator=g)
    ),
    "random_more_than_len": lambda ds, g: dict(batch_size=6, sampler=RandomSampler(ds, num_samples=70)),
    "distributed_rank0": lambda ds, g: dict(batch_size=4, sampler=DistributedSampler(ds, 4, 0, seed=3)),
    "distributed_rank3_drop_last": lambda ds, g: dict(
        batch_size=4, drop_last=True, sampler=DistributedSampler(ds, 4, 3, seed=3, drop_last=True)
    ),
    "distributed_no_shuffle": lambda ds, g: dict(
        batch_size=3, sampler=DistributedSampler(ds, 2, 1, shuffle=False)
    ),
    "batch_sampler": lambda ds, g: dict(batch_sampler=BatchSampler(RandomSampler(ds, generator=g), 5, True)),
    "no_batching": lambda ds, g: dict(batch_size=None, shuffle=True, generator=g),
    "subset_random_global": lambda ds, g: dict(batch_size=4, sampler=SubsetRandomSampler(range(0, 45, 2))),
    "weighted_generator": lambda ds, g: dict(
        batch_size=4, sampler=WeightedRandomSampler([1.0 + i % 5 for i in range(45)], 30, generator=g)
    ),
}


def reseed_numpy(worker_id: int) -> None:
    """A typical worker_init_fn: derive numpy's seed from torch's per-worker seed."""
    np.random.seed((torch.initial_seed() + 17 * worker_id) % 2**32)


WORKERS = {
    "w0": dict(num_workers=0),
    "w2": dict(num_workers=2, worker_init_fn=reseed_numpy, prefetch_factor=3),
    "w2_persistent": dict(num_workers=2, persistent_workers=True),
}
# Cache configurations rotate through the matrix: everything cached, a cache smaller than
# the data (Belady evictions every epoch), a tiny staging area, the disk tier, and none.
CACHES = [
    dict(cache_ram="1MiB"),
    dict(cache_ram=10 * 64),
    dict(cache_ram=2 * 64, prefetch_bytes=200),
    dict(cache_ram=5 * 64, cache_disk_bytes=12 * 64),
    dict(),  # no cache: the workers read their batches themselves
]


def run(loader_cls, files, case, workers, epochs=2, breaks=None, **extra):
    """Batches and RNG states after each epoch; a training step draws from the global RNG too."""
    torch.manual_seed(1234)
    random.seed(0)
    np.random.seed(0)
    dataset = FileDataset(files, decode=noisy_decode)
    generator = torch.Generator().manual_seed(99)
    dl = loader_cls(dataset, **CASES[case](dataset, generator), **workers, **extra)
    out = []
    for epoch in range(epochs):
        if isinstance(dl.sampler, DistributedSampler):
            dl.sampler.set_epoch(epoch)
        batches = []
        for step, batch in enumerate(dl):
            batches.append(batch)
            torch.rand(1)
            if breaks and breaks.get(epoch) == step + 1:
                break
        out.append(
            (
                batches,
                torch.get_rng_state(),
                generator.get_state(),
                random.getstate(),
                np.random.get_state()[1].copy(),
            )
        )
    if isinstance(dl, DataLoader):
        out.append(dl.stats())
        dl.close()
    return out


def assert_equal_runs(theirs, ours):
    stats = ours.pop()
    assert len(theirs) == len(ours)
    for epoch, (a, b) in enumerate(zip(theirs, ours)):
        assert len(a[0]) == len(b[0]), f"epoch {epoch}: {len(a[0])} batches from torch, {len(b[0])} from ours"
        for step, (x, y) in enumerate(zip(a[0], b[0])):
            assert same(x, y), f"epoch {epoch} batch {step} differs"
        assert torch.equal(a[1], b[1]), f"epoch {epoch}: global RNG state differs"
        assert torch.equal(a[2], b[2]), f"epoch {epoch}: generator state differs"
        assert a[3] == b[3] and np.array_equal(a[4], b[4]), f"epoch {epoch}: python/numpy RNG differs"
    return stats


@pytest.mark.parametrize("workers", list(WORKERS))
@pytest.mark.parametrize("case", list(CASES))
def test_same_batches_and_rng_as_torch(files, case, workers, tmp_path):
    cache = dict(CACHES[(list(CASES).index(case) + list(WORKERS).index(workers)) % len(CACHES)])
    if "cache_disk_bytes" in cache:
        cache["cache_disk"] = str(tmp_path / "disk")
    theirs = run(tud.DataLoader, files, case, WORKERS[workers])
    ours = run(DataLoader, files, case, WORKERS[workers], **cache)
    stats = assert_equal_runs(theirs, ours)
    delivered = sum(torch.as_tensor(b[1]).numel() for epoch in theirs for b in epoch[0])
    assert stats["samples"] == delivered
    if cache:
        assert stats["direct_reads"] == 0, "every sample should have come through the plan"
    else:
        assert stats["direct_reads"] == stats["storage_reads"] == delivered, "one read a sample, by a worker"


@pytest.mark.parametrize("workers", list(WORKERS))
@pytest.mark.parametrize("case", ["random_generator", "random_global", "distributed_rank0", "no_batching"])
def test_early_break_matches_torch(files, case, workers):
    breaks = {0: 3, 1: 1}
    theirs = run(tud.DataLoader, files, case, WORKERS[workers], epochs=3, breaks=breaks)
    ours = run(DataLoader, files, case, WORKERS[workers], epochs=3, breaks=breaks, cache_ram=12 * 64)
    assert_equal_runs(theirs, ours)


def test_iterable_dataset_behaves_like_torch():
    class Stream(tud.IterableDataset):
        def __iter__(self):
            info = tud.get_worker_info()
            start, step = (0, 1) if info is None else (info.id, info.num_workers)
            for i in range(start, 30, step):
                yield torch.tensor([i]) + torch.rand(1)

    for workers in (0, 2):
        torch.manual_seed(5)
        theirs = list(tud.DataLoader(Stream(), batch_size=4, num_workers=workers))
        state = torch.get_rng_state()
        torch.manual_seed(5)
        ours = list(DataLoader(Stream(), batch_size=4, num_workers=workers, cache_ram="1MiB"))
        assert same(theirs, ours) and torch.equal(state, torch.get_rng_state())


def test_plain_dataset_uncached_like_torch():
    data = tud.TensorDataset(torch.arange(40).float().unsqueeze(1), torch.arange(40))
    torch.manual_seed(2)
    theirs = [list(tud.DataLoader(data, batch_size=6, shuffle=True, num_workers=2)) for _ in range(2)]
    torch.manual_seed(2)
    dl = DataLoader(data, batch_size=6, shuffle=True, num_workers=2, cache_ram="1MiB")
    ours = [list(dl) for _ in range(2)]
    assert same(theirs, ours)
    stats = dl.stats()
    assert stats["samples"] == 80 and stats["storage_reads"] == 0 and stats["cache_ram_bytes"] == 0
    dl.close()


@pytest.mark.slow  # spawned workers
def test_spawned_workers_attach_to_shared_memory(files):
    """With the spawn start method workers get a pickled view and open the segment by name.
    torch's batches and RNG states do not depend on the start method (its workers' seeds come from
    the main process), so torch's forked workers give the oracle (spawning them costs seconds)."""
    workers = dict(num_workers=2, persistent_workers=True)
    theirs = run(tud.DataLoader, files, "random_generator", dict(workers, multiprocessing_context="fork"))
    ours = run(
        DataLoader,
        files,
        "random_generator",
        dict(workers, multiprocessing_context="spawn"),
        cache_ram=20 * 64,
    )
    stats = assert_equal_runs(theirs, ours)
    assert stats["direct_reads"] == 0 and stats["ram_hits"] > 0


def test_generic_subscript_like_torch():
    """`DataLoader[T]` (as in typed training code) is a usable class, as torch's is."""
    outs = []
    for cls in (tud.DataLoader, DataLoader):
        typed = cls[torch.Tensor]
        outs.append(list(typed(list(range(6)), batch_size=4)))
        assert isinstance(typed(list(range(6))), cls)
    assert same(outs[0], outs[1])
