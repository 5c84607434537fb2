"""A damaged checkpoint is refused by load_state_dict, field by field, in the main process:
no worker ever gets an RNG state that torch, random or numpy would misread (numpy's
position indexes its key array: a position past 624 reads out of bounds, and 2**31-1 is a
segfault in the worker), and no integer field sizes an allocation. A good checkpoint from
the same run still resumes, with real worker processes."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.utils.data import DistributedSampler

from loader import DataLoader, FileDataset
from loader.plan.rng_state import _split
from tests.loader.conftest import noisy_decode, same

STOP = 3


def build(files, **extra) -> DataLoader:
    dataset = FileDataset(files, decode=noisy_decode)
    return DataLoader(
        dataset, batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(3), **extra
    )


@pytest.fixture(scope="module")
def saved(files):
    """A mid-epoch state of a loader with two workers, and the batches after it."""
    torch.manual_seed(0)
    dl = build(files, num_workers=2)
    batches = []
    for batch in dl:
        batches.append(batch)
        if len(batches) == STOP:
            break
    state = dl.state_dict()
    dl.close()
    return state


def with_worker_field(state: dict, part: str, index: int, value) -> dict:
    """`state` with worker 0's RNG field `part` (a section of rng_state.py's layout) changed."""
    rng = state["_snapshot"]["_worker_snapshots"]["worker_0"]["rng_state"].clone()
    _split(rng.numpy())[part][index] = value
    workers = dict(state["_snapshot"]["_worker_snapshots"], worker_0={"worker_id": 0, "rng_state": rng})
    return dict(state, _snapshot=dict(state["_snapshot"], _worker_snapshots=workers))


BAD_WORKER_FIELDS = {
    "numpy_pos_past_key": ("np_pos", 0, 700, "numpy.pos"),
    "numpy_pos_segfault": ("np_pos", 0, 2**31 - 1, "numpy.pos"),
    "numpy_pos_negative": ("np_pos", 0, -1, "numpy.pos"),
    "numpy_has_gauss": ("np_pos", 1, 7, "numpy.has_gauss"),
    "numpy_gaussian_nan": ("np_gauss", 0, float("nan"), "numpy.cached_gaussian"),
    "random_pos": ("py", 625, 625, "random.pos"),
    "random_word": ("py", 3, 1 << 40, "random.key"),
    "random_version": ("py", 0, 9, "random.version"),
    "random_has_gauss": ("py", 626, 2, "random.has_gauss"),
    "torch_mt_left": ("torch", slice(8, 12), 0, "torch"),  # CPUGeneratorImplState's int32 `left`
    "torch_mt_next": ("torch", slice(16, 24), 0xFF, "torch"),  # its uint64 `next`, past the state
}


@pytest.mark.parametrize("case", list(BAD_WORKER_FIELDS))
def test_a_worker_rng_field_out_of_range_is_refused_naming_it(files, saved, case):
    part, index, value, name = BAD_WORKER_FIELDS[case]
    bad = with_worker_field(saved, part, index, value)
    dl = build(files, num_workers=2)
    with pytest.raises(ValueError, match=rf"worker_rng\[0\]\.{name}"):
        dl.load_state_dict(bad)
    # refused before any worker saw it: the loader is untouched and its workers run a whole epoch
    assert len(list(dl)) == 12
    dl.close()


def test_the_same_checkpoint_unchanged_still_resumes(files, saved):
    torch.manual_seed(0)
    oracle = build(files, num_workers=2)
    expected = list(oracle)[STOP:]
    oracle.close()
    dl = build(files, num_workers=2)
    dl.load_state_dict(saved)
    assert same(list(dl), expected)
    dl.close()


def test_generator_states_are_checked_as_torch_checks_them(files, saved):
    generators = saved["generators_now"]
    short = dict(saved, generators_now=dict(generators, loader_generator=torch.zeros(16, dtype=torch.uint8)))
    with pytest.raises(ValueError, match=r"generators_now\.loader_generator must hold 5056 bytes"):
        build(files, num_workers=2).load_state_dict(short)
    broken = generators["loader_generator"].clone()
    broken[8:12] = 0  # the Mersenne Twister's `left`: torch's own check refuses it
    bad = dict(saved, epoch_start=dict(saved["epoch_start"], loader_generator=broken))
    with pytest.raises(ValueError, match=r"epoch_start\.loader_generator is not a valid torch RNG state"):
        build(files, num_workers=2).load_state_dict(bad)


def test_integer_fields_are_bounded(files, saved):
    too_far = dict(saved, _num_yielded=10**12, _snapshot=dict(saved["_snapshot"], _snapshot_step=10**12))
    with pytest.raises(ValueError, match=r"_num_yielded must be at most the epoch's 12 batches"):
        build(files, num_workers=2).load_state_dict(too_far)
    workers = saved["_snapshot"]["_worker_snapshots"]
    stranger = dict(workers, worker_5={"worker_id": 5, "rng_state": workers["worker_0"]["rng_state"]})
    bad = dict(saved, _snapshot=dict(saved["_snapshot"], _worker_snapshots=stranger))
    with pytest.raises(ValueError, match=r"worker_id must be in \[0, _num_workers=2\)"):
        build(files, num_workers=2).load_state_dict(bad)


@pytest.mark.parametrize("world", [10**12, 0])
def test_a_huge_distributed_world_is_refused_before_any_allocation(files, world):
    dataset = FileDataset(files, decode=noisy_decode)
    dl = DataLoader(dataset, batch_size=4, sampler=DistributedSampler(dataset, 2, 0, seed=9))
    for step, _ in enumerate(dl):
        if step == 1:
            break
    state = dl.state_dict()
    assert state["distributed"] == {"num_replicas": 2, "rank": 0}
    state["distributed"] = {"num_replicas": world, "rank": 0}
    fresh = DataLoader(dataset, batch_size=4, sampler=DistributedSampler(dataset, 2, 0, seed=9))
    with pytest.raises(ValueError, match=r"distributed\.num_replicas must be an int in \[1, 1048576\]"):
        fresh.load_state_dict(state)
    state["distributed"] = {"num_replicas": 2, "rank": 2}
    with pytest.raises(ValueError, match=r"distributed\.rank must be an int in \[0, 2\)"):
        fresh.load_state_dict(state)
    dl.close()
    fresh.close()


def test_layout_field_names_match_numpy_state():
    """The test above writes numpy's pos at np_pos[0]: the layout holds numpy's state there."""
    from loader.plan.rng_state import capture_rng

    np.random.seed(1)
    np.random.rand(5)
    parts = _split(capture_rng().numpy())
    assert int(parts["np_pos"][0]) == np.random.get_state()[2] < 624
