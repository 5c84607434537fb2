"""The prefetcher's part in the peer exchange (exchange.py): per window of plan positions it
asks the other ranks for what this node does not hold; what no peer holds, and everything
after a peer is lost, goes to the prefetcher's storage readers (prefetch_reads.py).

A mixin of Prefetcher (prefetch.py): it runs on the coordinator thread with the
prefetcher's lock held, and reads and writes the prefetcher's state.
"""

from __future__ import annotations

import logging

from loader.cache.ram import PEER_READS
from loader.peers.exchange import PeerExchange, PeerFailure

log = logging.getLogger("loader")


class PeerWindows:
    def rejoin(self, peers: PeerExchange | None) -> None:
        """The exchange among the survivors of a loss (None: storage alone from now on)."""
        with self.lock:
            self.peers = peers

    def _exchange(self) -> bool:
        peers = self.peers
        if peers is None:
            return False
        try:
            return self._exchange_step(peers)
        except PeerFailure as failure:
            self._lose_peers(failure)
            return True

    def _lose_peers(self, failure: PeerFailure) -> None:
        """Leave the exchange for good: what was asked of the peers, and all later reads, go to
        storage (or this rank's own cache)."""
        self.peers, self.peers_lost, self.lost = None, str(failure), failure
        self.peer_failures += 1
        self.holdings.home = None  # nobody will ask for them: cache for this rank alone again
        log.warning(
            "prescient loader, rank %d: peer exchange failed, %s; reading from storage instead "
            "until the others regroup at the next epoch",
            failure.rank,
            failure,
        )
        for index in self._asked:
            if index in self.inflight and index not in self.results:
                self.requests.put(index)
        self._asked = []

    def _exchange_step(self, peers: PeerExchange) -> bool:
        if peers.busy:
            received = peers.poll(self.holdings.copy_of, self.size_rule)
            if received is None:
                return False
            for index, raw in received.items():
                if index in self.inflight and index not in self.results:
                    self.results[index] = raw
                    self.shared.counters[0, PEER_READS] += 1
            for index in self._asked:
                if index not in received:
                    self.requests.put(index)  # no peer holds it: storage
            self._asked = []
            return True
        size = peers.window
        windows = -(-max(len(self.stream), self.longest or 0) // size)
        start = self.windows_started * size
        if self.windows_started >= windows or self.sched < min(start, len(self.stream)) - size:
            return False
        needs = []
        for index in dict.fromkeys(self.stream[start : start + size].tolist()):
            if not (index in self.inflight or self.holdings.has(index)):
                estimate = self.source.nbytes(index) or self._average()
                self.inflight[index] = estimate
                self.inflight_bytes += estimate
                needs.append(index)
        self._asked = needs
        self.windows_started += 1
        peers.start(needs)
        return True
