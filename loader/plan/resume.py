"""Exact mid-epoch resume: the RNG states an epoch started from, and how far it got.

An epoch's order is fixed by the RNG states at the moment its sampler makes its first
draw: the loader's generator, the sampler's own generator, or the global generator a
RandomSampler without a generator seeds itself from. Saving those states and the number
of batches done lets a new process replay the sampler from the same states, skip the
batches already trained on, and leave every generator where the uninterrupted run would
have left it. Workers' RNG states at batch edges (see view.py) make the decode-time random
augmentation of the remaining batches identical too.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch.utils.data import DistributedSampler

from loader.plan.plan import sampler_generator, uses_global_rng
from loader.plan.rng_state import check_rng, check_torch_state

FORMAT = "prescient.loader/3"


@dataclass
class EpochStart:
    """RNG states at the epoch's first draw (uint8 tensors) and the DistributedSampler epoch."""

    loader_generator: torch.Tensor | None
    sampler_generator: torch.Tensor | None
    global_rng: torch.Tensor | None
    sampler_epoch: int | None


@dataclass
class ResumePoint:
    start: EpochStart
    batches_done: int  # batches already yielded in that epoch
    worker_rng: dict[int, torch.Tensor] = field(default_factory=dict)  # worker id -> state (rng_state.py)


def _base_sampler(index_sampler):
    return getattr(index_sampler, "sampler", index_sampler)


def capture(loader_generator: torch.Generator | None, index_sampler) -> EpochStart:
    own = sampler_generator(index_sampler)
    base = _base_sampler(index_sampler)
    return EpochStart(
        loader_generator=loader_generator.get_state() if loader_generator is not None else None,
        sampler_generator=own.get_state() if own is not None and own is not loader_generator else None,
        global_rng=torch.get_rng_state() if uses_global_rng(index_sampler) else None,
        sampler_epoch=base.epoch if isinstance(base, DistributedSampler) else None,
    )


def restore(
    start: EpochStart, loader_generator: torch.Generator | None, index_sampler
) -> Callable[[], None] | None:
    """Put the epoch-start states back before the sampler's first draw.

    Returns a function to call right after that draw which gives the caller back its own
    global RNG state, so the replay leaves the training script's RNG untouched.
    """
    base = _base_sampler(index_sampler)
    if start.sampler_epoch is not None and getattr(base, "epoch", None) != start.sampler_epoch:
        raise ValueError(
            f"load_state_dict: the checkpoint was taken in DistributedSampler epoch "
            f"{start.sampler_epoch} but the sampler is at epoch {getattr(base, 'epoch', None)}; "
            f"call sampler.set_epoch({start.sampler_epoch}) before iterating"
        )
    if start.loader_generator is not None and loader_generator is not None:
        loader_generator.set_state(start.loader_generator)
    own = sampler_generator(index_sampler)
    if start.sampler_generator is not None and own is not None:
        own.set_state(start.sampler_generator)
    if start.global_rng is None:
        return None
    callers = torch.get_rng_state()
    torch.set_rng_state(start.global_rng)
    return lambda: torch.set_rng_state(callers)


def to_dict(
    point: ResumePoint | None,
    generators_now: EpochStart,
    dataset_len: int,
    num_workers: int,
) -> dict:
    """A plain dict of strings, ints, bools, None and uint8 tensors: loads with
    torch.load(weights_only=True) and resumes without unpickling anything.

    The keys torchdata's StatefulDataLoader also has keep its names and shapes: `_num_yielded`
    and `_iterator_finished` at the top (its single-process state), `_snapshot` with
    `_snapshot_step`, `_main_snapshot._num_workers`, `_main_snapshot._sampler_iter_yielded` and
    `_worker_snapshots["worker_<id>"]["worker_id"]`, plus `_steps_since_snapshot` (its
    multi-process state; our snapshot is always taken at the step the state describes, so that
    is 0, and the sampler is replayed to exactly the batches yielded). What torchdata keeps as
    pickled sampler/dataset state is here RNG states: the epoch's start (`epoch_start`), the
    generators now (`generators_now`) and each worker's (`_worker_snapshots[...]["rng_state"]`).
    The README documents the format."""

    def states(start: EpochStart) -> dict:
        return {
            "loader_generator": start.loader_generator,
            "sampler_generator": start.sampler_generator,
            "global_rng": start.global_rng,
            "sampler_epoch": start.sampler_epoch,
        }

    done = point.batches_done if point else 0
    workers = {
        f"worker_{worker}": {"worker_id": worker, "rng_state": rng}
        for worker, rng in (point.worker_rng.items() if point else ())
    }
    return {
        "format": FORMAT,
        "dataset_len": dataset_len,
        "_num_yielded": done,
        "_iterator_finished": point is None,
        "_snapshot": {
            "_snapshot_step": done,
            "_main_snapshot": {"_num_workers": num_workers, "_sampler_iter_yielded": done},
            "_worker_snapshots": workers,
        },
        "_steps_since_snapshot": 0,
        "epoch_start": states(point.start) if point else None,
        "generators_now": states(generators_now),
    }


