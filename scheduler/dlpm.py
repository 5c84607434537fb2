"""Deficit Longest Prefix Match (after Cao et al., "Locality-aware Fair Scheduling in LLM Serving", 2025).

VTC keeps tenants fair but admits by counter alone, so tenants with long
prompts of their own take turns and evict each other's cached prefixes. DLPM
lets the cache decide the order *within* a fairness allowance:

* Each tenant has a deficit d, in weighted tokens. A tenant is eligible while
  it has waiting requests and d covers what admitting its next one (its
  longest cached match) charges now, as deficit round robin sends a packet
  only when the deficit covers it: no admission overdraws the deficit, so one
  tenant's cached prefix cannot take a burst of admissions beyond its round.
* Admission takes, among the eligible tenants' waiting requests, the one whose
  prompt has the longest prefix in the cache now (ties: earliest arrival).
* When no backlogged tenant is eligible a round begins: every backlogged
  tenant gets the quantum Q (as many rounds at once as it takes to make one
  eligible).
* Charges are VTC's: w_p per prompt token once per request at its admission,
  w_q per generated token, each divided by the tenant's weight (the key
  file's `weight`). **Cached prompt tokens are charged in full**, like
  uncached ones: the counters then measure the same service as VTC's and as
  the per-tenant service metric, so the bound below is on that service; what
  the cache saves shows up as throughput, shared by all, not as a larger
  share for the tenant whose prefix happened to be cached.
* A tenant whose queue empties keeps its deficit; coming back it is credited
  Q for each round that began while it was away, capped at Q, so idle time
  is never banked beyond one quantum and a debt is forgiven only as the
  others are served too. A preempted request returning does not count as a
  return from idle.
* Sparse tenants first (after FQ-CoDel's new-flow list, RFC 8290): a tenant
  with no request waiting that sends one is *new*, and that request goes
  before the others' (longest match among new tenants) when the tenant's
  deficit covers it. A low-rate tenant then does not wait for the
  backlogged tenants' cached prefixes to use up their round. A backlogged
  tenant always has a request waiting, so it is never new; a tenant that
  keeps its queue empty gets its requests ahead only while its deficit lasts,
  charged as any other, so it cannot take more than its share. When the batch
  is full (max_num_seqs), such a request does not wait for a slot to free: it
  takes one from the backlogged tenant with the least deficit
  (Policy.displace), whose newest running request is preempted and recomputed
  later from the prefix cache. Otherwise a low-rate tenant would wait for the
  backlogged tenants' requests, which DLPM admits together when their prefix
  is cached and which then end together.

Fairness bound. While two tenants are both backlogged they receive the same
rounds, so the difference of their weighted service over any such interval
is the difference of their deficits' changes. Let U_p = w_p x the longest
prompt / weight (the most one admission charges) and U_q = w_q x the tokens
a tenant's running requests can still generate / weight (at most
max_num_seqs x the longest max_tokens, and at most the KV pool's tokens). A
tenant's deficit stays below Q + U_p (a new tenant starts at Q, and one back
from idle at most at max(d, Q)): a round tops up only when no backlogged
tenant can pay for its next admission, by the fewest quanta that let one
pay, so every other tenant ends the top-up still short of its admission's
charge plus one quantum. It never falls below -U_q: an admission leaves d >=
0, and the running requests' output then charges at most U_q. So two
backlogged tenants' weighted service differs by at most

    2 (Q + U_p + U_q)

The step's token budget B does not enter: prompts are charged whole at
admission, however many steps their prefill takes, and decodes add at most
w_q per running request per step, all inside U_q. Q trades locality for the
bound: with Q near one request's charge DLPM serves about one request a tenant
a round, in the order the cache favours; the larger Q, the more requests one
tenant's cached prefix serves in a row.

The quantum by default (quantum None) is one request's charge, as deficit
round robin takes at least the largest packet for its quantum: the most any of
the last AUTO_WINDOW requests can be charged, w_p x prompt + w_q x max_tokens,
known when it arrives (a request without max_tokens counts its prompt then
and its output once finished). A round then serves about one request per
unit of weight whatever the requests' size, and two tenants' gap stays near
two requests' charge. Q is set before a new tenant's deficit is: a tenant that
starts under one quantum and then runs under another keeps the difference as
an offset against the others. The bound holds with Q the largest quantum used
(max_quantum).

Admission costs O(backlogged tenants + log waiting): one heap top per
eligible tenant (PrefixIndex), kept current by cache events rather than by
looking up blocks.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterator

from scheduler.block_manager import BlockManager
from scheduler.policy import Policy
from scheduler.prefix_index import PrefixIndex
from scheduler.request import Request, RequestStatus

AUTO_WINDOW = 64
"""Requests whose largest charge is the default quantum."""


class DLPMPolicy(Policy):
    name = "dlpm"

    def __init__(
        self, quantum: float | None = None, prompt_token_weight: float = 1.0, output_token_weight: float = 2.0
    ):
        """quantum None: one request's charge, the most any of the last requests can be charged (module
        docstring)."""
        if quantum is not None and not quantum > 0:
            raise ValueError(f"dlpm_quantum: must be positive, got {quantum!r}")
        self.auto = quantum is None
        self.quantum = 0.0 if quantum is None else float(quantum)
        """Q now, in weighted tokens (auto: 0 until the first request is seen)."""
        self.max_quantum = self.quantum
        """The largest Q used so far: the bound's."""
        self._recent: deque[float] = deque(maxlen=AUTO_WINDOW)
        """The last requests' largest charges (the default quantum's window)."""
        self.w_p = prompt_token_weight
        self.w_q = output_token_weight
        self._index = PrefixIndex()
        self._deficits: dict[str, float] = {}
        """Weighted tokens each known tenant may still be served this round (<= 0: not eligible)."""
        self._service: dict[str, float] = {}
        """Weighted tokens served per tenant (what counters() reports, as VTC's counters)."""
        self._rounds = 0
        """Rounds begun so far."""
        self._left_at: dict[str, int] = {}
        """Round in which a tenant's queue last emptied."""
        self._charged: set[str] = set()
        self._live: dict[str, set[str]] = {}
        """Ids of each tenant's requests in the system (waiting or running)."""
        self._new: set[str] = set()
        """Tenants whose one waiting request came to an empty queue: admitted before the others' (see above)."""

    def attach(self, block_manager: BlockManager) -> None:
        self._index.attach(block_manager)

    # ---- waiting queue --------------------------------------------------------------------------

    def add(self, request: Request) -> None:
        if self.auto and request.status != RequestStatus.PREEMPTED:
            most = request.sampling_params.max_tokens or 0
            self._observe(self.w_p * request.num_prompt_tokens + self.w_q * most)
        tenant = request.tenant
        self._service.setdefault(tenant, 0.0)
        self._live.setdefault(tenant, set()).add(request.request_id)
        sparse = not self._index.has(tenant) and request.status != RequestStatus.PREEMPTED
        if not self._index.has(tenant):
            d = self._deficits.get(tenant)
            if d is None:
                d = self.quantum  # a new tenant starts with one round's allowance
            elif request.status != RequestStatus.PREEMPTED:
                away = self._rounds - self._left_at.get(tenant, self._rounds)
                d = min(d + away * self.quantum, max(d, self.quantum))
            self._deficits[tenant] = d
        if sparse and self._deficits[tenant] > 0:
            self._new.add(tenant)
        self._index.add(request, tenant, request.arrival_time)

    def peek(self) -> Request | None:
        index = self._index
        if not len(index):
            return None
        deficits = self._deficits
        for tenants in (self._new, index.groups(), None, index.groups()):
            if tenants is None:  # no backlogged tenant is eligible
                self._new_round()
                continue
            best, best_key = None, None
            for tenant in tenants:
                if deficits[tenant] >= self._price(index.longest(tenant)):
                    match, seq = index.longest_match(tenant)
                    if (
                        best_key is None
                        or match > best_key[0]
                        or (match == best_key[0] and seq < best_key[1])
                    ):
                        best, best_key = tenant, (match, seq)
            if best is not None:
                return index.longest(best)
        raise AssertionError("a round left no backlogged tenant eligible")

    def _new_round(self) -> None:
        """Top up every backlogged tenant by the fewest quanta that make one of them eligible."""
        deficits = self._deficits
        backlogged = list(self._index.groups())
        need = min(self._price(self._index.longest(t)) - deficits[t] for t in backlogged)  # > 0
        rounds = max(1, math.ceil(need / self.quantum))  # the least k with k Q >= need
        self._rounds += rounds
        for tenant in backlogged:
            deficits[tenant] += rounds * self.quantum

    def remove(self, request: Request) -> None:
        if self._index.remove(request):
            self._new.discard(request.tenant)
            if not self._index.has(request.tenant):
                self._left_at[request.tenant] = self._rounds

    def num_waiting(self) -> int:
        return len(self._index)

    def waiting(self) -> Iterator[Request]:
        return self._index.requests()

    def cached_match(self, request: Request) -> int:
        """Full blocks of a waiting request's prompt that the prefix cache holds now."""
        return self._index.match(request)

    def _price(self, request: Request) -> float:
        """What admitting the request charges its tenant now: its prompt, once (0 for a preempted one)."""
        if request.request_id in self._charged:
            return 0.0
        return self.w_p * request.num_prompt_tokens / request.weight

    # ---- service accounting ---------------------------------------------------------------------

    def charge_admission(self, request: Request) -> None:
        if request.request_id not in self._charged:
            self._charged.add(request.request_id)
            self._charge(request, self.w_p * request.num_prompt_tokens / request.weight)

    def charge_fork(self, parent: Request, child: Request) -> None:
        self._charged.add(child.request_id)

    def charge_output(self, request: Request, num_tokens: int = 1) -> None:
        self._charge(request, self.w_q * num_tokens / request.weight)

    def _charge(self, request: Request, amount: float) -> None:
        tenant = request.tenant
        self._deficits[tenant] -= amount
        self._service[tenant] += amount

    def _observe(self, charge: float) -> None:
        """The default quantum: the largest charge of the window's requests."""
        self._recent.append(charge)
        self.quantum = max(max(self._recent), 1.0)
        self.max_quantum = max(self.max_quantum, self.quantum)

    def on_finish(self, request: Request) -> None:
        if self.auto and request.request_id in self._charged and request.sampling_params.max_tokens is None:
            self._observe(self.w_p * request.num_prompt_tokens + self.w_q * request.num_output_tokens)
        self._charged.discard(request.request_id)
        live = self._live.get(request.tenant)
        if live is not None:
            live.discard(request.request_id)

    def forget_tenant(self, tenant: str) -> None:
        if not self._index.has(tenant) and not self._live.get(tenant):
            self._deficits.pop(tenant, None)
            self._service.pop(tenant, None)
            self._left_at.pop(tenant, None)
            self._live.pop(tenant, None)

    def displace(self, running: list[Request]) -> Request | None:
        """A sparse tenant's request (see the module docstring) that finds the batch full takes a slot
        from the backlogged tenant served furthest ahead (least deficit), whose newest running request
        goes back to its queue (recomputed later, its full blocks still in the prefix cache). Only while
        the sparse tenant has nothing running and its deficit lasts: it gets one slot, not more."""
        head = self.peek()
        if head is None or head.tenant not in self._new:
            return None
        tenant = head.tenant
        if any(r.tenant == tenant for r in running):
            return None
        candidates = [r for r in running if not r.forks and self._index.has(r.tenant)]
        return self.victim(candidates) if candidates else None

    def victim(self, running: list[Request]) -> Request:
        """The newest running request of the tenant with the least deficit (served furthest ahead)."""
        deficits = self._deficits
        return max(running, key=lambda r: (-deficits.get(r.tenant, 0.0), r.arrival_time))

    def counters(self) -> dict[str, float]:
        return self._service

    def deficits(self) -> dict[str, float]:
        """Per-tenant deficits in weighted tokens; read only."""
        return self._deficits
