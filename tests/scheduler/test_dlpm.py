"""DLPM on the scheduler alone: the fairness bound at its worst case, locality, and the prefix index.

Service is measured here, independently of the policy: w_p per prompt token at
first admission, w_q per generated token, divided by the tenant's weight. The
index's match lengths are checked against the block manager's own walk over
the cache (find_cached_prefix) after every step.
"""

from __future__ import annotations

import dataclasses
import itertools
import random
import time

from scheduler import DLPMPolicy, Scheduler, SchedulerConfig
from scheduler.prefix_index import PrefixIndex
from tests.scheduler.sim import make_request, step

W_P, W_Q = 1.0, 2.0
PREFIX, MAX_SUFFIX, MAX_OUTPUT = 80, 16, 24


def config(policy: str, quantum: int | None = 512, num_blocks: int = 48) -> SchedulerConfig:
    return SchedulerConfig(
        num_blocks=num_blocks,
        block_size=8,
        max_num_seqs=8,
        max_num_batched_tokens=64,
        policy=policy,
        dlpm_quantum=quantum,
    )


def bound(cfg: SchedulerConfig, weight: float = 1.0) -> float:
    """2 (Q + U_p + U_q) from scheduler/dlpm.py, for the lightest tenant's weight: U_q is what the running
    requests can still generate, max_num_seqs x the longest output (here less than the KV pool)."""
    u_p = W_P * (PREFIX + MAX_SUFFIX) / weight
    u_q = W_Q * min(cfg.max_num_seqs * MAX_OUTPUT, cfg.num_blocks * cfg.block_size) / weight
    return 2 * (cfg.dlpm_quantum + u_p + u_q)


class Locality:
    """Backlogged tenants, each with a prompt prefix of its own; `hot` tenants' requests all share it
    (so the cache always favours them), the others' prompts share nothing."""

    def __init__(self, seed: int, weights: dict[str, float], hot: set[str], depth: int = 8):
        self.rng = random.Random(seed)
        self.weights = weights
        self.prefix = {t: [self.rng.randrange(3, 50) for _ in range(PREFIX)] for t in weights}
        self.hot = hot
        self.depth = depth
        self.ids = itertools.count()
        self.service = {t: 0.0 for t in weights}
        self.admitted: set[str] = set()

    def top_up(self, sched: Scheduler, tenants) -> None:
        for tenant in tenants:
            queued = sum(1 for r in sched.policy.waiting() if r.tenant == tenant)
            for _ in range(self.depth - queued):
                i = next(self.ids)
                suffix = self.rng.randint(1, MAX_SUFFIX)
                sched.add_request(
                    make_request(
                        f"{tenant}{i}",
                        PREFIX + suffix,
                        self.rng.randint(1, MAX_OUTPUT),
                        tenant=tenant,
                        weight=self.weights[tenant],
                        arrival=float(i),
                        seed=i,
                        prefix=self.prefix[tenant] if tenant in self.hot else (),
                    )
                )

    def step(self, sched: Scheduler) -> None:
        _, sampled, plan = step(sched)
        for req, _ in plan.scheduled:
            if req.request_id not in self.admitted:
                self.admitted.add(req.request_id)
                self.service[req.tenant] += W_P * req.num_prompt_tokens / self.weights[req.tenant]
            if req.request_id in sampled:
                self.service[req.tenant] += W_Q / self.weights[req.tenant]
        check_index(sched)


def check_index(sched: Scheduler) -> None:
    """The index's match of every waiting request equals the block manager's walk over the cache."""
    index = getattr(sched.policy, "_index", None)
    if index is None:
        return
    bm = sched.block_manager
    for r in sched.policy.waiting():
        assert index.match(r) == len(bm.find_cached_prefix(r)), r.request_id


def run(
    policy: str, weights, hot, seed: int, steps: int = 1200, quantum: int = 512
) -> tuple[float, Scheduler]:
    """Worst |weighted service of a - of b| over the run, both tenants backlogged throughout."""
    sched = Scheduler(config(policy, quantum))
    load = Locality(seed, weights, hot)
    worst = 0.0
    for _ in range(steps):
        load.top_up(sched, weights)
        load.step(sched)
        worst = max(worst, abs(load.service["a"] - load.service["b"]))
    run.service = load.service
    run.hit_rate = sched.prefix_hits / sched.prefix_queries
    return worst, sched


