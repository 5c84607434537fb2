"""Several replicas behind a router, simulated: the real Scheduler and BlockManager of each replica, time
from a cost model instead of a model.

Each replica steps when it has work; a step's time is
    step_s + prefill_token_s x (prompt tokens computed) + decode_seq_s x (sequences decoding)
(the figures come from the engine, see bench_fair_locality.measure_cost_model). Requests come from closed-
loop clients (a client sends its next request when the last one ends) and from open-loop Poisson tenants.

Routers:
  round-robin       each request to the next replica in turn (a Kubernetes Service)
  prefix affinity   to the replica whose cache holds the longest prefix of the request (ties: the least
                    loaded), as the InferencePool endpoint picker's prefix scorer does
                    (both run `baseline_policy` on the replicas: fcfs, as vLLM does, or vtc)
  d2lpm             the router keeps the requests and a deficit per tenant (the quantum Q per round, as
                    DLPM on one server); a replica pulls when it has no request waiting, and takes, among
                    the tenants whose deficit is positive (a tenant back from idle first), the request
                    with the longest prefix in *that replica's* cache. Replicas run dlpm. Load balances
                    because replicas pull; fairness is global because deficits are; locality because each
                    replica picks what it has cached.
"""

from __future__ import annotations

import heapq
import itertools
import random
from collections import deque
from dataclasses import dataclass, field

from scheduler import Request, SamplingParams, Scheduler, SchedulerConfig

W_P, W_Q = 1.0, 2.0


@dataclass
class CostModel:
    step_s: float
    """Fixed time of one step (seconds)."""
    prefill_token_s: float
    """Per prompt token computed in the step."""
    decode_seq_s: float
    """Per sequence decoding one token in the step."""

    def step_time(self, plan) -> float:
        prefill = decode = 0
        for r, n in plan.scheduled:
            if r.num_output_tokens and n == 1 and r.num_computed_tokens == r.num_tokens - 1:
                decode += 1
            else:
                prefill += n
        return self.step_s + self.prefill_token_s * prefill + self.decode_seq_s * decode


@dataclass
class TenantLoad:
    name: str
    weight: float
    prefix: list[int]
    suffix: int
    output: int
    clients: int = 0
    """Closed-loop clients (0: open loop at `rate`)."""
    rate: float = 0.0
    """Requests per second, Poisson (open loop)."""


@dataclass
class Outcome:
    tenant: str
    arrival: float
    dispatched: float | None = None
    """When the router handed it to a replica."""
    first_token: float | None = None
    end: float | None = None
    prompt: int = 0
    output: int = 0


@dataclass
class SimResult:
    router: str
    outcomes: list[Outcome]
    service: dict[str, list[tuple[float, float]]]
    """Per tenant: (time, weighted service so far), at every change."""
    backlogged: dict[str, list[tuple[float, bool]]]
    prefix_hits: int = 0
    prefix_queries: int = 0
    duration: float = 0.0
    per_replica_tokens: list[int] = field(default_factory=list)


class _Replica:
    def __init__(self, config: SchedulerConfig):
        self.sched = Scheduler(config)
        self.next_step: float | None = None  # when its next step starts (None: idle)
        self.tokens = 0

    @property
    def load(self) -> int:
        return self.sched.num_running + self.sched.num_waiting


