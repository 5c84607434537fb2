"""Virtual Token Counter fair scheduling (Sheng et al., "Fairness in Serving Large Language Models", OSDI 2024).

Each tenant has a counter of the service it received, in weighted tokens:
w_p per prompt token when a request is admitted (prefix-cache hits included:
they are the tenant's service too), w_q per generated token, each divided by
the tenant's weight. Admission always takes the oldest request of the
backlogged tenant with the smallest counter. A tenant whose queue goes from
empty to non-empty is lifted to the smallest counter among backlogged tenants
(or, if none, to the counter of the tenant served last), so idle time is not
banked as credit. Then two backlogged tenants' weighted service never differs
by more than 2U, U = max(w_p x longest prompt, w_q x tokens that fit in a batch).
"""

from __future__ import annotations

from collections.abc import Iterator

from scheduler.policy import OrderedQueue, Policy
from scheduler.request import Request, RequestStatus


def _by_arrival(request: Request) -> tuple:
    return (request.arrival_time,)


class VTCPolicy(Policy):
    name = "vtc"

    def __init__(self, prompt_token_weight: float = 1.0, output_token_weight: float = 2.0):
        self.w_p = prompt_token_weight
        self.w_q = output_token_weight
        self._counters: dict[str, float] = {}
        """Weighted tokens served per tenant (every tenant ever seen)."""
        self._queues: dict[str, OrderedQueue] = {}
        """Waiting requests of the backlogged tenants only, so picking is O(backlogged tenants)."""
        self._waiting = 0
        self._last_served: str | None = None
        self._charged: set[str] = set()
        """Ids of admitted requests whose prompt has been charged (a recompute is not charged again)."""

    # ---- waiting queue --------------------------------------------------------------------------

    def add(self, request: Request) -> None:
        tenant = request.tenant
        self._counters.setdefault(tenant, 0.0)
        queue = self._queues.get(tenant)
        if queue is None:
            # The tenant becomes backlogged. A preempted request coming back is not a return
            # from idle: the tenant was being served, so its counter stays where it is.
            if request.status != RequestStatus.PREEMPTED:
                self._lift(tenant)
            queue = self._queues[tenant] = OrderedQueue(_by_arrival)
        queue.push(request)
        self._waiting += 1

    def _lift(self, tenant: str) -> None:
        if self._queues:
            floor = min(self._counters[t] for t in self._queues)
        elif self._last_served is not None:
            floor = self._counters[self._last_served]
        else:
            return
        if floor > self._counters[tenant]:
            self._counters[tenant] = floor

    def peek(self) -> Request | None:
        if not self._queues:
            return None
        counters = self._counters
        tenant = min(self._queues, key=counters.__getitem__)  # ties: the tenant backlogged first
        return self._queues[tenant].peek()

    def remove(self, request: Request) -> None:
        queue = self._queues.get(request.tenant)
        if queue is not None and queue.remove(request):
            self._waiting -= 1
            if not len(queue):
                del self._queues[request.tenant]

    def num_waiting(self) -> int:
        return self._waiting

    def waiting(self) -> Iterator[Request]:
        for queue in self._queues.values():
            yield from queue

    # ---- service accounting ---------------------------------------------------------------------

    def charge_admission(self, request: Request) -> None:
        if request.request_id not in self._charged:
            self._charged.add(request.request_id)
            self._counters[request.tenant] += self.w_p * request.num_prompt_tokens / request.weight
        self._last_served = request.tenant

    def charge_fork(self, parent: Request, child: Request) -> None:
        self._charged.add(child.request_id)

    def charge_output(self, request: Request, num_tokens: int = 1) -> None:
        self._counters[request.tenant] += self.w_q * num_tokens / request.weight
        self._last_served = request.tenant

    def on_finish(self, request: Request) -> None:
        self._charged.discard(request.request_id)

    def forget_tenant(self, tenant: str) -> None:
        # Safe for fairness: a tenant coming back from idle is lifted to the backlogged minimum anyway.
        if tenant not in self._queues and tenant != self._last_served:
            self._counters.pop(tenant, None)

    def victim(self, running: list[Request]) -> Request:
        """The newest running request of the tenant furthest ahead (largest counter)."""
        counters = self._counters
        return max(running, key=lambda r: (counters[r.tenant], r.arrival_time))

    def counters(self) -> dict[str, float]:
        return self._counters
