"""Errors: a bad sample names its index and path, a dead worker raises as torch's does,
misuse raises torch's own errors, and a full disk tier only costs speed."""

from __future__ import annotations

import gc
import os
import textwrap

import pytest
import torch
import torch.utils.data as tud

from loader import DataLoader, FileDataset, SampleError
from tests.loader.conftest import write_files


def collect_until_error(dl):
    """Batches before the error, and the first error raised (its traceback dropped, so
    that the iterator and its worker processes go away now).

    When a worker dies, torch's SIGCHLD handler raises its RuntimeError in the main
    thread at whatever line runs then: it can arrive after the loop already failed on
    the broken pipe, while the iterator shuts its workers down. That second raise is the
    same failure and is kept only as a later error."""
    batches, errors = [], []

    def run():
        for batch in dl:
            batches.append(batch)

    try:
        try:
            run()
        except Exception as error:
            error.__traceback__ = None
            errors.append(error)
        gc.collect()
    except RuntimeError as late:
        late.__traceback__ = None
        errors.append(late)
        gc.collect()
    assert errors, "the loader ended without an error"
    return batches, errors[0]


def strict_decode(raw: bytes) -> torch.Tensor:
    if raw[:4] == b"BAD!":
        raise ValueError("not a sample")
    return torch.frombuffer(bytearray(raw[:8]), dtype=torch.uint8)


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("fault", ["missing", "corrupt"])
def test_bad_sample_raises_with_index_and_path(tmp_path, workers, fault):
    root = write_files(tmp_path, 30)
    dataset = FileDataset(root, decode=strict_decode)
    bad = 13
    if fault == "missing":
        os.remove(dataset.path(bad))
    else:
        with open(dataset.path(bad), "wb") as handle:
            handle.write(b"BAD!" + bytes(60))
    theirs, _ = collect_until_error(tud.DataLoader(dataset, batch_size=4, num_workers=workers))
    dl = DataLoader(dataset, batch_size=4, num_workers=workers, cache_ram="1MiB")
    ours, error = collect_until_error(dl)
    dl.close()
    assert isinstance(error, SampleError)
    message = str(error)
    assert f"sample {bad} " in message and dataset.path(bad) in message
    assert ("read failed" if fault == "missing" else "decode failed") in message
    assert len(ours) == len(theirs) == bad // 4
    assert all(torch.equal(a[0], b[0]) for a, b in zip(theirs, ours))


class DiesInWorker(tud.Dataset):
    """Sample 9 kills the worker process that reads it."""

    def __len__(self):
        return 20

    def read(self, index):
        return bytes([index]) * 8

    def decode(self, raw, index):
        if index == 9 and tud.get_worker_info() is not None:
            os._exit(3)
        return torch.tensor(list(raw))

    def __getitem__(self, index):
        return self.decode(self.read(index), index)


def test_dead_worker_raises_like_torch():
    """torch raises RuntimeError('DataLoader worker (pid ...) exited unexpectedly'), or, when
    the worker dies while the main process reads its pipe, ConnectionResetError or EOFError:
    it depends on timing in torch itself, and ours goes through the same machinery."""

    def dead_worker_error(error) -> bool:
        if isinstance(error, (ConnectionResetError, EOFError)):
            return True
        return (
            type(error) is RuntimeError
            and "DataLoader worker (pid" in str(error)
            and "exited unexpectedly" in str(error)
        )

    _, theirs = collect_until_error(tud.DataLoader(DiesInWorker(), batch_size=2, num_workers=2))
    dl = DataLoader(DiesInWorker(), batch_size=2, num_workers=2, cache_ram="1MiB")
    batches, ours = collect_until_error(dl)
    dl.close()
    assert dead_worker_error(theirs) and dead_worker_error(ours), (theirs, ours)
    seen = [int(row[0]) for batch in batches for row in batch]
    assert seen == list(range(len(seen))) and 9 not in seen  # in order, nothing twice, nothing after


