"""First come, first served: admit by arrival; preempt the newest running request."""

from __future__ import annotations

from scheduler.policy import OrderedQueue, Policy
from scheduler.request import Request


class FCFSPolicy(Policy):
    name = "fcfs"

    def __init__(self) -> None:
        self._queue = OrderedQueue(key=self.order)

    @staticmethod
    def order(request: Request) -> tuple:
        return (request.arrival_time,)

    def add(self, request: Request) -> None:
        self._queue.push(request)

    def peek(self) -> Request | None:
        return self._queue.peek()

    def remove(self, request: Request) -> None:
        self._queue.remove(request)

    def num_waiting(self) -> int:
        return len(self._queue)

    def waiting(self):
        return iter(self._queue)

    def victim(self, running: list[Request]) -> Request:
        return max(running, key=self.order)