def test_worst_case_gap_reaches_the_quantum_and_stays_within_the_bound():
    # a's cached prefix always wins the longest match, so a is served whenever its deficit allows:
    # each round a takes its whole quantum before b is admitted at all. That is DLPM's worst case.
    for seed in range(2):
        gap, sched = run("dlpm", {"a": 1.0, "b": 1.0}, hot={"a"}, seed=seed)
        assert sched.policy.quantum <= gap <= bound(sched.config), gap


def test_lpm_alone_breaks_the_bound_on_the_same_workload():
    gap, sched = run("lpm", {"a": 1.0, "b": 1.0}, hot={"a"}, seed=0)
    assert gap > bound(config("lpm")), gap


def test_a_larger_quantum_buys_locality_within_its_larger_bound():
    # Both tenants have their own hot prefix, and the pool holds one of them at a time alongside the
    # running requests: interleaving evicts each; serving a quantum in a row reuses it (hit rate 0.55 vs 0.88).
    rates, gaps = {}, {}
    for q in (64, 2048):
        sched = Scheduler(config("dlpm", q, num_blocks=20))
        load = Locality(3, {"a": 1.0, "b": 1.0}, hot={"a", "b"})
        worst = 0.0
        for _ in range(1200):
            load.top_up(sched, "ab")
            load.step(sched)
            worst = max(worst, abs(load.service["a"] - load.service["b"]))
        rates[q] = sched.prefix_hits / sched.prefix_queries
        gaps[q] = worst
        assert worst <= bound(sched.config), (q, worst)
    assert rates[2048] > 1.3 * rates[64], rates


def test_weights_one_to_two_split_service_one_to_two():
    gap, sched = run("dlpm", {"a": 1.0, "b": 2.0}, hot={"a", "b"}, seed=5, steps=2500)
    assert gap <= bound(sched.config), gap
    raw = {t: run.service[t] * w for t, w in {"a": 1.0, "b": 2.0}.items()}
    assert 1.8 < raw["b"] / raw["a"] < 2.2, raw


def test_an_admission_never_overdraws_the_deficit():
    # Q a little above one request's charge: each tenant pays for one request a round, so two backlogged
    # tenants alternate, although a's requests always win the order (earlier arrivals). Admitting while
    # the deficit is merely positive would let each take two in a row, overdrawn by a whole prompt.
    from scheduler.block_manager import BlockManager

    policy = DLPMPolicy(quantum=95)
    policy.attach(BlockManager(num_blocks=256, block_size=8))
    for i in range(12):
        for tenant, arrival in (("a", i), ("b", 100 + i)):
            policy.add(make_request(f"{tenant}{i}", 90, 4, tenant=tenant, arrival=float(arrival), seed=i))
    order = []
    while policy.num_waiting():
        r = policy.peek()
        policy.remove(r)
        policy.charge_admission(r)
        order.append(r.tenant)
        assert min(policy.deficits().values()) >= 0, policy.deficits()
    assert order == ["a", "b"] * 12, order


def test_tenant_back_from_idle_is_not_credited_for_its_absence():
    cfg = config("dlpm")
    sched = Scheduler(cfg)
    load = Locality(7, {"a": 1.0, "b": 1.0}, hot={"a"})
    for i in range(800):  # b has a few requests, then goes idle while a is served a lot
        load.top_up(sched, "a" if i else "ab")
        load.step(sched)
    start = dict(load.service)
    assert start["a"] > 10 * bound(cfg)
    worst = 0.0
    for _ in range(800):
        load.top_up(sched, "ab")
        load.step(sched)
        worst = max(worst, abs((load.service["b"] - start["b"]) - (load.service["a"] - start["a"])))
    assert load.service["b"] > start["b"]
    assert worst <= bound(cfg), worst


def test_admits_the_longest_cached_prefix_among_eligible_tenants():
    sched = Scheduler(config("dlpm", quantum=10_000, num_blocks=64))
    shared = list(range(10, 50))  # 40 tokens: 5 blocks
    warm = make_request("warm", 41, 1, tenant="b", prefix=shared, arrival=0.0)
    sched.add_request(warm)
    while sched.has_unfinished_requests():
        step(sched)
    cold = make_request("cold", 41, 1, tenant="a", arrival=1.0, seed=1)
    half = make_request("half", 41, 1, tenant="b", prefix=shared[:16], arrival=2.0, seed=2)
    full = make_request("full", 41, 1, tenant="b", prefix=shared, arrival=3.0, seed=3)
    for r in (cold, half, full):
        sched.add_request(r)
    policy = sched.policy
    assert [policy.cached_match(r) for r in (cold, half, full)] == [0, 2, 5]
    assert policy.peek() is full
    policy.deficits()["b"] = 0.0  # b spent its round: a's cold request comes first
    assert policy.peek() is cold