MISUSE = [
    dict(batch_size=0),
    dict(shuffle=True, sampler=tud.SequentialSampler(range(10))),
    dict(batch_sampler=tud.BatchSampler(range(10), 2, False), batch_size=3),
    dict(batch_sampler=tud.BatchSampler(range(10), 2, False), drop_last=True),
    dict(num_workers=-1),
    dict(timeout=-1),
    dict(prefetch_factor=2),
    dict(num_workers=1, prefetch_factor=-1),
    dict(persistent_workers=True),
    dict(batch_size=None, drop_last=True),
    dict(num_workers=1, multiprocessing_context="bogus"),
    dict(multiprocessing_context="spawn"),
]


@pytest.mark.parametrize("kwargs", MISUSE, ids=[",".join(k) for k in MISUSE])
def test_misuse_raises_torchs_error(kwargs):
    data = list(range(10))
    with pytest.raises(Exception) as theirs:
        tud.DataLoader(data, **kwargs)
    with pytest.raises(Exception) as ours:
        DataLoader(data, **kwargs)
    assert type(ours.value) is type(theirs.value) and str(ours.value) == str(theirs.value)


def test_iterable_misuse_and_frozen_attributes_like_torch():
    class Stream(tud.IterableDataset):
        def __iter__(self):
            return iter(range(4))

    for kwargs in (dict(shuffle=True), dict(sampler=range(3)), dict(batch_sampler=[[0]])):
        with pytest.raises(ValueError) as theirs:
            tud.DataLoader(Stream(), **kwargs)
        with pytest.raises(ValueError) as ours:
            DataLoader(Stream(), **kwargs)
        assert str(ours.value) == str(theirs.value)
    dl = DataLoader(list(range(4)))
    with pytest.raises(ValueError, match="batch_size attribute should not be set after DataLoader"):
        dl.batch_size = 2


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(cache_ram="lots"), "cache_ram"),
        (dict(cache_ram=-1), "cache_ram"),
        (dict(cache_disk="/tmp/x"), "cache_disk_bytes"),
        (dict(cache_disk_bytes="1GiB"), "cache_disk"),
        (dict(prefetch_threads=0), "prefetch_threads"),
        (dict(prefetch_bytes=0), "prefetch_bytes"),
        (dict(cache_items="yes"), "cache_items"),
    ],
)
def test_cache_options_are_checked_by_name(kwargs, field):
    with pytest.raises((ValueError, TypeError), match=field):
        DataLoader(list(range(4)), **kwargs)


FULL_DISK_SCRIPT = textwrap.dedent("""
    import resource, signal, sys, torch, torch.utils.data as tud
    from loader import DataLoader, FileDataset
    root, disk = sys.argv[1], sys.argv[2]
    decode = lambda raw: torch.frombuffer(bytearray(raw[:8]), dtype=torch.uint8)
    def epochs(dl):
        torch.manual_seed(0)
        out = []
        for epoch in range(3):
            for step, batch in enumerate(dl):
                out.append(batch)
                if epoch == 0 and step == 1 and isinstance(dl, DataLoader):
                    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
                    resource.setrlimit(resource.RLIMIT_FSIZE, (10, 10))   # the disk is now 'full'
        return out
    dataset = FileDataset(root, decode=decode)
    theirs = epochs(tud.DataLoader(dataset, batch_size=4, shuffle=True))
    dl = DataLoader(dataset, batch_size=4, shuffle=True, cache_ram=6 * 64, cache_disk=disk,
                    cache_disk_bytes="1MiB", prefetch_bytes=4 * 64)
    ours = epochs(dl)
    same = len(theirs) == len(ours) and all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
                                            for a, b in zip(theirs, ours))
    stats = dl.stats()
    print("SAME", same, "DISK_ON", stats["disk_tier_enabled"], "READS", stats["storage_reads"])
""")


@pytest.mark.slow  # a training program, a process of its own (forked by zygote.py)
def test_full_disk_tier_degrades_to_ram_with_a_warning(tmp_path, programs):
    root = write_files(tmp_path / "data", 40)
    program = programs.start(FULL_DISK_SCRIPT, root, str(tmp_path / "disk"))
    try:
        stdout, stderr = program.communicate(timeout=120)
    finally:
        program.close()
    assert program.returncode == 0, stderr
    assert "SAME True DISK_ON False" in stdout, stdout + stderr
    assert "cache_disk: writing a sample to" in stderr and "RAM cache only" in stderr
