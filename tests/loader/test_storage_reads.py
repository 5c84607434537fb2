"""Storage reads, counted by the storage itself (an independent oracle), against what a
clairvoyant cache can do: one read per needed sample in epoch 1, none afterwards when the
cache holds the data, and no more than Belady's optimum with a cache of 30%."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
import torch.utils.data as tud
from torch.utils.data import DistributedSampler

from loader import DataLoader
from loader.cache.batch_reads import FAST_READ_SECONDS, BatchReader
from tests.loader.conftest import SAMPLE_BYTES, CountingFiles, noisy_decode, same, shuffled, write_files


def epochs_of_reads(dl, dataset, epochs: int) -> list[np.ndarray]:
    """Per-index storage reads made during each epoch."""
    out, before = [], dataset.read_counts()
    for epoch in range(epochs):
        if isinstance(dl.sampler, DistributedSampler):
            dl.sampler.set_epoch(epoch)
        for _ in dl:
            pass
        now = dataset.read_counts()
        out.append(now - before)
        before = now
    return out


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("cache_ram", [None, "1MiB"])
def test_epoch_one_reads_each_needed_sample_once(counting, workers, cache_ram):
    dataset = counting(60)
    sampler = DistributedSampler(dataset, num_replicas=3, rank=1, seed=4)
    needed = set(sampler)
    dl = DataLoader(dataset, batch_size=4, sampler=sampler, num_workers=workers, cache_ram=cache_ram)
    (reads,) = epochs_of_reads(dl, dataset, 1)
    dl.close()
    assert all(reads[i] == 1 for i in needed), "a needed sample was read more than once, or not at all"
    assert reads.sum() == len(needed), "a sample this rank does not need was read"


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("shuffle", ["generator", "global"])
def test_cache_holding_the_data_reads_nothing_after_epoch_one(counting, workers, shuffle):
    dataset = counting(60)
    generator = torch.Generator().manual_seed(1) if shuffle == "generator" else None
    dl = DataLoader(
        dataset,
        batch_size=5,
        shuffle=True,
        generator=generator,
        num_workers=workers,
        persistent_workers=workers > 0,
        cache_ram=60 * SAMPLE_BYTES,
    )
    reads = epochs_of_reads(dl, dataset, 3)
    stats = dl.stats()
    dl.close()
    assert reads[0].tolist() == [1] * 60
    assert reads[1].sum() == 0 and reads[2].sum() == 0
    assert stats["storage_reads"] == 60 and stats["ram_hits"] == 120 and stats["samples"] == 180


def seed_all(seed: int) -> None:
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed)


class Understated(CountingFiles):
    """Files of 256 bytes whose nbytes() says 64: the loader's estimate of what fits is wrong."""

    def nbytes(self, index: int) -> int:
        return SAMPLE_BYTES


@pytest.mark.parametrize("workers", [0, 2])
def test_a_cache_smaller_than_estimated_keeps_what_fits_and_batches_stay_torchs(tmp_path, workers):
    n, size = 60, 4 * SAMPLE_BYTES
    dataset = Understated(write_files(tmp_path / "data", n, size=lambda i: size), decode=noisy_decode)
    capacity = n * SAMPLE_BYTES  # holds a quarter of the data, but looks like all of it
    args = dict(batch_size=4, shuffle=True, num_workers=workers, persistent_workers=workers > 0)
    ours = DataLoader(dataset, generator=torch.Generator().manual_seed(3), cache_ram=capacity, **args)
    theirs = tud.DataLoader(dataset, generator=torch.Generator().manual_seed(3), **args)
    seed_all(0)  # decode draws from the main process's RNGs when there are no workers
    expected = [list(theirs) for _ in range(3)]
    before = dataset.read_counts()
    seed_all(0)
    got, reads, peaks = [], [], []
    for _ in range(3):
        got.append(list(ours))
        now = dataset.read_counts()
        reads.append(int((now - before).sum()))
        before = now
        peaks.append(ours.stats()["cache_ram_peak_bytes"])
    stats = ours.stats()
    ours.close()
    assert same(got, expected), "batches differ from torch's"
    assert reads[0] == n
    assert reads[1] < n and stats["ram_hits"] >= n - reads[1]  # what epoch 1 kept was served from RAM
    assert max(peaks) <= capacity, "the cache went over its budget"


