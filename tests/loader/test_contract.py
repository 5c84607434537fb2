"""torch's documented DataLoader contract, item by item, against torch's own DataLoader on the
same input: worker errors, timeout, worker_init_fn and get_worker_info(), pin_memory, a custom
collate_fn and default_convert, in_order=False."""

from __future__ import annotations

import threading
import time
import warnings

import numpy as np
import pytest
import torch
import torch.utils.data as tud

from loader import DataLoader, FileDataset
from tests.loader.conftest import Sleeping, same


def both(make):
    """The same construction with torch's class and ours."""
    return make(tud.DataLoader), make(DataLoader)


def error_of(dl):
    with pytest.raises(Exception) as caught:
        for _ in dl:
            pass
    return caught.value


class FailsAt(tud.Dataset):
    def __len__(self):
        return 12

    def __getitem__(self, index):
        if index == 5:
            raise KeyError("no sample five")
        return torch.tensor([index])


def test_worker_error_is_reraised_with_the_workers_traceback():
    theirs, ours = (error_of(dl) for dl in both(lambda cls: cls(FailsAt(), batch_size=2, num_workers=2)))
    assert type(ours) is type(theirs) is KeyError
    for error in (theirs, ours):
        assert "Caught KeyError in DataLoader worker process" in str(error)
        assert "Original Traceback" in str(error)
        assert "no sample five" in str(error) and "in __getitem__" in str(error)


def test_timeout_raises_torchs_error():
    theirs, ours = (
        error_of(dl) for dl in both(lambda cls: cls(Sleeping(4, 2.5), num_workers=1, timeout=0.5))
    )
    assert type(ours) is type(theirs) is RuntimeError
    assert str(ours) == str(theirs) and "timed out after 0.5 seconds" in str(ours)


class WhoReads(tud.Dataset):
    def __len__(self):
        return 16

    def __getitem__(self, index):
        info = tud.get_worker_info()
        drawn = int(np.random.randint(1 << 30))  # from the numpy seed worker_init_fn set
        return torch.tensor([index, info.id, info.num_workers, info.seed % 2**31, drawn])


def seed_numpy(worker_id):
    np.random.seed((torch.initial_seed() + worker_id) % 2**32)


def test_worker_init_fn_and_get_worker_info_like_torch():
    def run(cls):
        torch.manual_seed(11)
        return list(cls(WhoReads(), batch_size=3, shuffle=True, num_workers=2, worker_init_fn=seed_numpy))

    theirs, ours = run(tud.DataLoader), run(DataLoader)
    assert same(theirs, ours)
    assert {int(b[0, 1]) for b in ours} == {0, 1}


def test_pin_memory_like_torch():
    def run(cls):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            batches = list(cls(list(range(8)), batch_size=4, num_workers=2, pin_memory=True))
        return batches, sorted({str(w.message) for w in caught})

    (theirs, warned_theirs), (ours, warned_ours) = run(tud.DataLoader), run(DataLoader)
    assert same(theirs, ours) and warned_theirs == warned_ours
    assert [b.is_pinned() for b in theirs] == [b.is_pinned() for b in ours]


class Arrays(tud.Dataset):
    def __len__(self):
        return 10

    def __getitem__(self, index):
        return {"x": np.full(3, index, dtype=np.float32), "label": index % 3}


def sum_collate(samples):
    return torch.tensor([float(s["x"].sum()) for s in samples]), [s["label"] for s in samples]


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(batch_size=None),
        dict(batch_size=4, collate_fn=sum_collate),
        dict(batch_size=3, collate_fn=tud.default_convert),
    ],
)
def test_collate_fn_and_default_convert_like_torch(kwargs):
    theirs, ours = (list(dl) for dl in both(lambda cls: cls(Arrays(), num_workers=2, **kwargs)))
    assert same(theirs, ours)


def test_in_order_false_yields_the_same_batches():
    def run(cls):
        return list(
            cls(
                list(range(40)),
                batch_size=4,
                shuffle=True,
                num_workers=2,
                in_order=False,
                generator=torch.Generator().manual_seed(3),
            )
        )

    theirs, ours = run(tud.DataLoader), run(DataLoader)
    key = lambda b: b.tolist()  # noqa: E731
    assert sorted(map(key, theirs)) == sorted(map(key, ours)) and len(ours) == 10


class FirstSlow(tud.Dataset):
    def __len__(self):
        return 24

    def __getitem__(self, index):
        if index == 0:
            time.sleep(1.0)  # worker 0 is stuck on batch 0 while worker 1 keeps delivering
        return index


def test_in_order_false_yields_batches_as_they_come_like_torch():
    def order(cls):
        return [int(b[0]) // 2 for b in cls(FirstSlow(), batch_size=2, num_workers=2, in_order=False)]

    theirs, ours = order(tud.DataLoader), order(DataLoader)
    assert ours == theirs and ours[0] != 0 and sorted(ours) == list(range(12))


class FakePinnable:
    """Stands in for a tensor on a machine with an accelerator (none here): pin_memory() marks it."""

    def __init__(self, value, pinned=False):
        self.value, self.pinned = value, pinned

    def pin_memory(self):
        return FakePinnable(self.value, True)

    def __eq__(self, other):
        return type(other) is FakePinnable and (self.value, self.pinned) == (other.value, other.pinned)


def test_pin_keeps_containers_as_torchs_pin_memory_does():
    from collections import OrderedDict, namedtuple

    from torch.utils.data._utils.pin_memory import pin_memory as torchs_pin  # the oracle, tests only

    from loader.workers.pin_memory import pin

    Pair = namedtuple("Pair", "a b")
    batch = {
        "x": FakePinnable(1),
        "pair": Pair(FakePinnable(2), "label"),
        "list": [FakePinnable(3), (FakePinnable(4), 5)],
        "ordered": OrderedDict(y=FakePinnable(6)),
        "raw": b"bytes",
    }
    ours, theirs = pin(batch), torchs_pin(batch)
    assert ours == theirs and ours["x"].pinned and ours["list"][1][0].pinned
    assert type(ours["pair"]) is Pair and type(ours["ordered"]) is OrderedDict


def slow_bytes(raw: bytes) -> torch.Tensor:
    time.sleep(0.001)  # the other thread runs meanwhile
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8)


def test_single_process_iterators_in_two_threads_yield_torchs_batches(files):
    """num_workers=0: two threads each iterate the same loader (with a cache their reads fill from
    the main process's ring at once); each gets torch's batches, and so does a later epoch, which
    reads what they cached. The decode draws no random numbers (the threads share the RNGs)."""
    dataset = FileDataset(files, decode=slow_bytes)
    expected = list(tud.DataLoader(dataset, batch_size=8))
    loader = DataLoader(dataset, batch_size=8, cache_ram="1MiB")
    results, errors = {}, []

    def run(name):
        try:
            results[name] = [list(loader) for _ in range(3)]
        except Exception as error:  # noqa: BLE001 - reported below
            errors.append(error)

    threads = [threading.Thread(target=run, args=(n,)) for n in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert not errors and len(results) == 2
    assert all(same(epoch, expected) for epochs in results.values() for epoch in epochs)
    assert same(list(loader), expected)
    loader.close()
