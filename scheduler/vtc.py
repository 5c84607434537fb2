"""Virtual Token Counter fair scheduling (Sheng et al., "Fairness in Serving Large Language Models", OSDI 2024).

Each tenant has a counter of the service it received, in weighted tokens:
w_p per prompt token when a request is admitted, w_q per generated token,
divided by the tenant's weight. Admission always serves the backlogged tenant
with the smallest counter. A tenant whose queue goes from empty to non-empty
is lifted to the smallest counter among backlogged tenants (or, if none, to
the counter of the tenant served last), so idle time is not banked as credit.
Then two backlogged tenants' weighted service never differs by more than 2U,
U = max(w_p x longest prompt, w_q x tokens that fit in a batch).
"""
from __future__ import annotations

from collections import defaultdict

from scheduler.policy import OrderedQueue, Policy
from scheduler.request import Request


class VTCPolicy(Policy):
    name = "vtc"

    def __init__(self, prompt_token_weight: float = 1.0, output_token_weight: float = 2.0):
        self.w_p = prompt_token_weight
        self.w_q = output_token_weight
        self._counters: dict[str, float] = defaultdict(float)
        self._queues: dict[str, OrderedQueue] = {}
        self._waiting = 0
        self._last_served: str | None = None
        self._charged: set[str] = set()   # request ids charged for their prompt

    # ---- waiting queue --------------------------------------------------------------------------

    def add(self, request: Request) -> None:
        tenant = request.tenant
        queue = self._queues.get(tenant)
        if queue is None or not len(queue):
            self._lift(tenant)
            if queue is None:
                queue = self._queues[tenant] = OrderedQueue(key=lambda r: (r.arrival_time,))
        queue.push(request)
        self._waiting += 1

    def _lift(self, tenant: str) -> None:
        backlogged = [self._counters[t] for t, q in self._queues.items() if len(q) and t != tenant]
        if backlogged:
            floor = min(backlogged)
        elif self._last_served is not None and self._last_served != tenant:
            floor = self._counters[self._last_served]
        else:
            return
        self._counters[tenant] = max(self._counters[tenant], floor)

    def _next_tenant(self) -> str | None:
        best = None
        for tenant, queue in self._queues.items():
            if len(queue) and (best is None or self._counters[tenant] < self._counters[best]):
                best = tenant
        return best

    def peek(self) -> Request | None:
        tenant = self._next_tenant()
        return None if tenant is None else self._queues[tenant].peek()

    def remove(self, request: Request) -> None:
        queue = self._queues.get(request.tenant)
        if queue is not None and queue.remove(request):
            self._waiting -= 1

    def num_waiting(self) -> int:
        return self._waiting

    def waiting(self):
        for queue in self._queues.values():
            yield from queue

    # ---- service accounting ---------------------------------------------------------------------

    def charge_admission(self, request: Request) -> None:
        # Recomputing a preempted request is not new service: its prompt is charged once.
        if request.request_id not in self._charged:
            self._charged.add(request.request_id)
            self._counters[request.tenant] += self.w_p * request.num_prompt_tokens / request.weight
        self._last_served = request.tenant

    def charge_output(self, request: Request, num_tokens: int = 1) -> None:
        self._counters[request.tenant] += self.w_q * num_tokens / request.weight
        self._last_served = request.tenant

    def on_finish(self, request: Request) -> None:
        self._charged.discard(request.request_id)

    def victim(self, running: list[Request]) -> Request:
        """The newest running request of the tenant furthest ahead (largest counter)."""
        return max(running, key=lambda r: (self._counters[r.tenant], r.arrival_time))

    def counters(self) -> dict[str, float]:
        return dict(self._counters)