def _int(state: dict, key: str, minimum: int = 0) -> int:
    value = state.get(key)
    if type(value) is not int or value < minimum:
        raise ValueError(f"load_state_dict: {key} must be an int >= {minimum}, got {value!r}")
    return value


def _states(value, key: str) -> EpochStart:
    if not isinstance(value, dict) or set(value) != {
        "loader_generator",
        "sampler_generator",
        "global_rng",
        "sampler_epoch",
    }:
        raise ValueError(
            f"load_state_dict: {key} must be a dict of loader_generator, sampler_generator, "
            f"global_rng and sampler_epoch"
        )
    value = dict(value)
    for name in ("loader_generator", "sampler_generator", "global_rng"):
        if value[name] is not None:  # the generators a sampler draws from are CPU generators
            value[name] = check_torch_state(value[name], f"{key}.{name}")
    if value["sampler_epoch"] is not None and type(value["sampler_epoch"]) is not int:
        raise ValueError(f"load_state_dict: {key}.sampler_epoch must be None or an int")
    return EpochStart(**value)


def _worker_snapshots(snapshot) -> tuple[int, dict[int, torch.Tensor]]:
    if not isinstance(snapshot, dict) or not isinstance(snapshot.get("_main_snapshot"), dict):
        raise ValueError(
            "load_state_dict: _snapshot must be a dict with _main_snapshot and _worker_snapshots"
        )
    num_workers = _int(snapshot["_main_snapshot"], "_num_workers")
    workers = snapshot.get("_worker_snapshots")
    if not isinstance(workers, dict):
        raise ValueError('load_state_dict: _snapshot._worker_snapshots must be a dict {"worker_<id>": {...}}')
    rngs = {}
    for key, value in workers.items():
        worker = value.get("worker_id") if isinstance(value, dict) else None
        if type(worker) is int and not 0 <= worker < num_workers:
            raise ValueError(
                f"load_state_dict: _snapshot._worker_snapshots[{key!r}].worker_id must be in "
                f"[0, _num_workers={num_workers}), got {worker}"
            )
        if type(worker) is not int or key != f"worker_{worker}" or "rng_state" not in value:
            raise ValueError(
                f"load_state_dict: _snapshot._worker_snapshots[{key!r}] must be "
                '{"worker_id": <id>, "rng_state": <uint8 tensor>} under the key "worker_<id>"'
            )
        rngs[worker] = check_rng(value["rng_state"], f"worker_rng[{worker}]")
    return num_workers, rngs


def from_dict(state: dict, dataset_len: int, num_workers: int) -> tuple[ResumePoint | None, EpochStart]:
    """Check every field's type before anything is used: a checkpoint is data, never code."""
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise ValueError(
            f"load_state_dict: not a loader state (expected format {FORMAT!r}); pass what "
            "DataLoader.state_dict() returned"
        )
    if _int(state, "dataset_len") != dataset_len:
        raise ValueError(
            f"load_state_dict: the checkpoint's dataset had {state['dataset_len']} samples, "
            f"this one has {dataset_len}; resume with the same dataset"
        )
    saved_workers, worker_rng = _worker_snapshots(state.get("_snapshot"))
    if worker_rng and saved_workers != num_workers:
        # Every remaining sample still comes exactly once, in the same batches; only the workers' random
        # augmentation differs, as it does whenever torch's num_workers changes.
        warnings.warn(
            f"load_state_dict: the checkpoint used num_workers={saved_workers}, this loader "
            f"has {num_workers}: the rest of the epoch has the same samples and batches, but the "
            "workers' random augmentation follows new RNG streams",
            RuntimeWarning,
            stacklevel=3,
        )
        worker_rng = {}
    now = _states(state.get("generators_now"), "generators_now")
    if state.get("epoch_start") is None:
        return None, now
    start = _states(state["epoch_start"], "epoch_start")
    return ResumePoint(start, _int(state, "_num_yielded"), worker_rng), now
