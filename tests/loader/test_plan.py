"""The plan against torch's samplers: the streams they really yield are the oracle, and
planning must not move any RNG."""

from __future__ import annotations

import pytest
import torch
import torch.utils.data as tud
from torch.utils.data import (
    BatchSampler,
    DistributedSampler,
    RandomSampler,
    SequentialSampler,
    SubsetRandomSampler,
    WeightedRandomSampler,
)

from loader.plan.plan import is_plannable, plan_epoch, rank_streams

N = 37
DATA = list(range(N))


def samplers(g):
    return {
        "sequential": SequentialSampler(DATA),
        "random_generator": RandomSampler(DATA, generator=g),
        "random_global": RandomSampler(DATA),
        "random_replacement": RandomSampler(DATA, replacement=True, num_samples=70, generator=g),
        "random_num_samples": RandomSampler(DATA, num_samples=80),
        "subset_global": SubsetRandomSampler([3, 9, 4, 30, 12]),
        "weighted_generator": WeightedRandomSampler([1 + i % 4 for i in range(N)], 25, generator=g),
        "weighted_global_no_replacement": WeightedRandomSampler([1 + i % 4 for i in range(N)], 20, False),
        "distributed": DistributedSampler(DATA, num_replicas=4, rank=1, seed=7),
        "distributed_drop_last": DistributedSampler(DATA, num_replicas=4, rank=3, seed=7, drop_last=True),
        "batch_drop_last": BatchSampler(RandomSampler(DATA, generator=g), 5, True),
        "batch_keep_last": BatchSampler(RandomSampler(DATA), 5, False),
    }


@pytest.mark.parametrize("name", list(samplers(torch.Generator())))
def test_plan_is_the_stream_and_moves_no_rng(name):
    torch.manual_seed(11)
    g = torch.Generator().manual_seed(3)
    sampler = samplers(g)[name]
    before = (torch.get_rng_state(), g.get_state())
    plan = plan_epoch(sampler)
    assert torch.equal(before[0], torch.get_rng_state()) and torch.equal(before[1], g.get_state())
    actual = list(sampler)
    flat = [i for batch in actual for i in batch] if isinstance(sampler, BatchSampler) else actual
    assert plan.indices.tolist() == flat
    if isinstance(sampler, BatchSampler):
        assert plan.num_batches == len(actual)
        assert [plan.indices[slice(*plan.batch_bounds(b))].tolist() for b in range(len(actual))] == actual


def test_following_epochs_predicted_through_torchs_base_seed_draws():
    """A DataLoader(shuffle=True, generator=g) draws the workers' base seed from g before
    every epoch; the plan made at the first draw of epoch 0 predicts epochs 1 and 2."""
    g = torch.Generator().manual_seed(8)
    dl = tud.DataLoader(DATA, batch_size=4, shuffle=True, generator=g)
    it = iter(dl)  # base seed drawn; sampler not yet
    plan = plan_epoch(dl._index_sampler, loader_generator=g, horizon_epochs=3)
    epochs = [[int(i) for b in it for i in b]] + [[int(i) for b in dl for i in b] for _ in range(2)]
    assert [plan.indices.tolist()] + [f.tolist() for f in plan.following] == epochs


def test_following_epochs_without_base_seed_draws_for_persistent_workers():
    g = torch.Generator().manual_seed(8)
    sampler = RandomSampler(DATA, generator=g)
    plan = plan_epoch(sampler, loader_generator=g, new_iterator_each_epoch=False, horizon_epochs=3)
    assert [plan.indices.tolist()] + [f.tolist() for f in plan.following] == [list(sampler) for _ in range(3)]


def test_distributed_following_epochs_and_all_ranks():
    sampler = DistributedSampler(DATA, num_replicas=3, rank=2, seed=5)
    sampler.set_epoch(4)
    plan = plan_epoch(sampler, horizon_epochs=2)
    sampler.set_epoch(5)
    assert plan.following[0].tolist() == list(sampler)
    streams = rank_streams(sampler, epoch=4)
    for rank in range(3):
        oracle = DistributedSampler(DATA, num_replicas=3, rank=rank, seed=5)
        oracle.set_epoch(4)
        assert streams[rank].tolist() == list(oracle)


def test_global_rng_sampler_has_no_future_and_unknown_types_no_plan():
    assert plan_epoch(RandomSampler(DATA), horizon_epochs=3).following == []

    class Reversed(SequentialSampler):
        def __iter__(self):
            return iter(reversed(range(len(self.data_source))))

    assert not is_plannable(Reversed(DATA)) and plan_epoch(Reversed(DATA)) is None
    assert plan_epoch(BatchSampler(Reversed(DATA), 4, False)) is None
