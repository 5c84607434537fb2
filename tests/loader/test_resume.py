"""Resume mid-epoch: a loader rebuilt from state_dict() yields the rest of the epoch and
the following epochs exactly as an uninterrupted torch DataLoader does, random
augmentation in the workers included."""
from __future__ import annotations

import random

import numpy as np
import pytest
import torch
import torch.utils.data as tud
from torch.utils.data import DistributedSampler

from loader import DataLoader, FileDataset
from tests.loader.conftest import noisy_decode, same

CASES = {
    "generator": lambda ds, g: dict(shuffle=True, generator=g),
    "global_rng": lambda ds, g: dict(shuffle=True),
    "distributed": lambda ds, g: dict(sampler=DistributedSampler(ds, 2, 1, seed=9)),
}
WORKERS = {
    "w0": dict(num_workers=0),
    "w2": dict(num_workers=2),
    "w2_persistent": dict(num_workers=2, persistent_workers=True),
    # batch STOP+1 reaches its worker just as the loop breaks and the workers stop: that worker may never
    # start it, and state_dict() must not wait for it
    "w2_prefetch1": dict(num_workers=2, prefetch_factor=1),
}
STOP = 5  # batches of epoch 1 trained on before the interruption


def build(loader_cls, files, case, workers, **extra):
    """What a training script does at start-up, in a fresh process: seed, then build."""
    torch.manual_seed(1234)
    random.seed(0)
    np.random.seed(0)
    dataset = FileDataset(files, decode=noisy_decode)
    generator = torch.Generator().manual_seed(99)
    return loader_cls(dataset, batch_size=4, **CASES[case](dataset, generator), **workers, **extra), generator


def train(dl, generator, epoch, stop=None):
    if isinstance(dl.sampler, DistributedSampler):
        dl.sampler.set_epoch(epoch)
    batches = []
    for batch in dl:
        batches.append(batch)
        torch.rand(1)                              # the training step's own randomness
        if stop is not None and len(batches) == stop:
            break
    return batches, torch.get_rng_state(), generator.get_state()


@pytest.mark.parametrize("workers", list(WORKERS))
@pytest.mark.parametrize("case", list(CASES))
def test_resume_mid_epoch_equals_uninterrupted_torch(files, case, workers):
    check_resume(files, case, workers)


def check_resume(files, case, workers, before_state_dict=None):
    dl, g = build(tud.DataLoader, files, case, WORKERS[workers])
    oracle = [train(dl, g, epoch) for epoch in range(3)]

    dl, g = build(DataLoader, files, case, WORKERS[workers], cache_ram="1MiB")
    train(dl, g, 0)
    train(dl, g, 1, stop=STOP)
    if before_state_dict is not None:
        before_state_dict(dl)
    checkpoint = dl.state_dict()
    script_rng = (torch.get_rng_state(), random.getstate(), np.random.get_state())
    dl.close()

    dl, g = build(DataLoader, files, case, WORKERS[workers], cache_ram="1MiB")
    dl.load_state_dict(checkpoint)
    torch.set_rng_state(script_rng[0])
    random.setstate(script_rng[1])
    np.random.set_state(script_rng[2])
    resumed = [train(dl, g, 1), train(dl, g, 2)]
    dl.close()

    assert len(resumed[0][0]) == len(oracle[1][0]) - STOP
    assert same(resumed[0][0], oracle[1][0][STOP:]), "the rest of the interrupted epoch differs"
    assert same(resumed[1][0], oracle[2][0]), "the epoch after the resume differs"
    for (_, rng, gen), (_, rng_o, gen_o) in zip(resumed, oracle[1:]):
        assert torch.equal(rng, rng_o) and torch.equal(gen, gen_o)


def test_resume_between_epochs_and_bad_states(files):
    dl, g = build(DataLoader, files, "generator", WORKERS["w0"])
    train(dl, g, 0)
    checkpoint = dl.state_dict()
    script_rng = (torch.get_rng_state(), random.getstate(), np.random.get_state())
    expected = train(dl, g, 1)
    dl, g = build(DataLoader, files, "generator", WORKERS["w0"])
    dl.load_state_dict(checkpoint)
    torch.set_rng_state(script_rng[0])
    random.setstate(script_rng[1])
    np.random.set_state(script_rng[2])
    batches, rng, gen = train(dl, g, 1)
    assert same(batches, expected[0]) and torch.equal(rng, expected[1]) and torch.equal(gen, expected[2])
    with pytest.raises(ValueError, match="not a loader state"):
        dl.load_state_dict({"epoch": 3})
    with pytest.raises(ValueError, match="dataset had 45 samples, this one has 7"):
        DataLoader(list(range(7))).load_state_dict(checkpoint)
