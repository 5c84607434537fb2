"""Longest prefix match (SGLang's cache-aware order): admit the waiting request whose prompt has the
longest prefix in the cache now, ties by arrival; preempt the newest running request.

It keeps the cache warm and ignores tenants altogether, so one tenant whose prefix is cached can be
served while the others starve: the locality end of the trade DLPM (scheduler/dlpm.py) bounds.
"""

from __future__ import annotations

from collections.abc import Iterator

from scheduler.block_manager import BlockManager
from scheduler.policy import Policy
from scheduler.prefix_index import PrefixIndex
from scheduler.request import Request

_ALL = None  # one group for every request


class LPMPolicy(Policy):
    name = "lpm"

    def __init__(self) -> None:
        self._index = PrefixIndex()

    def attach(self, block_manager: BlockManager) -> None:
        self._index.attach(block_manager)

    def add(self, request: Request) -> None:
        self._index.add(request, _ALL, request.arrival_time)

    def peek(self) -> Request | None:
        return self._index.longest(_ALL)

    def remove(self, request: Request) -> None:
        self._index.remove(request)

    def num_waiting(self) -> int:
        return len(self._index)

    def waiting(self) -> Iterator[Request]:
        return self._index.requests()

    def victim(self, running: list[Request]) -> Request:
        return max(running, key=lambda r: r.arrival_time)
