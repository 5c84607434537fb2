"""The access plan: the exact index stream a sampler will yield, known before it yields it.

Pure: no I/O, and no caller's RNG is advanced. A seeded sampler is replayed on a clone of
its generator (or of the global generator it would draw from), running torch's own
sampler code on the clone, so the plan matches torch draw for draw, including the
trailing `randperm` a RandomSampler makes when it is exhausted.

Horizon: the current epoch always; the following epochs too when they are determined by
seeds alone (SequentialSampler, DistributedSampler, a sampler with its own generator).
A RandomSampler without a generator reseeds from the global RNG every epoch, which the
training step also draws from, so only the current epoch is known (computed when the
epoch's first index is drawn). Unknown sampler types get no plan.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import numpy as np
import torch
from torch.utils.data import (
    BatchSampler,
    DistributedSampler,
    RandomSampler,
    SequentialSampler,
    SubsetRandomSampler,
    WeightedRandomSampler,
)

_SEEDED = (RandomSampler, SubsetRandomSampler, WeightedRandomSampler)


@dataclass
class EpochPlan:
    """What this rank reads in one epoch, in order, and what it will probably read next."""

    indices: np.ndarray  # int64, flat stream of dataset indices, in read order
    batch_size: int | None  # samples per batch (the last may be short); None: one index per step
    following: list[np.ndarray] = field(default_factory=list)  # predicted streams of the next epochs

    def batch_bounds(self, batch: int) -> tuple[int, int]:
        """Positions [start, end) of batch number `batch` in `indices`."""
        size = self.batch_size or 1
        start = batch * size
        return start, min(start + size, len(self.indices))

    @property
    def num_batches(self) -> int:
        size = self.batch_size or 1
        return (len(self.indices) + size - 1) // size


def clone_generator(generator: torch.Generator | None) -> torch.Generator:
    """A generator in the same state as `generator`, or as the global CPU generator when None."""
    clone = torch.Generator()
    clone.set_state(generator.get_state() if generator is not None else torch.get_rng_state())
    return clone


def _draw_base_seed(generator: torch.Generator) -> None:
    # The draw torch's _BaseDataLoaderIter makes for the workers' base seed.
    torch.empty((), dtype=torch.int64).random_(generator=generator)


def sampler_generator(sampler) -> torch.Generator | None:
    """The generator a (possibly batched) sampler draws from; None means the global RNG or none."""
    base = sampler.sampler if type(sampler) is BatchSampler else sampler
    return getattr(base, "generator", None) if type(base) in _SEEDED else None


def uses_global_rng(sampler) -> bool:
    """True when the sampler's order comes from the global RNG (so a replay must restore it)."""
    base = sampler.sampler if type(sampler) is BatchSampler else sampler
    return type(base) in _SEEDED and base.generator is None


def is_plannable(index_sampler) -> bool:
    """Whether `plan_epoch` knows this sampler type exactly (subclasses may change the order)."""
    base = index_sampler.sampler if type(index_sampler) is BatchSampler else index_sampler
    return type(base) in _SEEDED + (SequentialSampler, DistributedSampler)


class _Replay:
    """Replays one base sampler epoch by epoch on clones of the RNG it draws from."""

    def __init__(self, sampler, base_seed_generator: torch.Generator | None):
        self.sampler = sampler
        self.clone = copy.copy(sampler)
        kind = type(sampler)
        self.known_future = True
        if kind in _SEEDED:
            if sampler.generator is not None:
                self.clone.generator = clone_generator(sampler.generator)
                # torch draws the workers' base seed from the loader's generator at every new
                # iterator; when that is the sampler's generator, the draw shifts the next epoch.
                self.base_seed_shared = base_seed_generator is sampler.generator
            elif kind is RandomSampler:
                seed = int(torch.empty((), dtype=torch.int64).random_(generator=clone_generator(None)).item())
                self.clone.generator = torch.Generator().manual_seed(seed)
                self.known_future = False
            else:
                self.clone.generator = clone_generator(None)
                self.known_future = False
        self.epochs_done = 0

    def next_epoch(self) -> list[int]:
        if self.epochs_done > 0:
            if isinstance(self.sampler, DistributedSampler):
                self.clone.set_epoch(self.sampler.epoch + self.epochs_done)
            elif type(self.sampler) in _SEEDED and getattr(self, "base_seed_shared", False):
                _draw_base_seed(self.clone.generator)
        self.epochs_done += 1
        return list(iter(self.clone))


def plan_epoch(
    index_sampler,
    *,
    loader_generator: torch.Generator | None = None,
    new_iterator_each_epoch: bool = True,
    horizon_epochs: int = 2,
) -> EpochPlan | None:
    """The stream the next `iter(index_sampler)` yields, plus up to `horizon_epochs - 1` more.

    Call it just before the epoch's first index is drawn (the loader does, from inside the
    sampler's iterator). `loader_generator` is the DataLoader's `generator` argument and
    `new_iterator_each_epoch` is False for persistent workers: together they say whether a
    base-seed draw on the sampler's generator separates two epochs. Returns None when the
    sampler type is not one of torch's (a subclass may yield anything).
    """
    if not is_plannable(index_sampler):
        return None
    batched = type(index_sampler) is BatchSampler
    base = index_sampler.sampler if batched else index_sampler
    replay = _Replay(base, loader_generator if new_iterator_each_epoch else None)

    def stream() -> np.ndarray:
        flat = replay.next_epoch()
        if batched and index_sampler.drop_last:
            flat = flat[: len(flat) // index_sampler.batch_size * index_sampler.batch_size]
        return np.asarray(flat, dtype=np.int64)

    current = stream()
    following = [stream() for _ in range(horizon_epochs - 1)] if replay.known_future else []
    return EpochPlan(current, index_sampler.batch_size if batched else None, following)


def rank_streams(sampler: DistributedSampler, epoch: int) -> list[np.ndarray]:
    """The stream every rank of a DistributedSampler reads in `epoch` (index r is rank r's)."""
    streams = []
    for rank in range(sampler.num_replicas):
        clone = copy.copy(sampler)
        clone.rank = rank
        clone.set_epoch(epoch)
        streams.append(np.asarray(list(iter(clone)), dtype=np.int64))
    return streams
