"""A tenant the scheduler forgot (idle too long) and that comes back keeps a monotonic service counter.

Everything is real: a Scheduler driven through whole requests, the server's metrics registry reading its
stats, and prometheus_client's own exposition and parser.
"""

from __future__ import annotations

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from scheduler import Request, SamplingParams, Scheduler, SchedulerConfig
from server.metrics import ServerMetrics


def run_one(sched: Scheduler, request_id: str, tenant: str, prompt: int = 3, tokens: int = 1) -> None:
    params = SamplingParams(max_tokens=tokens, ignore_eos=True)
    sched.add_request(Request(request_id, list(range(1, prompt + 1)), params, tenant=tenant))
    while request_id in sched.requests:
        plan = sched.schedule()
        sched.update_from_output(
            plan, {r.request_id: 7 for r, n in plan.scheduled if r.num_computed_tokens + n == r.num_tokens}
        )


def scrape(metrics: ServerMetrics, name: str) -> dict[str, float]:
    out = {}
    for family in text_string_to_metric_families(generate_latest(metrics.registry).decode()):
        for s in family.samples:
            if s.name == name:
                out[s.labels["tenant"]] = s.value
    return out


def test_a_returning_tenant_continues_its_counter_and_other_does_not_jump():
    sched = Scheduler(SchedulerConfig(num_blocks=64, block_size=4, max_idle_tenants=2, policy="vtc"))
    metrics = ServerMetrics("m", 2048, sched.stats)
    service = "prescient:tenant_service_tokens_total"
    run_one(sched, "a0", "alice", prompt=5, tokens=5)
    first = scrape(metrics, service)
    assert first["alice"] == 10

    for i in range(3):  # three other tenants go idle after alice: she is forgotten
        run_one(sched, f"b{i}", f"bob-{i}")
    assert "alice" not in sched.stats()["tenants"] and sched.stats()["retired_service_tokens"] >= 10
    forgotten = scrape(metrics, service)
    assert forgotten["alice"] == 10  # the counter keeps its value...
    assert "other" not in forgotten or forgotten["other"] == sum(
        v for k, v in forgotten.items() if k not in ("alice", "bob-0", "bob-1", "bob-2")
    )

    run_one(sched, "a1", "alice", prompt=3, tokens=20)  # back, with more service than before: 23 > 10
    back = scrape(metrics, service)
    assert back["alice"] == 10 + 23  # ...and counts on from it, not from 0
    total = sum(t["service_tokens"] for t in sched.stats()["tenants"].values())
    assert sum(back.values()) == total + sched.stats()["retired_service_tokens"]  # nothing counted twice
    for label, value in forgotten.items():  # every series is monotonic across forget and return
        assert back.get(label, 0) >= value, label


def test_a_returning_tenants_virtual_counter_is_lifted_not_reset():
    """The virtual counter is a gauge of the scheduler's state: a tenant back from idle shows the floor VTC
    lifted it to (the smallest backlogged counter), never 0 while others are far ahead."""
    sched = Scheduler(SchedulerConfig(num_blocks=64, block_size=4, max_idle_tenants=1, policy="vtc"))
    metrics = ServerMetrics("m", 2048, sched.stats)
    gauge = "prescient:tenant_virtual_counter"
    run_one(sched, "a0", "alice")
    for i in range(3):
        run_one(sched, f"b{i}", f"bob-{i}", tokens=30)
    assert "alice" not in scrape(metrics, gauge)  # forgotten: no series, rather than a stale value
    sched.add_request(Request("hog", [1] * 8, SamplingParams(max_tokens=50, ignore_eos=True), tenant="carol"))
    sched.add_request(Request("a1", [1, 2, 3], SamplingParams(max_tokens=1), tenant="alice"))
    values = scrape(metrics, gauge)
    assert values["alice"] == values["carol"] > 0


def test_prefix_cache_hits_are_counted_per_tenant_and_survive_forgetting():
    # block_size 4: a repeated 17-token prompt finds its first 4 blocks (16 tokens) cached; the prefix
    # cache is per tenant, so bob's identical prompt finds nothing of alice's.
    sched = Scheduler(SchedulerConfig(num_blocks=64, block_size=4, max_idle_tenants=1, policy="dlpm"))
    metrics = ServerMetrics("m", 2048, sched.stats)
    hits, queries = "prescient:tenant_prefix_cache_hits_total", "prescient:tenant_prefix_cache_queries_total"
    run_one(sched, "a0", "alice", prompt=17)
    run_one(sched, "a1", "alice", prompt=17)
    assert scrape(metrics, hits) == {"alice": 16}
    run_one(sched, "b0", "bob", prompt=17)
    assert scrape(metrics, hits) == {"alice": 16, "bob": 0}
    assert scrape(metrics, queries) == {"alice": 34, "bob": 17}
    total = {
        s.name: s.value
        for f in text_string_to_metric_families(generate_latest(metrics.registry).decode())
        for s in f.samples
        if s.name == "prescient:prefix_cache_hits_total"
    }
    assert total["prescient:prefix_cache_hits_total"] == 16
    run_one(sched, "c0", "carol")  # alice, idle longest, is forgotten; her series keeps its value
    run_one(sched, "a2", "alice", prompt=17)  # her blocks are still cached: 16 more
    assert "alice" in sched.stats()["tenants"]
    assert scrape(metrics, hits)["alice"] == 32
