"""The iterator keeps the private attributes of torch's multi-process iterator that code in
the wild reads, with torch's meaning: `_workers` are the live worker processes, gone once
the iterator is exhausted or dropped, and `_shutdown` says so. The first two tests do what
torch's own test/test_dataloader.py does in test_iterable_style_dataset and
test_partial_workers; the last compares each attribute with torch's iterator."""

from __future__ import annotations

import pytest
import torch
import torch.utils.data as tud

from loader import DataLoader

JOIN_TIMEOUT = 60.0
pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create")  # torch's test uses 4 workers


class PerWorkerIterable(tud.IterableDataset):
    """Worker w yields range(sizes[w]): one worker has nothing at all, one ends early."""

    def __init__(self, sizes: list[int]):
        self.sizes = sizes

    def __iter__(self):
        info = tud.get_worker_info()
        return iter(range(self.sizes[info.id if info is not None else 0]))


@pytest.mark.parametrize("batch_size", [None, 7])
@pytest.mark.parametrize("prefetch_factor", [2, 3])
def test_iterable_dataset_workers_exit_cleanly_after_the_epoch(prefetch_factor, batch_size):
    sizes = [0, 4, 20]
    dl = DataLoader(
        PerWorkerIterable(sizes), num_workers=3, batch_size=batch_size, prefetch_factor=prefetch_factor
    )
    it = iter(dl)
    assert it._num_workers == 3 and len(it._workers) == 3
    assert all(w.is_alive() for w in it._workers) and it._shutdown is False
    fetched = sorted(int(x) for batch in it for x in (batch if batch_size else [batch]))
    assert fetched == sorted(i for size in sizes for i in range(size))
    workers = it._workers
    assert it._shutdown is True, "an exhausted non-persistent iterator has shut its workers down"
    del it, dl
    try:
        for w in workers:
            w.join(JOIN_TIMEOUT)
            assert not w.is_alive()
            assert w.exitcode == 0
    finally:
        for w in workers:
            w.terminate()


@pytest.mark.filterwarnings("ignore:'pin_memory' argument is set as true but no accelerator")
@pytest.mark.parametrize("pin_memory", [False, True])
def test_partial_epoch_then_drop_iterator_ends_workers(pin_memory):
    """With pin_memory and an accelerator, the pin thread ends too; without one, torch makes no pin
    thread and neither does the loader (the same case on a machine with a GPU checks the thread)."""
    theirs = iter(tud.DataLoader(torch.arange(100), batch_size=2, num_workers=1, pin_memory=pin_memory))
    it = iter(DataLoader(torch.arange(100), batch_size=2, num_workers=4, pin_memory=pin_memory))
    assert hasattr(it, "_pin_memory_thread") == hasattr(theirs, "_pin_memory_thread")
    del theirs
    workers = it._workers
    pin_thread = it._pin_memory_thread if hasattr(it, "_pin_memory_thread") else None
    assert len(workers) == 4 and (pin_thread is None or pin_thread.is_alive())
    for i, _ in enumerate(it):
        if i == 10:
            break
    assert i == 10 and it._num_yielded == 11
    del it
    for w in workers:
        w.join(JOIN_TIMEOUT)
        assert not w.is_alive(), "subprocess not terminated"
    if pin_thread is not None:
        pin_thread.join(JOIN_TIMEOUT)
        assert not pin_thread.is_alive()


def test_attributes_mean_what_they_mean_in_torch():
    def open_iterator(cls):
        torch.manual_seed(0)
        dl = cls(torch.arange(64), batch_size=4, num_workers=2, prefetch_factor=3, persistent_workers=True)
        it = iter(dl)
        for _ in range(5):
            next(it)
        return dl, it

    (theirs_dl, theirs), (ours_dl, ours) = open_iterator(tud.DataLoader), open_iterator(DataLoader)
    for name in (
        "_num_workers",
        "_shutdown",
        "_num_yielded",
        "_prefetch_factor",
        "_persistent_workers",
        "_timeout",
        "_auto_collation",
        "_drop_last",
        "_pin_memory",
        "_base_seed",
        "_rcvd_idx",
        "_send_idx",
        "_workers_status",
    ):
        assert getattr(ours, name) == getattr(theirs, name), name
    # which results have arrived early is a race in both: only its bound is the same
    assert 0 < ours._tasks_outstanding <= 3 * 2 and 0 < theirs._tasks_outstanding <= 3 * 2
    assert len(ours._workers) == len(theirs._workers) == len(ours._index_queues) == 2
    assert all(w.is_alive() and w.pid for w in ours._workers)
    assert not ours._workers_done_event.is_set()
    assert type(ours._index_sampler) is type(theirs._index_sampler)
    assert ours._dataset is ours_dl.dataset
    ours_dl.close()
    assert ours._shutdown is True and ours._workers_done_event.is_set()
    for w in ours._workers:
        w.join(JOIN_TIMEOUT)
        assert not w.is_alive()
    theirs._shutdown_workers()
    del theirs_dl
