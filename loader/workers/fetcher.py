"""Turn what the sampler drew into a batch, in the main process (num_workers=0) or a worker.

A map-style dataset gets each index (a batch at once through `__getitems__` when it has
one, as torch does); an IterableDataset is read in order from one iterator per epoch and
per process (every worker holds a copy and must shard itself, as with torch). The result
goes through `collate_fn`: torch's `default_collate` for batches, `default_convert` when
batch_size=None, or the caller's function.
"""

from __future__ import annotations


class MapFetcher:
    iterable = False

    def __init__(self, dataset, auto_collation: bool, collate_fn, drop_last: bool):
        self.dataset, self.auto_collation, self.collate_fn = dataset, auto_collation, collate_fn
        self.getitems = getattr(dataset, "__getitems__", None) if auto_collation else None

    def fetch(self, index):
        if not self.auto_collation:
            return self.collate_fn(self.dataset[index])
        if self.getitems:
            return self.collate_fn(self.getitems(index))
        dataset = self.dataset
        return self.collate_fn([dataset[i] for i in index])


class IterableFetcher:
    iterable = True

    def __init__(self, dataset, auto_collation: bool, collate_fn, drop_last: bool):
        self.stream = iter(dataset)
        self.auto_collation, self.collate_fn, self.drop_last = auto_collation, collate_fn, drop_last
        self.ended = False

    def fetch(self, index):
        """`index` only says how many items (a batch's worth, or one): raises StopIteration at the end."""
        if self.ended:
            raise StopIteration
        if not self.auto_collation:
            return self.collate_fn(next(self.stream))
        items = []
        for _ in index:
            try:
                items.append(next(self.stream))
            except StopIteration:
                self.ended = True
                break
        if not items or (self.drop_last and len(items) < len(index)):
            raise StopIteration
        return self.collate_fn(items)


def make_fetcher(iterable: bool, dataset, auto_collation: bool, collate_fn, drop_last: bool):
    kind = IterableFetcher if iterable else MapFetcher
    return kind(dataset, auto_collation, collate_fn, drop_last)
