"""Elastic resume: a checkpoint taken under W ranks continues under W' ranks.

A DistributedSampler gives rank r of W the samples perm[r::W] of one seeded permutation,
so from (seed, epoch, W, batches done) any process can tell which samples the old ranks
already trained on: the first `batches_done` batches of every old rank's stream (ranks step
together under DDP, so one rank's checkpoint speaks for all). The rest of the epoch, in
the order the old ranks would have read it (step by step, rank by rank), without the
samples already seen and without the padding duplicates, is dealt out round robin to the
new ranks: every remaining sample is yielded exactly once across them. Ranks may then
have one batch more or less than each other in that epoch (no sample is repeated to even
them out). The epochs after it are the new world's DistributedSampler epochs, unchanged.
"""

from __future__ import annotations

import numpy as np

from loader.plan.ranks import distributed_sampler, epoch_streams

MAX_WORLD = 1 << 20  # ranks a checkpoint's world may have had (any job today has far fewer)


def distributed_state(index_sampler) -> dict | None:
    """What a checkpoint records about the world its sampler was split for."""
    sampler = distributed_sampler(index_sampler)
    if sampler is None:
        return None
    return {"num_replicas": sampler.num_replicas, "rank": sampler.rank}


def remaining_samples(sampler, saved_world: int, batches_done: int, batch_size: int | None, drop_last: bool):
    """The epoch's samples that no rank of the saved world has yielded, in their old order."""
    streams = epoch_streams(
        len(sampler.dataset), saved_world, sampler.seed, sampler.epoch, sampler.shuffle, sampler.drop_last
    )
    size = batch_size or 1
    if batch_size and drop_last:
        streams = streams[:, : streams.shape[1] // size * size]
    done = batches_done * size
    seen = set(streams[:, :done].ravel().tolist())
    rest = streams[:, done:]
    steps = -(-rest.shape[1] // size)
    order = [int(i) for step in range(steps) for row in rest for i in row[step * size : (step + 1) * size]]
    return [i for i in dict.fromkeys(order) if i not in seen]


def elastic_batches(state: dict, index_sampler, batches_done: int) -> tuple[list, int] | None:
    """This rank's batches for the rest of the checkpoint's epoch when the world changed, and the
    most samples any new rank gets (peer exchange windows pair up to that); else None."""
    saved = state.get("distributed")
    sampler = distributed_sampler(index_sampler)
    if not isinstance(saved, dict) or sampler is None:
        return None
    world = saved.get("num_replicas")
    # The old ranks' streams are rebuilt below: about max(len(dataset), num_replicas) int64s, so a
    # world past both the dataset and any real job is a damaged checkpoint, not an allocation to try.
    most = max(len(sampler.dataset), MAX_WORLD)
    if type(world) is not int or not 1 <= world <= most:
        raise ValueError(
            f"load_state_dict: distributed.num_replicas must be an int in [1, {most}], got {world!r}"
        )
    rank = saved.get("rank")
    if type(rank) is not int or not 0 <= rank < world:
        raise ValueError(f"load_state_dict: distributed.rank must be an int in [0, {world}), got {rank!r}")
    if world == sampler.num_replicas:
        return None
    batch_size = getattr(index_sampler, "batch_size", None) if index_sampler is not sampler else None
    drop_last = bool(getattr(index_sampler, "drop_last", False))
    rest = remaining_samples(sampler, world, batches_done, batch_size, drop_last)
    mine = np.asarray(rest[sampler.rank :: sampler.num_replicas], dtype=np.int64).tolist()
    longest = -(-len(rest) // sampler.num_replicas)
    if batch_size is None:
        return mine, longest
    return [mine[i : i + batch_size] for i in range(0, len(mine), batch_size)], longest