class _GlobalDeficits:
    """The router's side of d2lpm: requests per tenant, deficits, rounds, the new-tenant tier."""

    def __init__(self, quantum: float, weights: dict[str, float]):
        self.quantum = quantum
        self.weights = weights
        self.queues: dict[str, deque[Request]] = {}
        self.deficit = {t: quantum for t in weights}
        self.live = {t: 0 for t in weights}
        self.new: set[str] = set()

    def add(self, request: Request) -> None:
        t = request.tenant
        if t not in self.queues:  # sparse: its queue was empty (as DLPMPolicy)
            if not self.live[t]:  # back from idle: a debt is forgiven up to one quantum
                self.deficit[t] = max(self.deficit[t], min(self.quantum, self.deficit[t] + self.quantum))
            if self.deficit[t] > 0:
                self.new.add(t)
        self.live[t] += 1
        self.queues.setdefault(t, deque()).append(request)

    def finished(self, request: Request) -> None:
        self.live[request.tenant] -= 1

    def charge(self, tenant: str, amount: float) -> None:
        self.deficit[tenant] -= amount / self.weights[tenant]

    def pick(self, replica: _Replica) -> Request | None:
        if not self.queues:
            return None
        bm = replica.sched.block_manager
        for tier in (self.new & self.queues.keys(), self.queues.keys(), None, self.queues.keys()):
            if tier is None:
                most = max(self.deficit[t] for t in self.queues)
                k = int(-most // self.quantum) + 1
                for t in self.queues:
                    self.deficit[t] += k * self.quantum
                continue
            best, key = None, None
            for t in tier:
                if self.deficit[t] > 0:
                    head = self.queues[t][0]
                    k2 = (len(bm.find_cached_prefix(head)), -head.arrival_time)
                    if key is None or k2 > key:
                        best, key = t, k2
            if best is not None:
                queue = self.queues[best]
                request = queue.popleft()
                if not queue:
                    del self.queues[best]
                self.new.discard(best)
                return request
        return None


def simulate(
    router: str,
    tenants: list[TenantLoad],
    *,
    replicas: int,
    config: SchedulerConfig,
    cost: CostModel,
    duration: float,
    quantum: float,
    baseline_policy: str = "fcfs",
    seed: int = 0,
) -> SimResult:
    local = "dlpm" if router == "d2lpm" else baseline_policy
    cfg = SchedulerConfig(**{**config.__dict__, "policy": local, "dlpm_quantum": int(quantum)})
    reps = [_Replica(cfg) for _ in range(replicas)]
    weights = {t.name: t.weight for t in tenants}
    rng = random.Random(seed)
    ids = itertools.count()
    events: list[tuple[float, int, str, object]] = []  # (time, seq, kind, payload)
    seq = itertools.count()
    outcomes: dict[str, Outcome] = {}
    service = {t.name: [(0.0, 0.0)] for t in tenants}
    totals = {t.name: 0.0 for t in tenants}
    backlogged: dict[str, list[tuple[float, bool]]] = {t.name: [] for t in tenants}
    waiting_at_router = {t.name: 0 for t in tenants}
    by_name = {t.name: t for t in tenants}
    rr = itertools.cycle(range(replicas))
    pool = _GlobalDeficits(quantum, weights) if router == "d2lpm" else None
    admitted: set[str] = set()

    def new_request(t: TenantLoad, now: float) -> Request:
        i = next(ids)
        prompt = t.prefix + [rng.randrange(100, 49152) for _ in range(t.suffix)]
        r = Request(
            f"{t.name}-{i}",
            prompt,
            SamplingParams(max_tokens=t.output, ignore_eos=True),
            tenant=t.name,
            weight=t.weight,
            arrival_time=now,
        )
        outcomes[r.request_id] = Outcome(t.name, now, prompt=len(prompt))
        return r

    def wake(rep: _Replica, now: float) -> None:
        if rep.next_step is None:
            rep.next_step = now
            heapq.heappush(events, (now, next(seq), "step", rep))

    def route(r: Request, now: float) -> None:
        if pool is not None:
            pool.add(r)
            waiting_at_router[r.tenant] += 1
            for rep in reps:
                pull(rep, now)
            return
        if router == "round-robin":
            rep = reps[next(rr)]
        else:  # prefix affinity
            rep = max(reps, key=lambda p: (len(p.sched.block_manager.find_cached_prefix(r)), -p.load))
        rep.sched.add_request(r)
        outcomes[r.request_id].dispatched = now
        wake(rep, now)

    def pull(rep: _Replica, now: float) -> None:
        while rep.sched.num_waiting == 0 and rep.sched.num_running < cfg.max_num_seqs:
            r = pool.pick(rep)
            if r is None:
                return
            waiting_at_router[r.tenant] -= 1
            outcomes[r.request_id].dispatched = now
            pool.charge(r.tenant, W_P * r.num_prompt_tokens)
            rep.sched.add_request(r)
            wake(rep, now)

    def arrive(t: TenantLoad, now: float) -> None:
        route(new_request(t, now), now)

    for t in tenants:
        if t.clients:
            for _ in range(t.clients):
                heapq.heappush(events, (0.0, next(seq), "arrive", t))
        else:
            at = rng.expovariate(t.rate)
            while at < duration:
                heapq.heappush(events, (at, next(seq), "arrive", t))
                at += rng.expovariate(t.rate)
    sample_every, next_sample = 0.5, 0.0
    now = 0.0
    while events:
        now, _, kind, payload = heapq.heappop(events)
        if now > duration:
            break
        while next_sample <= now:
            for name in backlogged:
                queued = waiting_at_router[name] + sum(
                    1 for rep in reps for r in rep.sched.policy.waiting() if r.tenant == name
                )
                backlogged[name].append((next_sample, queued > 0))
            next_sample += sample_every
        if kind == "arrive":
            arrive(payload, now)
            continue
        rep: _Replica = payload
        if rep.next_step != now:
            continue  # stale: the replica was woken again meanwhile
        rep.next_step = None
        sched = rep.sched
        if not sched.has_unfinished_requests():
            if pool is not None:
                pull(rep, now)
            if not sched.has_unfinished_requests():
                continue
        plan = sched.schedule()
        done_at = now + cost.step_time(plan)
        sampled = {}
        for r, n in plan.scheduled:
            if r.request_id not in admitted:
                admitted.add(r.request_id)
                totals[r.tenant] += W_P * r.num_prompt_tokens / r.weight
                service[r.tenant].append((done_at, totals[r.tenant]))
            if r.num_computed_tokens + n == r.num_tokens:
                sampled[r.request_id] = 7
        rep.tokens += plan.num_batched_tokens
        finished = sched.update_from_output(plan, sampled)
        for rid in sampled:
            out = outcomes[rid]
            r = sched.requests.get(rid) or next((f for f in finished if f.request_id == rid), None)
            if r is None:
                continue
            if out.first_token is None:
                out.first_token = done_at
            totals[r.tenant] += W_Q / r.weight
            service[r.tenant].append((done_at, totals[r.tenant]))
            if pool is not None:
                pool.charge(r.tenant, W_Q)
        for r in finished:
            out = outcomes[r.request_id]
            out.end, out.output = done_at, r.num_output_tokens
            if pool is not None:
                pool.finished(r)
            t = by_name[r.tenant]
            if t.clients:
                heapq.heappush(events, (done_at, next(seq), "arrive", t))
        rep.next_step = done_at  # busy until then: arrivals meanwhile wait for this step's end
        heapq.heappush(events, (done_at, next(seq), "step", rep))
        if pool is not None:
            pull(rep, done_at)
    return SimResult(
        router,
        list(outcomes.values()),
        service,
        backlogged,
        prefix_hits=sum(p.sched.prefix_hits for p in reps),
        prefix_queries=sum(p.sched.prefix_queries for p in reps),
        duration=duration,
        per_replica_tokens=[p.tokens for p in reps],
    )


def service_at(points: list[tuple[float, float]], t: float) -> float:
    """Weighted service received up to time t, from (time, cumulative) points."""
    lo, hi = 0, len(points)
    while lo < hi:
        mid = (lo + hi) // 2
        if points[mid][0] <= t:
            lo = mid + 1
        else:
            hi = mid
    return points[lo - 1][1] if lo else 0.0


def max_gap(result: SimResult, names: list[str], window: tuple[float, float], step: float = 0.5) -> float:
    """Largest |W_a(t1, t2) - W_b(t1, t2)| over pairs of the named tenants and sub-intervals of the window
    while both had a request waiting (sampled every `step` seconds)."""
    worst = 0.0
    backlog = {n: dict(result.backlogged[n]) for n in names}
    times = [window[0] + k * step for k in range(int((window[1] - window[0]) / step) + 1)]
    for i, a in enumerate(names):
        for b in names[i + 1 :]:
            lo = hi = None
            for t in times:
                key = round(t / step) * step
                if not (backlog[a].get(key, True) and backlog[b].get(key, True)):
                    lo = hi = None  # a stretch where one of them had nothing waiting ends the interval
                    continue
                d = service_at(result.service[a], t) - service_at(result.service[b], t)
                lo = d if lo is None else min(lo, d)
                hi = d if hi is None else max(hi, d)
                worst = max(worst, hi - lo)
    return worst
