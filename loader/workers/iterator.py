"""The loader's iterators: what `iter(loader)` returns. One epoch (or, with persistent workers,
one epoch at a time) of batches, in the sampler's order, as torch's iterators yield them.

The loader owns these classes rather than subclassing torch's private iterators, whose
attributes torch may reorder between releases (torchdata's StatefulDataLoader made the same
choice). What they keep of torch's behaviour, item by item, is tested against torch's own
DataLoader in tests/loader/test_conformance.py and test_contract.py. The multi-process one is
in multiprocess_iterator.py; the protocol between processes is the note in dataloader.py.
"""

from __future__ import annotations

import time
import warnings

import torch
from torch.utils.data import IterableDataset

from loader.cache.view import CachedView
from loader.workers.fetcher import make_fetcher
from loader.workers.pin_memory import pin, pin_device


class LoaderIterator:
    """What both iterators share: the epoch's sampler iterator, the workers' base seed (drawn
    here, after the sampler iterator is made and before its first draw, as torch draws it),
    the caller's wait timed for stats, and torch's IterableDataset length warning."""

    def __init__(self, loader, dataset, index_sampler, engine):
        self.dataset = dataset
        self.iterable = isinstance(loader.dataset, IterableDataset)
        self.auto_collation = loader.batch_sampler is not None
        self.drop_last = loader.drop_last
        self.collate_fn = loader.collate_fn
        self.index_sampler = index_sampler
        self.num_workers = loader.num_workers
        self.timeout = loader.timeout
        self.engine = engine
        self.pin_device = pin_device(loader.pin_memory, loader.pin_memory_device)
        self.len_called = getattr(loader, "_IterableDataset_len_called", None)
        self.sampler_iter = iter(index_sampler)
        self.base_seed = torch.empty((), dtype=torch.int64).random_(generator=loader.generator).item()
        self.yielded = 0
        self.profile_name = f"enumerate(DataLoader)#{type(self).__name__}.__next__"

    def __iter__(self):
        return self

    def __len__(self) -> int:
        return len(self.index_sampler)

    def __next__(self):
        with torch.autograd.profiler.record_function(self.profile_name):  # as torch labels it
            start = time.perf_counter()
            data = self.next_batch()
            self.engine.batch_yielded(time.perf_counter() - start)
        self.yielded += 1
        if self.iterable and self.len_called is not None and self.yielded > self.len_called:
            message = (
                f"Length of IterableDataset {self.dataset} was reported to be {self.len_called}"
                f"(when accessing len(dataloader)), but {self.yielded} samples have been fetched. "
            )
            if self.num_workers > 0:
                message += (
                    "For multiprocessing data-loading, this could be caused by not properly configuring the "
                    "IterableDataset replica at each worker. Please see "
                    "https://pytorch.org/docs/stable/data.html#torch.utils.data.IterableDataset for examples."
                )
            warnings.warn(message, stacklevel=2)
        return data

    def next_batch(self):
        raise NotImplementedError

    def restart(self, loader) -> None:
        """A new epoch on the same iterator (persistent workers)."""
        self.sampler_iter = iter(self.index_sampler)
        self.yielded = 0
        self.len_called = getattr(loader, "_IterableDataset_len_called", None)

    def shutdown(self) -> None:
        pass

    def __getstate__(self):
        raise NotImplementedError(f"{type(self).__name__} cannot be pickled")

    # --- torch's names ---------------------------------------------------------------------------
    # Code written for torch's iterators reads some of their private attributes (torch's own
    # test_dataloader.py, and users checking worker liveness). These keep torch's meaning; read only.
    _dataset = property(
        lambda self: self.dataset.dataset if type(self.dataset) is CachedView else self.dataset
    )
    # the loader's sampler (or BatchSampler); the iterator draws through the plan's wrapper of it, whose
    # items are tickets, so torch's _sampler_iter has no equivalent here
    _index_sampler = property(lambda self: getattr(self.index_sampler, "inner", self.index_sampler))
    _num_workers = property(lambda self: self.num_workers)
    _num_yielded = property(lambda self: self.yielded)  # batches yielded this epoch
    _auto_collation = property(lambda self: self.auto_collation)
    _drop_last = property(lambda self: self.drop_last)
    _collate_fn = property(lambda self: self.collate_fn)
    _timeout = property(lambda self: self.timeout)
    _base_seed = property(lambda self: self.base_seed)
    _pin_memory = property(lambda self: self.pin_device is not None)


class SingleProcessIterator(LoaderIterator):
    """num_workers=0: the main process fetches each batch when it is asked for."""

    def __init__(self, loader, dataset, index_sampler, engine):
        super().__init__(loader, dataset, index_sampler, engine)
        if self.timeout != 0:
            raise AssertionError("_SingleProcessDataLoaderIter requires timeout == 0")  # torch's words
        self.fetcher = make_fetcher(
            self.iterable, dataset, self.auto_collation, self.collate_fn, self.drop_last
        )

    def next_batch(self):
        index = next(self.sampler_iter)  # StopIteration ends the epoch
        data = self.fetcher.fetch(index)
        return pin(data) if self.pin_device is not None else data
