"""Batches cross from the workers to the main process through the loader's result rings
(loader/workers/result_rings.py), not torch's descriptor passing: the batches must still be torch's
to the byte, with torch's shapes, strides and views, whatever the caller keeps, and with
what does not fit in a ring sent as torch sends it."""

from __future__ import annotations

import os

import pytest
import torch
import torch.utils.data as tud

from loader import DataLoader
from loader.workers import result_rings
from tests.loader.conftest import same, shm_names


class Tensors(tud.Dataset):
    """Samples of several dtypes and sizes; sample `big` is larger than a small ring."""

    def __init__(self, count: int = 24, width: int = 1024, big: int | None = None):
        self.count, self.width, self.big = count, width, big

    def __len__(self):
        return self.count

    def __getitem__(self, i):
        width = (3 << 18) if i == self.big else self.width
        return {
            "x": torch.arange(width, dtype=torch.float32) * (i + 1),
            "half": torch.full((3,), i, dtype=torch.float16),
            "flag": torch.tensor(i % 2 == 0),
            "label": i,
        }


def views_collate(batch):
    """A caller's collate: views of one storage, non-contiguous strides, and the worker info."""
    x = torch.stack([torch.arange(6.0) + sample for sample in batch]).reshape(len(batch), 2, 3)
    info = tud.get_worker_info()
    return {"x": x, "t": x.transpose(1, 2), "row": x[1:], "worker": info.id if info else None}


def _run(cls, dataset, epochs=2, **kwargs):
    loader = cls(dataset, num_workers=2, shuffle=True, generator=torch.Generator().manual_seed(3), **kwargs)
    batches = [batch for _ in range(epochs) for batch in loader]
    if cls is DataLoader and loader.persistent_workers:  # the batches did come through the rings
        rings = loader._iterator.result_rings
        assert all(rings.words[rings.freed_word(w)] > 0 for w in range(2))
    return batches


def test_views_strides_and_worker_info_are_torchs():
    ours = _run(DataLoader, range(20), batch_size=4, collate_fn=views_collate, persistent_workers=True)
    theirs = _run(tud.DataLoader, range(20), batch_size=4, collate_fn=views_collate, persistent_workers=True)
    assert same(ours, theirs)
    for a, b in zip(ours, theirs):
        for key in ("t", "row"):
            assert a[key].stride() == b[key].stride()
            assert a[key].storage_offset() == b[key].storage_offset()
            # a view of the batch's tensor stays a view of the same storage, as with torch
            assert a[key].untyped_storage().data_ptr() == a["x"].untyped_storage().data_ptr()


def test_kept_batches_stay_intact_while_small_rings_wrap(monkeypatch):
    monkeypatch.setattr(result_rings, "RING_BYTES", result_rings.MIN_RING_BYTES)  # a few batches a ring
    batched = Tensors(count=48, width=16 << 10)  # 256 KiB batches: a ring holds three
    unbatched = Tensors(count=12, width=16 << 10, big=5)  # sample 5 alone outgrows a ring
    before = shm_names(os.getpid())  # an earlier test's iterator may live on in a kept exception
    for dataset, batch_size in ((batched, 4), (unbatched, None)):
        for persistent in (True, False):
            kwargs = {"batch_size": batch_size, "persistent_workers": persistent}
            ours = _run(DataLoader, dataset, **kwargs)  # every batch kept
            assert same(ours, _run(tud.DataLoader, dataset, **kwargs))
    assert not shm_names(os.getpid()) - before  # the rings went with their iterators


def test_default_collate_outside_a_worker_keeps_no_worker_info():
    from loader.workers.result_rings import worker_collate

    assert worker_collate(views_collate) is views_collate  # the caller's collate is untouched
    assert worker_collate(tud.default_collate) is not tud.default_collate


def test_a_batch_that_cannot_be_pickled_is_an_error_not_a_hang():
    """torch's queue feeder prints the pickling error in the worker and the batch never comes
    (the main process waits for it forever, or until `timeout`); here the worker pickles the
    batch itself and the error is raised in the main process with the worker's traceback."""
    loader = DataLoader(range(8), batch_size=4, num_workers=1, collate_fn=lambda batch: lambda: batch)
    with pytest.raises(Exception, match="in DataLoader worker process 0"):
        next(iter(loader))
