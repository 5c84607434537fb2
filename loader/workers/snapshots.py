"""Each worker's RNG state where a resumed run's worker of the same id must start (the
`_worker_snapshots` of state_dict, see resume.py and the protocol note in clairvoyant.py).

Workers store an RNG snapshot in shared memory at the start of each batch (slot batch %
snap_ring) and, near the epoch's end or at exit, after their last batch (slot snap_ring + w).
state_dict() picks, for each worker, the snapshot its upcoming batch starts from, waiting a
little for a worker that has not started it yet.
"""

from __future__ import annotations

import time

import torch

from loader.cache.ram import SharedState

SNAPSHOT_WAIT_SECONDS = 30.0
FALLBACK_SECONDS = 0.5  # how long to wait for a start-of-batch snapshot before using the end of the
# worker's previous batch


def worker_snapshots(
    epoch, shared: SharedState | None, snap_ring: int, workers: int, in_order: bool
) -> dict[int, torch.Tensor]:
    """Each worker's RNG state where a resumed run's worker of the same id must start."""
    if workers == 0 or epoch is None or shared is None:
        return {}
    if not in_order:
        raise ValueError(
            "state_dict: an exact resume needs in_order=True (with in_order=False the "
            "assignment of batches to workers is not reproducible)"
        )
    done, total = epoch.yielded, epoch.num_batches or len(epoch.batch_first)
    snapshots = {}
    for worker in range(workers):
        upcoming = [b for b in range(done, min(done + workers, total)) if b % workers == worker]
        if upcoming:
            batch = upcoming[0]
            slot, end = batch % snap_ring, False
        else:
            earlier = [b for b in range(max(0, done - workers), done) if b % workers == worker]
            if not earlier or earlier[-1] < epoch.skipped:
                continue  # this worker had no batch this epoch
            batch, slot, end = earlier[-1], snap_ring + worker, True
        # The worker's RNG state when its previous batch ended is the same state: the fallback when
        # the worker never starts the upcoming batch (non-persistent workers stop as soon as the
        # training loop breaks out and drops the iterator).
        previous = batch - workers if not end and batch - workers >= epoch.skipped else None
        started = time.monotonic()
        deadline = started + SNAPSHOT_WAIT_SECONDS
        while True:
            if batch < len(epoch.batch_first):
                payload = shared.get_snapshot(slot, epoch.pos0 + epoch.batch_first[batch] + 1)
                if payload is None and previous is not None and time.monotonic() - started > FALLBACK_SECONDS:
                    payload = shared.get_snapshot(
                        snap_ring + worker, epoch.pos0 + epoch.batch_first[previous] + 1
                    )
                if payload is not None:
                    snapshots[worker] = payload
                    break
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"state_dict: worker {worker} did not {'finish' if end else 'start'} "
                    f"batch {batch} within {SNAPSHOT_WAIT_SECONDS:.0f} s"
                )
            time.sleep(0.001)
    return snapshots
