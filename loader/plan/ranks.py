"""The plan across ranks: which rank keeps which sample for the whole cluster.

Under a DistributedSampler every rank can compute every other rank's stream (same seed,
same epoch), so the ranks agree on a *home* for each sample without a message: the rank
that reads it first in the first epoch the loader plans. That rank reads it from storage
once and keeps it for the others (placement gives home samples priority over its own
copies of other ranks' samples, see holdings.py); every other rank that needs it later
takes it over the peer exchange. When the aggregate cache holds the dataset, storage is
read once per sample over the whole run: the plan's optimum.

Pure: integers in, integers out, no torch.distributed and no I/O.
"""

from __future__ import annotations

import copy

import numpy as np
import torch
from torch.utils.data import BatchSampler, DistributedSampler


def distributed_sampler(index_sampler) -> DistributedSampler | None:
    """The DistributedSampler behind a (possibly batched) index sampler, else None."""
    base = index_sampler.sampler if type(index_sampler) is BatchSampler else index_sampler
    return base if type(base) is DistributedSampler else None


def with_world(sampler: DistributedSampler, num_replicas: int) -> DistributedSampler:
    """A copy of `sampler` as it would be with `num_replicas` ranks (rank 0; set .rank to move)."""
    clone = copy.copy(sampler)
    clone.num_replicas, clone.rank = num_replicas, 0
    n = len(clone.dataset)
    clone.num_samples = n // num_replicas if clone.drop_last and n % num_replicas else -(-n // num_replicas)
    clone.total_size = clone.num_samples * num_replicas
    return clone


def epoch_streams(
    n: int, world: int, seed: int, epoch: int, shuffle: bool = True, drop_last: bool = False
) -> np.ndarray:
    """[world, per_rank]: row r is what DistributedSampler(rank=r) yields in `epoch`, computed
    once for all ranks (one permutation, then torch's padding and striding)."""
    if shuffle:
        generator = torch.Generator()
        generator.manual_seed(seed + epoch)
        order = torch.randperm(n, generator=generator).numpy().astype(np.int64)
    else:
        order = np.arange(n, dtype=np.int64)
    per_rank = n // world if drop_last and n % world else -(-n // world)
    total = per_rank * world
    if total > n:
        reps = -(-(total - n) // n)
        order = np.concatenate([order, np.tile(order, reps)[: total - n]])
    order = order[:total]
    return order.reshape(per_rank, world).T.copy()


def sampler_streams(sampler: DistributedSampler, epoch: int) -> np.ndarray:
    """epoch_streams for the ranks of this sampler (its seed, shuffle and drop_last)."""
    return epoch_streams(
        len(sampler.dataset), sampler.num_replicas, sampler.seed, epoch, sampler.shuffle, sampler.drop_last
    )


def home_ranks(streams: np.ndarray, n: int) -> np.ndarray:
    """home[i] = the lowest rank whose stream holds sample i; samples no rank reads are
    spread round robin (i % world)."""
    world = streams.shape[0]
    home = np.arange(n, dtype=np.int64) % world
    first = np.full(n, world, dtype=np.int64)
    ranks = np.repeat(np.arange(world, dtype=np.int64), streams.shape[1])
    np.minimum.at(first, streams.ravel(), ranks)
    read = first < world
    home[read] = first[read]
    return home


def home_ranks_for(index_sampler, n: int, world: int) -> np.ndarray:
    """The home rank of each sample, from the epoch about to start."""
    sampler = distributed_sampler(index_sampler)
    if sampler is not None and sampler.num_replicas == world:
        return home_ranks(sampler_streams(sampler, sampler.epoch), n)
    return np.arange(n, dtype=np.int64) % world  # each rank's stream is its own: spread the keeping