def farthest_in_future(stream: list[int], capacity: int, epoch_len: int) -> list[int]:
    """Textbook Belady with bypass, written plainly: misses per epoch."""
    cache: set[int] = set()
    misses = [0] * (len(stream) // epoch_len)

    def next_use(item: int, after: int) -> int:
        for q in range(after + 1, len(stream)):
            if stream[q] == item:
                return q
        return len(stream) + 1

    for p, item in enumerate(stream):
        if item in cache:
            continue
        misses[p // epoch_len] += 1
        if len(cache) < capacity:
            cache.add(item)
            continue
        farthest = max(cache, key=lambda c: next_use(c, p))
        if next_use(farthest, p) > next_use(item, p):
            cache.remove(farthest)
            cache.add(item)
    return misses


@pytest.mark.parametrize("workers", [0, 2])
def test_thirty_percent_cache_reads_no_more_than_the_optimum(counting, workers):
    n, epochs, capacity = 60, 4, 18  # 18 of 60 samples: 30 %
    dataset = counting(n)
    dl = shuffled(
        dataset,
        4,
        seed=21,
        num_workers=workers,
        cache_ram=capacity * SAMPLE_BYTES,
        prefetch_bytes=8 * SAMPLE_BYTES,
    )
    reads = [int(r.sum()) for r in epochs_of_reads(dl, dataset, epochs)]
    peak = dl.stats()["cache_ram_peak_bytes"]
    dl.close()
    # The order torch would read in, from torch's own loader with the same seed.
    order = tud.DataLoader(range(n), batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(21))
    stream = [int(i) for _ in range(epochs) for batch in order for i in batch]
    optimum = farthest_in_future(stream, capacity, n)
    print(f"storage reads per epoch: {reads}; Belady optimum: {optimum}")
    assert reads[0] == n
    assert all(r <= o for r, o in zip(reads, optimum)), (reads, optimum)
    assert reads[1] < n  # the cache did save reads
    assert peak <= capacity * SAMPLE_BYTES


class SlowStorage(tud.Dataset):
    """Each read waits `latency` seconds (a network file system); counts the most reads in flight."""

    def __init__(self, latency: float):
        import multiprocessing

        self.latency = latency
        self.state = multiprocessing.Array("q", 2)  # reads in flight now, most ever

    def __len__(self):
        return 48

    def read(self, index):
        import time

        with self.state.get_lock():
            self.state[0] += 1
            self.state[1] = max(self.state[1], self.state[0])
        time.sleep(self.latency)
        with self.state.get_lock():
            self.state[0] -= 1
        return bytes([index]) * 16

    def decode(self, raw, index):
        return torch.tensor(list(raw[:4])) + torch.rand(1)  # draws from the worker's RNG, in order

    def __getitem__(self, index):
        return self.decode(self.read(index), index)


@pytest.mark.parametrize("latency, threads, in_flight", [(0.02, 4, 4), (0.02, None, 8), (0.0, 4, None)])
def test_a_worker_reads_its_batch_with_reads_in_flight(latency, threads, in_flight):
    """Without a cache a worker reads its batch itself, on slow storage several reads at once (the
    threads given to it; by default the whole batch of 8 at once); batches equal torch's, on slow
    and on fast storage."""

    def batches(dl):
        torch.manual_seed(3)
        return [list(dl) for _ in range(2)]

    theirs = batches(
        tud.DataLoader(
            SlowStorage(latency), batch_size=8, shuffle=True, num_workers=1, persistent_workers=True
        )
    )
    storage = SlowStorage(latency)
    dl = DataLoader(
        storage, batch_size=8, shuffle=True, num_workers=1, persistent_workers=True, prefetch_threads=threads
    )
    torch.manual_seed(3)
    ours = [list(dl)]
    storage.state[1] = 0
    ours.append(list(dl))
    dl.close()
    assert all(torch.equal(a, b) for x, y in zip(theirs, ours) for a, b in zip(x, y))
    assert [len(epoch) for epoch in ours] == [len(epoch) for epoch in theirs] == [6, 6]
    assert in_flight is None or storage.state[1] == in_flight


def test_fast_reads_stay_in_the_calling_thread():
    """A read faster than a thread hand-off is made in the worker's own thread, in order."""
    import threading

    reader = BatchReader(4)
    threads = []

    def read(index):
        threads.append(threading.current_thread())
        return bytes([index])

    for _ in range(10):
        threads.clear()
        assert reader.read_all(read, list(range(8))) == [bytes([i]) for i in range(8)]
    assert threads == [threading.current_thread()] * 8 and reader.average < FAST_READ_SECONDS
