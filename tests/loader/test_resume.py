"""Resume mid-epoch: a loader rebuilt from state_dict() yields the rest of the epoch and
the following epochs exactly as an uninterrupted torch DataLoader does, random
augmentation in the workers included."""

from __future__ import annotations

import os
import pickle
import random

import numpy as np
import pytest
import torch
import torch.utils.data as tud
from torch.utils.data import DistributedSampler

from loader import DataLoader, FileDataset
from tests.loader.conftest import noisy_decode, same, shuffled

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
        torch.rand(1)  # the training step's own randomness
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


class _RunsCode:
    """What a hostile checkpoint carries: unpickling it creates a directory."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return os.mkdir, (self.path,)


def plain(value) -> bool:
    """Only what torch.load(weights_only=True) reads without any class: no pickled bytes anywhere."""
    if isinstance(value, dict):
        return all(type(k) in (str, int) and plain(v) for k, v in value.items())
    return (
        value is None
        or type(value) in (int, str, bool)
        or (isinstance(value, torch.Tensor) and value.dtype in (torch.uint8, torch.int64))
    )


def test_weights_only_checkpoint_resumes_and_never_runs_code(files, tmp_path):
    dl, g = build(tud.DataLoader, files, "generator", WORKERS["w2"])
    oracle = train(dl, g, 0)[0]
    dl, g = build(DataLoader, files, "generator", WORKERS["w2"], cache_ram="1MiB")
    train(dl, g, 0, stop=STOP)
    state = dl.state_dict()
    dl.close()
    assert plain(state) and state["_snapshot"]["_worker_snapshots"], state.keys()
    torch.save(state, tmp_path / "ckpt.pt")
    loaded = torch.load(tmp_path / "ckpt.pt", weights_only=True)
    dl, g = build(DataLoader, files, "generator", WORKERS["w2"], cache_ram="1MiB")
    dl.load_state_dict(loaded)
    assert same(train(dl, g, 0)[0], oracle[STOP:])
    dl.close()

    marker = str(tmp_path / "code-ran")
    workers = loaded["_snapshot"]["_worker_snapshots"]
    hostile_workers = dict(workers, worker_0={"worker_id": 0, "rng_state": pickle.dumps(_RunsCode(marker))})
    hostile = dict(loaded, _snapshot=dict(loaded["_snapshot"], _worker_snapshots=hostile_workers))
    torch.save(hostile, tmp_path / "hostile.pt")
    hostile = torch.load(tmp_path / "hostile.pt", weights_only=True)  # bytes pass weights_only...
    dl, g = build(DataLoader, files, "generator", WORKERS["w2"], cache_ram="1MiB")
    with pytest.raises(ValueError, match=r"worker_rng\[0\] must hold uint8 tensors"):
        dl.load_state_dict(hostile)  # ...and the loader refuses them
    list(dl)
    dl.close()
    assert not os.path.exists(marker)
    for key, bad in [
        ("_num_yielded", "5"),
        ("dataset_len", 45.0),
        ("epoch_start", {"x": 1}),
        ("_snapshot", []),
    ]:
        with pytest.raises(ValueError, match=key):
            DataLoader(FileDataset(files), num_workers=2).load_state_dict(dict(loaded, **{key: bad}))


def plain_decode(raw: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(raw[:8]), dtype=torch.uint8)


@pytest.mark.parametrize("resumed_workers", [0, 3])
def test_resume_with_other_num_workers_yields_the_rest_once(files, resumed_workers):
    """A checkpoint from 2 workers resumes with another number: the same remaining batches (the
    workers' augmentation streams differ, as in torch when num_workers changes), with a warning."""

    def make(workers):
        return shuffled(FileDataset(files, decode=plain_decode), 4, seed=5, num_workers=workers)

    expected = list(shuffled(FileDataset(files, decode=plain_decode), 4, seed=5, cls=tud.DataLoader))
    dl = make(2)
    for step, _ in enumerate(dl):
        if step + 1 == STOP:
            break
    state = dl.state_dict()
    dl.close()
    dl = make(resumed_workers)
    with pytest.warns(RuntimeWarning, match="num_workers=2, this loader has"):
        dl.load_state_dict(state)
    rest = list(dl)
    dl.close()
    assert same(rest, expected[STOP:])


def _flat(state: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in state.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(_flat(value, path + "."))
        out[path] = value
    return out


@pytest.mark.parametrize("workers", [0, 2])
def test_state_keys_match_torchdata_where_they_overlap(files, workers):
    """torchdata's StatefulDataLoader, same arguments, same step: every key both states hold has
    the same type, and the positions (batches yielded, workers) the same value."""
    from torchdata.stateful_dataloader import StatefulDataLoader

    states = []
    for cls, extra in ((StatefulDataLoader, {"snapshot_every_n_steps": 1}), (DataLoader, {})):
        dl = shuffled(
            FileDataset(files, decode=plain_decode), 4, seed=5, cls=cls, num_workers=workers, **extra
        )
        iterator = iter(dl)
        for _ in range(STOP):
            next(iterator)
        states.append(_flat(dl.state_dict()))
        del iterator
        if cls is DataLoader:
            dl.close()
    theirs, ours = states
    shared = set(theirs) & set(ours)
    position = "_num_yielded" if workers == 0 else "_snapshot._snapshot_step"
    assert position in shared and "_iterator_finished" in shared
    for path in shared:
        assert type(ours[path]) is type(theirs[path]), path
        if not isinstance(ours[path], dict):
            assert ours[path] == theirs[path], path
    if workers:
        assert set(ours["_snapshot._worker_snapshots"]) == set(theirs["_snapshot._worker_snapshots"])
        assert ours["_snapshot._main_snapshot._num_workers"] == workers
