"""The worker processes' side of torch's contract, against torch's own DataLoader on the same
input: a worker killed by a signal, errors in worker_init_fn and unusual exceptions, the
worker info's dataset, IterableDataset copies, multiprocessing contexts, prefetch_factor,
and the torch internals the loader relies on (so a torch upgrade that moves them fails here)."""

from __future__ import annotations

import multiprocessing
import os
import re
import signal
import threading
import time
import warnings

import pytest
import torch
import torch.utils.data as tud

from loader import DataLoader
from tests.loader.conftest import Sleeping, same


def test_torch_internals_the_loader_relies_on_exist():
    import torch.utils.data._utils.worker as torch_worker

    from loader.workers.loop import set_worker_info

    assert hasattr(torch_worker, "_worker_info") and torch_worker._worker_info is None
    try:
        set_worker_info(id=1, num_workers=3, seed=7, dataset="d")
        info = tud.get_worker_info()
        assert (info.id, info.num_workers, info.seed, info.dataset) == (1, 3, 7, "d")
    finally:
        torch_worker._worker_info = None
    assert hasattr(tud.DataLoader(range(3)), "_IterableDataset_len_called")


def _pids(it) -> list[int]:
    return [
        w.pid for w in (it._workers if isinstance(it, tud.dataloader._BaseDataLoaderIter) else it.workers)
    ]


def test_worker_killed_by_a_signal_is_reported_as_torch_reports_it():
    def failure(cls):
        it = iter(cls(Sleeping(40, 0.05), batch_size=2, num_workers=2))
        next(it)
        pid = _pids(it)[0]
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(RuntimeError) as caught:
            for _ in it:
                pass
        del it
        error = caught.value
        return str(error).replace(str(pid), "PID"), str(error.__cause__).replace(str(pid), "PID")

    theirs, ours = failure(tud.DataLoader), failure(DataLoader)
    assert ours == theirs
    assert ours == (
        "DataLoader worker (pid(s) PID) exited unexpectedly",
        "DataLoader worker (pid PID) is killed by signal: Killed. ",
    )


class NeedsTwoArgs(Exception):
    def __init__(self, a, b):
        super().__init__(a, b)


class Raises(tud.Dataset):
    def __init__(self, error):
        self.error = error

    def __len__(self):
        return 6

    def __getitem__(self, index):
        if index == 3:
            raise self.error
        return index


def failing_init(worker_id):
    raise ValueError(f"worker {worker_id} cannot start")


@pytest.mark.parametrize(
    "make",
    [
        lambda cls: cls(Raises(NeedsTwoArgs(1, 2)), batch_size=2, num_workers=2),
        lambda cls: cls(Raises(StopIteration()), batch_size=2, num_workers=1),
        lambda cls: cls(list(range(6)), batch_size=2, num_workers=2, worker_init_fn=failing_init),
    ],
    ids=["unconstructible", "stop_iteration_in_map_dataset", "worker_init_fn"],
)
def test_unusual_worker_errors_like_torch(make):
    def outcome(cls):
        batches = []
        try:
            for batch in make(cls):
                batches.append(batch)
        except Exception as error:
            lines = str(error).splitlines()
            return type(error), lines[0], lines[-1], batches
        return None, "", "", batches  # a StopIteration from a worker ends the epoch, in torch too

    theirs, ours = outcome(tud.DataLoader), outcome(DataLoader)
    assert ours[:3] == theirs[:3] and same(ours[3], theirs[3])
    if ours[0] is not None:
        assert ours[1].startswith("Caught ") and "in DataLoader worker process" in ours[1]


class Offsets(tud.Dataset):
    """A dataset a worker_init_fn configures through get_worker_info().dataset; with read/decode
    the loader caches its bytes, and the worker must still see the user's dataset object."""

    offset = 0

    def __len__(self):
        return 12

    def read(self, index):
        return bytes([index])

    def decode(self, raw, index):
        return torch.tensor([raw[0] + self.offset, tud.get_worker_info().id])

    def __getitem__(self, index):
        return self.decode(self.read(index), index)


def configure(worker_id):
    info = tud.get_worker_info()
    assert type(info.dataset) is Offsets, type(info.dataset)
    info.dataset.offset = 100 * (worker_id + 1)


@pytest.mark.parametrize("cache", [{}, {"cache_ram": "1MiB"}])
def test_worker_info_dataset_is_the_workers_copy_of_the_users_dataset(cache):
    def run(cls, **extra):
        dl = cls(Offsets(), batch_size=3, num_workers=2, worker_init_fn=configure, **extra)
        return [list(dl) for _ in range(2)]

    theirs, ours = run(tud.DataLoader), run(DataLoader, **cache)
    assert same(theirs, ours)
    assert Offsets.offset == 0  # the main process's dataset is untouched


class Counts(tud.IterableDataset):
    """Unsharded: every worker yields the whole stream, as with torch (the user must shard)."""

    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __iter__(self):
        info = tud.get_worker_info()
        extra = 0 if info is None else info.id * 3  # workers of unequal lengths
        return iter(torch.arange(self.n + extra) + torch.rand(1))


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(batch_size=4, num_workers=2),
        dict(batch_size=4, num_workers=2, drop_last=True, persistent_workers=True),
        dict(batch_size=None, num_workers=2),
        dict(batch_size=3, num_workers=0),
    ],
)
def test_iterable_dataset_copies_and_length_warning_like_torch(kwargs):
    def run(cls):
        torch.manual_seed(3)
        dl = cls(Counts(10), **kwargs)
        len(dl)  # torch warns when more than len() batches come
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            epochs = [list(dl) for _ in range(2)]
        return epochs, sorted({re.sub(r"at 0x[0-9a-f]+", "", str(w.message)) for w in caught})

    (theirs, warned_theirs), (ours, warned_ours) = run(tud.DataLoader), run(DataLoader)
    assert same(theirs, ours)
    assert warned_theirs == warned_ours


