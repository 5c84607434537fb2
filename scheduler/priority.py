"""Priority scheduling: lower `priority` first, then arrival; preempt the least urgent, newest request."""

from __future__ import annotations

from scheduler.fcfs import FCFSPolicy
from scheduler.request import Request


class PriorityPolicy(FCFSPolicy):
    name = "priority"

    @staticmethod
    def order(request: Request) -> tuple:
        return (request.priority, request.arrival_time)