def test_index_follows_evictions_under_pressure():
    # Many tenants' prefixes through a pool that holds few of them: blocks are cached and evicted
    # all the time; check_index (in Locality.step) compares every match with the block walk.
    sched = Scheduler(config("dlpm", quantum=256, num_blocks=40))
    tenants = {t: 1.0 for t in "abcdef"}
    load = Locality(9, tenants, hot=set(tenants), depth=3)
    evictions = 0
    before = sched.block_manager.num_cached_blocks
    for _ in range(600):
        load.top_up(sched, tenants)
        load.step(sched)
        evictions += max(before - sched.block_manager.num_cached_blocks, 0)
        before = sched.block_manager.num_cached_blocks
    assert evictions > 50


def _waiting_queue(num_tenants: int, num_waiting: int):
    """A DLPM queue of num_waiting requests over num_tenants tenants, and a function timing `decisions`
    admission decisions on it (peek, remove, charge, and a new arrival to keep the size), in seconds each."""
    from scheduler.block_manager import BlockManager

    bm = BlockManager(num_blocks=4096, block_size=8)
    policy = DLPMPolicy(quantum=64)
    policy.attach(bm)
    rng = random.Random(0)
    ids = itertools.count()

    def new(tenant: int):
        i = next(ids)
        policy.add(make_request(f"r{i}", 33, 4, tenant=f"t{tenant}", arrival=float(i), seed=i))

    for i in range(num_waiting):
        new(i % num_tenants)

    def timed(decisions: int = 200) -> float:
        start = time.perf_counter()
        for _ in range(decisions):
            r = policy.peek()
            policy.remove(r)
            policy.charge_admission(r)
            policy.on_finish(r)
            new(rng.randrange(num_tenants))
        return (time.perf_counter() - start) / decisions

    return timed


def test_admission_cost_does_not_grow_with_the_waiting_queue():
    # O(tenants + log waiting): at 1,000 tenants, 10x the waiting requests costs far less than 10x.
    # Passes alternate between the two sizes so that both see this shared machine's load alike.
    small, large = _waiting_queue(1000, 1000), _waiting_queue(1000, 10_000)
    times = {"small": [], "large": []}
    for _ in range(3):
        times["small"].append(small())
        times["large"].append(large())
    assert min(times["large"]) < 3 * min(times["small"]), times


def test_prefix_index_alone_tracks_groups():
    index = PrefixIndex()
    a, b = make_request("a", 4, 1), make_request("b", 4, 1)
    index.add(a, "g", 2.0)
    index.add(b, "g", 1.0)
    assert index.longest("g") is b
    assert index.remove(b) and not index.remove(b)
    assert index.longest("g") is a
    index.remove(a)
    assert not index.has("g") and index.longest("g") is None


def test_a_sparse_tenant_is_admitted_at_the_next_free_slot():
    # a's cached prefix would win every longest-match choice for a whole (large) quantum; w, back from
    # idle with one request at a time, goes first anyway (the new-tenant tier), as it would under VTC.
    sched = Scheduler(config("dlpm", quantum=50_000))
    load = Locality(4, {"a": 1.0, "b": 1.0, "w": 1.0}, hot={"a"})
    for _ in range(100):
        load.top_up(sched, "ab")
        load.step(sched)
    waits = []
    for k in range(5):
        w = make_request(f"w{k}", 12, 4, tenant="w", arrival=1e6 + k, seed=100 + k)
        sched.add_request(w)
        steps = 0
        while w.first_scheduled_time is None:
            load.top_up(sched, "ab")
            load.step(sched)
            steps += 1
            assert steps < 200
        waits.append(steps)
        while w.request_id in sched.requests:
            load.top_up(sched, "ab")
            load.step(sched)
    lpm_like = DLPMPolicy(quantum=50_000)
    lpm_like._new = _NeverNew()
    sched2 = Scheduler(config("dlpm", quantum=50_000), lpm_like)
    load2 = Locality(4, {"a": 1.0, "b": 1.0, "w": 1.0}, hot={"a"})
    for _ in range(100):
        load2.top_up(sched2, "ab")
        load2.step(sched2)
    w = make_request("w", 12, 4, tenant="w", arrival=1e6, seed=100)
    sched2.add_request(w)
    slow = 0
    while w.first_scheduled_time is None and slow < 400:
        load2.top_up(sched2, "ab")
        load2.step(sched2)
        slow += 1
    assert max(waits) * 4 < slow, (waits, slow)