class Noisy(tud.Dataset):
    def __len__(self):
        return 20

    def __getitem__(self, index):
        return torch.tensor([float(index)]) + torch.rand(1)


def noisy_batches(cls, context) -> list:
    torch.manual_seed(9)
    return list(cls(Noisy(), batch_size=4, shuffle=True, num_workers=2, multiprocessing_context=context))


@pytest.fixture(scope="module")
def torchs_noisy_batches() -> list:
    """torch's batches, the oracle for every start method: its workers' seeds (torch, random and
    numpy) and the batch order come from the main process, whichever method started the workers.
    (Were that not so, ours would differ from these under some method: the test fails, never passes.)"""
    return noisy_batches(tud.DataLoader, "fork")


@pytest.mark.slow  # spawn and forkserver workers
@pytest.mark.parametrize("context", ["fork", "spawn", "forkserver"])
def test_multiprocessing_contexts_like_torch(context, torchs_noisy_batches):
    if context == "forkserver":  # the server imports torch once, not each worker (unless it already runs)
        multiprocessing.set_forkserver_preload(["torch", "loader.workers.loop"])
    assert same(torchs_noisy_batches, noisy_batches(DataLoader, context))


def test_a_context_object_is_taken_like_its_name():
    """A context object (here the one "spawn" names) becomes the loader's context, as in torch; from
    there on the iterator's code path is the one test_multiprocessing_contexts_like_torch runs."""
    spawn = multiprocessing.get_context("spawn")
    for context in ("spawn", spawn):
        theirs, ours = (
            cls(Noisy(), num_workers=2, multiprocessing_context=context)
            for cls in (tud.DataLoader, DataLoader)
        )
        assert theirs.multiprocessing_context is ours.multiprocessing_context is spawn


class Logged(tud.Dataset):
    def __init__(self):
        self.fetched = multiprocessing.Value("i", 0)

    def __len__(self):
        return 64

    def __getitem__(self, index):
        with self.fetched.get_lock():
            self.fetched.value += 1
        return index


@pytest.mark.parametrize("prefetch_factor", [1, 3])
def test_prefetch_factor_bounds_the_batches_in_flight_like_torch(prefetch_factor):
    def fetched_ahead(cls):
        dataset = Logged()
        it = iter(cls(dataset, batch_size=2, num_workers=2, prefetch_factor=prefetch_factor))
        next(it)
        time.sleep(0.5)  # the workers fetch all they were sent
        fetched = dataset.fetched.value
        del it
        return fetched

    theirs, ours = fetched_ahead(tud.DataLoader), fetched_ahead(DataLoader)
    assert ours == theirs == 2 * (prefetch_factor * 2 + 1)


def test_pin_memory_device_warnings_like_torch():
    def warned(cls, **kwargs):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            batches = list(cls(list(range(4)), batch_size=2, **kwargs))
        return batches, sorted(re.sub(r"\s+", " ", str(w.message)) for w in caught)

    for kwargs in (dict(pin_memory=True, pin_memory_device="cuda"), dict(pin_memory_device="cuda")):
        assert same(warned(tud.DataLoader, **kwargs), warned(DataLoader, **kwargs))


def test_unpicklable_worker_arguments_fail_like_torch():
    def failure(cls):
        dl = cls(
            list(range(8)),
            batch_size=2,
            num_workers=2,
            multiprocessing_context="spawn",
            collate_fn=lambda b: b,
        )
        with warnings.catch_warnings(record=True) as caught, pytest.raises(Exception) as raised:
            warnings.simplefilter("always")
            iter(dl)
        return type(raised.value), sorted(str(w.message) for w in caught)

    theirs, ours = failure(tud.DataLoader), failure(DataLoader)
    assert ours == theirs and "pickle" in " ".join(ours[1])


def test_installed_torch_is_in_the_range_pyproject_declares():
    """The range CI tests is the installed release: the loader's worker semantics are those of it."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    with open(os.path.join(root, "pyproject.toml")) as handle:
        low, high = re.search(r'"torch>=([\d.]+),<([\d.]+)"', handle.read()).groups()

    def release(text: str) -> tuple[int, int]:
        major, minor = re.match(r"(\d+)\.(\d+)", text).groups()
        return int(major), int(minor)

    assert release(low) <= release(torch.__version__) < release(high)


def test_a_worker_that_dies_wakes_a_waiting_next_at_once(monkeypatch):
    """torch's SIGCHLD handler raises the moment a worker dies; with its status poll made 30 s
    long, the loader must still raise within seconds while next() waits (worker_watch.py)."""
    from loader.workers import multiprocess_iterator

    monkeypatch.setattr(multiprocess_iterator, "STATUS_SECONDS", 30.0)
    for cls in (tud.DataLoader, DataLoader):
        it = iter(cls(Sleeping(8, 3), batch_size=2, num_workers=2))
        pid = _pids(it)[0]
        started = time.monotonic()
        killer = threading.Timer(0.3, os.kill, (pid, signal.SIGKILL))
        killer.start()
        with pytest.raises(RuntimeError, match=rf"DataLoader worker \(pid\(s\) {pid}\) exited unexpectedly"):
            next(it)
        killer.join()
        # long before the 30 s poll would notice (on a busy CI machine the wake-up itself took up to 6 s)
        assert time.monotonic() - started < 12, cls
        del it
