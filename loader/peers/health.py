"""Which rank a peer exchange is waiting on, from heartbeats in torch.distributed's store.

A window's collectives pair up only when every rank joins them, and a collective that
fails or times out says nothing about who did not come. So each rank's prefetcher writes
a heartbeat to the store the ranks rendezvoused through (under torchrun it lives in the
launcher's agent, so it survives any rank): the window it last started and the time. When
a window fails, the rank names the others whose heartbeat stopped (the process died or is
stopped), whose window count is behind (its training loop stalled), or that left the
exchange themselves. A rank that received bad data from a peer (exchange.py checks sizes
and checksums) names that peer in the store, so every rank counts it at fault, the peer
itself included. Only ints, times and those short reasons cross the store; no pickle.
"""

from __future__ import annotations

import itertools
import time

BEAT_SECONDS = 1.0  # how often a live rank refreshes its heartbeat
STALE_SECONDS = 3.0  # a heartbeat older than this: the rank's process is gone or stopped
LEFT = -1  # window count of a rank that gave up on the exchange

_loaders = itertools.count()  # loaders with peer exchange built in this process, in order


def default_store():
    """The store of the default process group, or None where it cannot be reached."""
    try:
        from torch.distributed import distributed_c10d

        return distributed_c10d._get_default_store()
    except Exception:  # noqa: BLE001 - heartbeats only improve the message
        return None


def loader_prefix() -> str:
    """Store keys of the next loader built with peer exchange in this process. All ranks build
    their loaders in the same order, so the n-th loader's keys agree across ranks."""
    return f"prescient/loader{next(_loaders)}"


class PeerHealth:
    def __init__(self, store, prefix: str, members: list[int], rank: int):
        """`members`: the global ranks in the exchange's group, in group order; `rank`: this
        process's index among them. Messages name global ranks."""
        self.store, self.members, self.rank, self.world = store, members, rank, len(members)
        self.prefix = f"{prefix}/beat/"
        self.bad_prefix = f"{prefix}/bad/"  # + rank: why a peer found that rank's data bad
        self.window = 0
        self.last_beat = 0.0
        self.suspects: list[int] = []  # global ranks found at fault by the last culprits()

    def beat(self, window: int | None = None, force: bool = False) -> None:
        if window is not None:
            self.window, force = window, True
        now = time.time()
        if self.store is None or (not force and now - self.last_beat < BEAT_SECONDS):
            return
        self.last_beat = now
        try:
            self.store.set(f"{self.prefix}{self.rank}", f"{self.window} {now:.3f}")
        except Exception:  # noqa: BLE001 - a store that went away leaves the message vaguer
            self.store = None

    def leave(self) -> None:
        self.beat(LEFT)

    def accuse(self, rank: int, why: str) -> None:
        """Record that `rank` (an index among the members) sent bad data, and why."""
        if self.store is None:
            return
        try:
            self.store.set(f"{self.bad_prefix}{rank}", why[:200])
        except Exception:  # noqa: BLE001 - the exchange is left anyway; only the regroup is less precise
            self.store = None

    def _accused(self, rank: int) -> str | None:
        key = f"{self.bad_prefix}{rank}"
        return self.store.get(key).decode() if self.store.check([key]) else None

    def accusation(self, rank: int) -> str | None:
        """Why a peer found `rank`'s data bad, as it recorded it; None if none did (or no store)."""
        if self.store is None:
            return None
        try:
            return self._accused(rank)
        except Exception:  # noqa: BLE001 - only the message is less precise
            return None

    def _read(self, rank: int) -> tuple[int, float] | None:
        key = f"{self.prefix}{rank}"
        if not self.store.check([key]):
            return None
        window, at = self.store.get(key).decode().split()
        return int(window), float(at)

    def culprits(self, wait: float = STALE_SECONDS + BEAT_SECONDS) -> str:
        """Who this rank is waiting on, in words; looks for up to `wait` seconds, since a rank
        that just died still has a fresh heartbeat."""
        self.suspects = []
        if self.store is None:
            return "the rank could not be identified (no torch.distributed store)"
        deadline = time.monotonic() + wait
        while True:
            try:
                found = self._look()
            except Exception:  # noqa: BLE001
                return "the rank could not be identified (the store did not answer)"
            settled = any(word in found for word in ("stopped answering", "fell behind", "sent bad data"))
            if settled or time.monotonic() > deadline:
                return found or f"no rank identified (all had started window {self.window})"
            time.sleep(0.1)

    def _look(self) -> str:
        now = time.time()
        silent, behind, left, bad = [], [], [], {}
        for rank in range(self.world):
            why = self._accused(rank)
            if why is not None:  # this rank too: a rank found sending bad data is left out
                bad[rank] = why
                continue
            if rank == self.rank:
                continue
            beat = self._read(rank)
            if beat is not None and beat[0] == LEFT:
                left.append(rank)
            elif beat is None or now - beat[1] > STALE_SECONDS:
                silent.append(rank)
            elif beat[0] < self.window:
                behind.append(rank)
        self.suspects = [self.members[r] for r in silent + behind + list(bad)]
        parts = [f"rank {self.members[r]} sent bad data ({why})" for r, why in bad.items()]
        silent, behind, left = ([self.members[r] for r in ranks] for ranks in (silent, behind, left))
        if silent:
            parts.append(f"rank {_names(silent)} stopped answering (process dead or stopped)")
        if behind:
            parts.append(f"rank {_names(behind)} fell behind (its training loop stalled)")
        if left:
            parts.append(f"rank {_names(left)} had already left the exchange")
        return "; ".join(parts)


def _names(ranks: list[int]) -> str:
    return ", ".join(str(r) for r in ranks)