class _NeverNew(set):
    """A new-tenant tier that never holds anyone: DLPM without the sparse-tenant rule."""

    def add(self, item) -> None:
        pass


def test_a_sparse_tenant_finding_the_batch_full_takes_one_slot_from_the_most_served_tenant():
    """With every slot held by backlogged tenants, w's request starts in the very next step: the newest
    running request of the tenant with the least deficit goes back to its queue (and finishes later, its
    KV recomputed); w never holds more than one slot that way. VTC, on the same load, waits for a slot."""
    for policy in ("dlpm", "vtc"):
        sched = Scheduler(dataclasses.replace(config(policy, quantum=50_000, num_blocks=96), max_num_seqs=3))
        load = Locality(5, {"a": 1.0, "b": 1.0, "w": 1.0}, hot={"a"})
        for i in range(400):
            load.top_up(sched, "ab")
            load.step(sched)
            if i > 60 and sched.num_running == sched.config.max_num_seqs:
                break
        assert sched.num_running == sched.config.max_num_seqs
        ws = [make_request(f"w{k}", 12, 30, tenant="w", arrival=1e6 + k, seed=100 + k) for k in range(2)]
        deficits = dict(getattr(sched.policy, "_deficits", {}))
        running = list(sched.running)
        preempted_before = sched.num_preemptions
        displaced_before = sched.num_displacements
        for w in ws:
            sched.add_request(w)
        load.top_up(sched, "ab")
        _, _, plan = step(sched)
        if policy == "vtc":
            assert ws[0].first_scheduled_time is None and plan.preempted == []
            continue
        assert ws[0].first_scheduled_time is not None and ws[1].first_scheduled_time is None
        assert len(plan.preempted) == 1 and sched.num_displacements == displaced_before + 1
        assert sched.num_preemptions == preempted_before  # KV pressure's count: the KV alert stays quiet
        (victim,) = plan.preempted
        most_served = min(deficits[t] for t in {r.tenant for r in running})
        assert deficits[victim.tenant] == most_served
        assert victim.arrival_time == max(r.arrival_time for r in running if r.tenant == victim.tenant)
        while victim.request_id in sched.requests or ws[1].request_id in sched.requests:
            load.top_up(sched, "ab")
            load.step(sched)
            assert sum(r.tenant == "w" for r in sched.running) <= 1
        assert victim.num_output_tokens == victim.sampling_params.max_tokens


def test_the_default_quantum_follows_the_requests_charge_and_keeps_its_bound():
    """Quantum None: Q is the most any of the last requests can be charged, w_p prompt + w_q max_tokens
    (between the workload's mean and largest charge), so a round serves about one request a tenant; with
    a's prefix always winning the match (the worst case) the gap stays within the bound of the largest Q
    used, and far under the gap a fixed quantum of many requests allows."""
    for seed in range(2):
        sched = Scheduler(config("dlpm", None))
        load = Locality(seed, {"a": 1.0, "b": 1.0}, hot={"a"})
        worst = 0.0
        for _ in range(1200):
            load.top_up(sched, "ab")
            load.step(sched)
            worst = max(worst, abs(load.service["a"] - load.service["b"]))
        policy = sched.policy
        typical = W_P * (PREFIX + (1 + MAX_SUFFIX) / 2) + W_Q * (1 + MAX_OUTPUT) / 2
        largest = W_P * (PREFIX + MAX_SUFFIX) + W_Q * MAX_OUTPUT
        assert typical < policy.quantum <= largest, (policy.quantum, typical, largest)
        cfg = dataclasses.replace(sched.config, dlpm_quantum=int(policy.max_quantum) + 1)
        assert worst <= bound(cfg), (worst, bound(cfg))
        fixed, _ = run("dlpm", {"a": 1.0, "b": 1.0}, hot={"a"}, seed=seed, quantum=8 * int(typical))
        assert worst < fixed / 2, (worst, fixed)
