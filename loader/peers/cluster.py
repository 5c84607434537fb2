"""The ranks in a loader's peer exchange: the first group, the home of every sample, and
the smaller group the survivors form after they lost a rank.

A rank that leaves the exchange mid-epoch (see exchange.py) reads the rest of that epoch
from storage. At the next epoch's start the survivors regroup: the first of them to
propose a membership in the store (every rank but the ones found at fault) fixes it for
all (compare-and-set), the members build a new gloo group among themselves only
(`use_local_synchronization`: the lost rank is not asked), and the lost ranks' home
samples get new homes among the members, round robin. From then on only those samples
are read from storage again, once, by their new homes. A rank left out (it was the one
stopped, and came back) keeps reading storage alone.
"""

from __future__ import annotations

from datetime import timedelta

import numpy as np
import torch.distributed as dist

from loader.peers.exchange import PeerExchange
from loader.peers.health import default_store, loader_prefix
from loader.plan.ranks import home_ranks_for


def rehome(home: np.ndarray, members: list[int]) -> np.ndarray:
    """Samples whose home is not a member any more go to the members, round robin by index."""
    lost = ~np.isin(home, members)
    moved = home.copy()
    moved[lost] = np.asarray(members, dtype=np.int64)[np.flatnonzero(lost) % len(members)]
    return moved


class PeerCluster:
    def __init__(self, window: int, timeout: float):
        self.window, self.timeout = window, timeout  # samples per window; seconds a phase may wait
        self.prefix = loader_prefix()
        self.me = dist.get_rank()
        self.members = list(range(dist.get_world_size()))  # global ranks, in group order
        self.generation = 0
        # All ranks build the loader together; the loader's collectives get their own group, whose
        # timeout ends a collective a dead or stalled peer never joins (see exchange.py).
        self.group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout))
        self.home: np.ndarray | None = None  # the global rank that keeps each sample

    def exchange(self) -> PeerExchange:
        prefix = f"{self.prefix}/gen{self.generation}"
        return PeerExchange(self.group, self.window, self.timeout, prefix, self.members)

    def homes(self, index_sampler, n: int) -> np.ndarray:
        """bool[n]: the samples this rank keeps for the others (decided at the first planned epoch)."""
        if self.home is None:
            self.home = home_ranks_for(index_sampler, n, len(self.members))
        return self.home == self.me

    def regroup(self, suspects: list[int]) -> PeerExchange | None:
        """After a loss, at an epoch's start: the exchange among the survivors, or None when this
        rank is left out or no group could be formed (then it reads storage alone)."""
        store = default_store()
        if store is None:
            return None
        proposal = ",".join(str(r) for r in self.members if r not in suspects)
        key = f"{self.prefix}/gen{self.generation + 1}/members"
        try:
            agreed = [int(r) for r in store.compare_set(key, "", proposal).decode().split(",")]
        except Exception:  # noqa: BLE001 - no store: no regrouping
            return None
        self.generation += 1
        if self.me not in agreed or len(agreed) < 2:
            return None
        try:
            group = dist.new_group(
                agreed,
                timeout=timedelta(seconds=self.timeout),
                backend="gloo",
                use_local_synchronization=True,
            )
        except Exception:  # noqa: BLE001 - a member that never came: storage alone
            return None
        self.members, self.group = agreed, group
        if self.home is not None:
            self.home = rehome(self.home, agreed)
        return self.exchange()
