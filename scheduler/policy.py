"""The interface every admission policy implements, and the ordered queue they share.

The scheduler asks the policy who is admitted next and who is preempted when
memory runs out, and tells it what was served; it never knows which policy runs.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Callable, Iterator

from scheduler.block_manager import BlockManager
from scheduler.request import Request

_arrivals = itertools.count()


class OrderedQueue:
    """Requests kept sorted by a key (ties by insertion order); O(n) insert is fine at these sizes."""

    def __init__(self, key: Callable[[Request], tuple]):
        self._key = key
        self._items: list[tuple[tuple, int, Request]] = []

    def push(self, request: Request) -> None:
        bisect.insort(self._items, (self._key(request), next(_arrivals), request), key=lambda e: e[:2])

    def peek(self) -> Request | None:
        return self._items[0][2] if self._items else None

    def remove(self, request: Request) -> bool:
        for i, (_, _, r) in enumerate(self._items):
            if r is request:
                del self._items[i]
                return True
        return False

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self) -> Iterator[Request]:
        return (r for _, _, r in self._items)


class Policy:
    """Admission order and preemption choice. Charges are in tokens, already weighted by the policy."""

    name = "base"

    def attach(self, block_manager: BlockManager) -> None:
        """The scheduler's block manager, given once before any add (policies that read the prefix
        cache keep it; the others ignore it)."""

    def add(self, request: Request) -> None:
        """A request enters the waiting queue: new (status WAITING), or preempted and to be
        recomputed (status PREEMPTED, already charged for its prompt)."""
        raise NotImplementedError

    def peek(self) -> Request | None:
        """The request to admit next, without removing it."""
        raise NotImplementedError

    def remove(self, request: Request) -> None:
        """Take a request out of the waiting queue (admitted or aborted)."""
        raise NotImplementedError

    def num_waiting(self) -> int:
        raise NotImplementedError

    def waiting(self) -> Iterator[Request]:
        raise NotImplementedError

    def victim(self, running: list[Request]) -> Request:
        """Which of the running requests (non-empty) to preempt when KV blocks run out."""
        raise NotImplementedError

    def displace(self, running: list[Request]) -> Request | None:
        """With the batch full (max_num_seqs), a running request to preempt so that the request peek()
        names starts now rather than at the next free slot; None (the default): it waits."""
        return None

    def charge_admission(self, request: Request) -> None:
        """Called whenever a request is admitted (again after a preemption: charge its prompt once)."""

    def charge_fork(self, parent: Request, child: Request) -> None:
        """child shares parent's computed prompt (n > 1): its prompt is not charged again, even when it
        is recomputed after a preemption."""

    def charge_output(self, request: Request, num_tokens: int = 1) -> None:
        """Called for every generated token."""

    def on_finish(self, request: Request) -> None:
        """Called when a request leaves the system (finished or aborted)."""

    def forget_tenant(self, tenant: str) -> None:
        """The tenant has no requests and has been idle longest: drop what is kept about it."""

    def counters(self) -> dict[str, float]:
        """Per-tenant virtual counters in weighted tokens (empty for policies without them); read only."""
        return {}
