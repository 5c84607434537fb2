"""A worker process of the loader: seeds itself as torch's workers do, then fetches the batches
its index queue names until the main process says stop or goes away.

The semantics are torch's documented ones (see torch.utils.data's "Multi-process data
loading" and "Randomness in multi-process data loading"): worker `w` of an iterator whose
base seed is `b` seeds `random` and torch with `b + w`, numpy with the state torch derives
from (b, w) (numpy's own SeedSequence([w, b]), the same four words), runs with one torch
thread, calls `worker_init_fn(w)` after `get_worker_info()` is set, and an exception in
`worker_init_fn` is reported with the first batch it was asked for. The worker info is the
one internal of torch the loader touches (see dataloader.py's note): `get_worker_info()`
reads `torch.utils.data._utils.worker._worker_info`, so a worker sets that global to a
`torch.utils.data._utils.worker.WorkerInfo`.
"""

from __future__ import annotations

import os
import queue
import random
import sys
import traceback
from dataclasses import dataclass

import numpy as np
import torch
import torch.utils.data._utils.worker as torch_worker

from loader.cache.view import CachedView
from loader.workers.fetcher import make_fetcher
from loader.workers.result_rings import ResultRings, Sender, worker_collate

WATCH_SECONDS = 1.0  # how often an idle worker checks that its main process still lives


@dataclass(frozen=True)
class NewEpoch:
    """To a persistent worker: start over (a fresh dataset iterator); echoed back when done."""


@dataclass(frozen=True)
class WorkerDone:
    """From a worker whose IterableDataset is exhausted: send it no more indices this epoch."""

    worker_id: int


class WorkerError:
    """An exception raised in a worker, carried to the main process as its type and formatted
    traceback, and raised there again as torch does: same type, the message names the worker
    and holds the original traceback."""

    def __init__(self, where: str):
        exc_type, exc, tb = sys.exc_info()
        self.exc_type = exc_type
        self.text = "".join(traceback.format_exception(exc_type, exc, tb))
        self.where = where

    def reraise(self):
        message = f"Caught {self.exc_type.__name__} {self.where}.\nOriginal {self.text}"
        if self.exc_type is KeyError:
            message = _Verbatim(message)  # KeyError shows repr() of its argument
        elif getattr(self.exc_type, "message", None):
            raise self.exc_type(message=message)
        try:
            error = self.exc_type(message)
        except Exception:
            raise RuntimeError(message) from None
        raise error


class _Verbatim(str):
    __slots__ = ()

    def __repr__(self) -> str:
        return str(self)


def seed_worker(base_seed: int, worker_id: int) -> int:
    """Seed this process's random, torch and numpy generators as torch's worker `worker_id` does."""
    seed = base_seed + worker_id
    random.seed(seed)
    torch.manual_seed(seed)
    np.random.seed(np.random.SeedSequence([worker_id, base_seed]).generate_state(4))
    return seed


def set_worker_info(**fields) -> None:
    torch_worker._worker_info = torch_worker.WorkerInfo(**fields)


def worker_loop(
    iterable: bool,
    dataset,
    index_queue,
    result_queue,
    done_event,
    auto_collation: bool,
    collate_fn,
    drop_last: bool,
    base_seed: int,
    init_fn,
    worker_id: int,
    num_workers: int,
    fill_ring: int | None,
    result_rings: ResultRings | None = None,
) -> None:
    """Entry point of a worker process (`fill_ring`: this worker's ring in the cache, fill_ring.py;
    `result_rings`: where its batches' tensors go to the main process, result_rings.py)."""
    parent = os.getppid()
    try:
        torch.set_num_threads(1)
        seed = seed_worker(base_seed, worker_id)
        users = dataset
        if isinstance(dataset, CachedView):  # get_worker_info().dataset is the user's, as with torch
            dataset.fill_ring, users = fill_ring, dataset.dataset
        set_worker_info(id=worker_id, num_workers=num_workers, seed=seed, dataset=users)
        where = f"in DataLoader worker process {worker_id}"
        sender = Sender(result_rings, worker_id) if result_rings is not None else None
        if sender is not None:
            collate_fn = worker_collate(collate_fn)
        init_error = fetcher = None
        try:
            if init_fn is not None:
                init_fn(worker_id)
            fetcher = make_fetcher(iterable, dataset, auto_collation, collate_fn, drop_last)
        except Exception:
            init_error = WorkerError(where)
        exhausted = False
        while os.getppid() == parent:
            try:
                message = index_queue.get(timeout=WATCH_SECONDS)
            except queue.Empty:
                continue
            if isinstance(message, NewEpoch):
                result_queue.put((message, None))
                exhausted = False
                fetcher = make_fetcher(iterable, dataset, auto_collation, collate_fn, drop_last)
                continue
            if message is None:  # stop
                break
            if done_event.is_set() or exhausted:
                continue
            task, index = message
            if init_error is not None:
                data, init_error = init_error, None
            else:
                try:
                    data = fetcher.fetch(index)
                except StopIteration:
                    if fetcher.iterable:
                        data, exhausted = WorkerDone(worker_id), True
                    else:
                        data = WorkerError(where)
                except Exception:
                    data = WorkerError(where)
            if sender is not None and not isinstance(data, (WorkerError, WorkerDone)):
                try:
                    data = sender.pack(data)
                except Exception:
                    data = WorkerError(where)  # torch's queue feeder would print this and lose the batch
            result_queue.put((task, data))
            del data, index, message  # a batch must not outlive its hand-over in this process
    except KeyboardInterrupt:
        pass  # the main process handles the interrupt and stops the workers
    if done_event.is_set() or os.getppid() != parent:
        # Nobody will read what is still queued: leaving must not wait on the pipe (a full one
        # never drains once the main process is gone, and another worker holds its read end).
        result_queue.cancel_join_thread()
        result_queue.close()
