"""Transient storage errors: a read that raises OSError is tried again, with a doubling pause,
before SampleError names the sample; the batches are those torch's DataLoader yields from a
storage that never failed."""

from __future__ import annotations

import multiprocessing
import random
import re
import time

import numpy as np
import pytest
import torch
import torch.utils.data as tud

from loader import DataLoader, FileDataset, SampleError
from tests.loader.conftest import noisy_decode, same


class Flaky(FileDataset):
    """Each read of a sample fails with `error` its first `failures` times, then succeeds;
    counts every attempt and remembers when the attempts on `watched` were made."""

    def __init__(self, root, failures: int, error=ConnectionResetError, watched: int = 0, only=None):
        super().__init__(root, decode=noisy_decode)
        self.failures, self.error, self.watched = failures, error, watched
        self.only = only  # the samples that fail (None: all)
        self.attempts = multiprocessing.Array("q", len(self))
        self.times = multiprocessing.Array("d", 8)

    def read(self, index: int) -> bytes:
        with self.attempts.get_lock():
            self.attempts[index] += 1
            attempt = self.attempts[index]
        if index == self.watched and attempt <= len(self.times):
            self.times[attempt - 1] = time.monotonic()
        if attempt <= self.failures and (self.only is None or index in self.only):
            raise self.error(f"storage hiccup #{attempt}")
        return super().read(index)


def batches(dl, epochs: int = 1):
    torch.manual_seed(3)
    random.seed(3)
    np.random.seed(3)
    return [list(dl) for _ in range(epochs)]


@pytest.mark.parametrize("workers, cache_ram", [(0, None), (2, None), (0, "1MiB")])
def test_reads_that_fail_then_succeed_give_torchs_batches(files, workers, cache_ram):
    flaky = Flaky(files, failures=2)
    dl = DataLoader(
        flaky, batch_size=4, shuffle=True, num_workers=workers, cache_ram=cache_ram, read_retry_delay=0.001
    )
    ours = batches(dl)
    dl.close()
    theirs = batches(
        tud.DataLoader(
            FileDataset(files, decode=noisy_decode), batch_size=4, shuffle=True, num_workers=workers
        )
    )
    assert same(theirs, ours)
    assert list(flaky.attempts) == [3] * len(flaky), "each sample: two failures, then one read that worked"


def test_the_pause_doubles_between_attempts(files):
    flaky = Flaky(files, failures=3, watched=0, only={0})
    dl = DataLoader(flaky, batch_size=4, read_attempts=4, read_retry_delay=0.05)
    list(dl)
    dl.close()
    t = list(flaky.times[:4])
    gaps = [b - a for a, b in zip(t, t[1:])]
    assert gaps[0] >= 0.05 and gaps[1] >= 0.1 and gaps[2] >= 0.2, gaps
    assert flaky.attempts[0] == 4


@pytest.mark.parametrize("workers", [0, 2])
def test_a_read_failing_every_attempt_names_index_path_and_attempts(files, workers):
    flaky = Flaky(files, failures=10)
    dl = DataLoader(flaky, batch_size=4, num_workers=workers, read_attempts=3, read_retry_delay=0.001)
    with pytest.raises(SampleError) as caught:
        list(dl)
    dl.close()
    message = str(caught.value)
    index = int(re.search(r"sample (\d+) \(path", message).group(1))
    assert flaky.path(index) in message and "tried 3 times" in message and "ConnectionResetError" in message
    assert flaky.attempts[index] == 3


def test_errors_that_are_not_storage_errors_are_not_retried(files):
    flaky = Flaky(files, failures=10, error=ValueError)
    dl = DataLoader(flaky, batch_size=4, read_attempts=5, read_retry_delay=0.001)
    with pytest.raises(SampleError, match="ValueError"):
        list(dl)
    dl.close()
    assert max(flaky.attempts) == 1


@pytest.mark.parametrize(
    "option, value",
    [("read_attempts", 0), ("read_attempts", 1.5), ("read_retry_delay", -1), ("peer_timeout", 0)],
)
def test_bad_retry_options_name_the_field(files, option, value):
    with pytest.raises(ValueError, match=option):
        DataLoader(FileDataset(files), **{option: value})
