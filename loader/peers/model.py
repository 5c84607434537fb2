"""Storage and network bytes per epoch for a cluster, computed from the plan alone.

No data and no processes: every rank's DistributedSampler stream comes from the seed
(peer_plan.epoch_streams, one permutation per epoch), the homes from the first epoch, and
each rank keeps as many of its home samples as its cache holds. Then per epoch:
  storage: epoch 1 reads each rank's samples (a padding duplicate counts on both ranks);
           later, the samples whose home could not keep them
  network: the samples a rank needs that another rank keeps (the peer exchange's payload)
The model leaves out what a rank's leftover cache keeps of other ranks' samples, which
only saves network bytes: its network figure is an upper bound on the loader's, and its
storage figure is what the loader reads (the torchrun test checks both on 4 ranks).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from loader.plan.ranks import epoch_streams, home_ranks


@dataclass(frozen=True)
class EpochTraffic:
    epoch: int  # 1-based
    storage_reads: int
    peer_reads: int  # samples received from another rank
    storage_bytes: int
    network_bytes: int


def kept_home(streams: np.ndarray, home: np.ndarray, capacity_samples: int) -> np.ndarray:
    """bool[n]: home samples their rank keeps (the first it reads, up to its capacity)."""
    kept = np.zeros(len(home), dtype=bool)
    for rank, stream in enumerate(streams):
        mine = stream[home[stream] == rank]
        _, first = np.unique(mine, return_index=True)
        kept[mine[np.sort(first)][:capacity_samples]] = True
    return kept


def traffic(
    n: int,
    sample_bytes: int,
    world: int,
    cache_bytes_per_rank: int,
    epochs: int,
    seed: int = 0,
    shuffle: bool = True,
    drop_last: bool = False,
) -> list[EpochTraffic]:
    """Per epoch, what `world` ranks with peer exchange read from storage and send each other."""
    first = epoch_streams(n, world, seed, 0, shuffle, drop_last)
    home = home_ranks(first, n)
    kept = kept_home(first, home, cache_bytes_per_rank // sample_bytes)
    ranks = np.arange(world)[:, None]
    out = []
    for epoch in range(epochs):
        streams = first if epoch == 0 else epoch_streams(n, world, seed, epoch, shuffle, drop_last)
        if epoch == 0:
            storage, peer = sum(len(np.unique(s)) for s in streams), 0
        else:
            own = (home[streams] == ranks) & kept[streams]
            from_peer = ~own & kept[streams]
            storage, peer = int((~kept[streams]).sum()), int(from_peer.sum())
        out.append(EpochTraffic(epoch + 1, storage, peer, storage * sample_bytes, peer * sample_bytes))
    return out
