"""Tenants named by the free-form `user` field come and go: the scheduler forgets the longest idle ones, so
its memory and the cost of stats() stay bounded however many names it has ever seen, and the service total
is kept."""

from __future__ import annotations

from scheduler import Request, SamplingParams, Scheduler, SchedulerConfig


def run_one(sched: Scheduler, request_id: str, tenant: str) -> None:
    sched.add_request(Request(request_id, [1, 2, 3], SamplingParams(max_tokens=1), tenant=tenant))
    while request_id in sched.requests:
        plan = sched.schedule()
        sched.update_from_output(
            plan, {r.request_id: 7 for r, n in plan.scheduled if r.num_computed_tokens + n == r.num_tokens}
        )


def test_idle_tenants_are_forgotten_and_stats_stay_bounded():
    sched = Scheduler(SchedulerConfig(num_blocks=64, block_size=4, max_idle_tenants=50, policy="vtc"))
    for i in range(5_000):
        run_one(sched, f"r{i}", f"user-{i}")
    stats = sched.stats()
    assert len(stats["tenants"]) <= 50
    assert len(sched.policy.counters()) <= 51  # the tenant served last is kept for VTC's lift
    served = sum(t["service_tokens"] for t in stats["tenants"].values()) + stats["retired_service_tokens"]
    assert served == 5_000 * (3 + 1)  # nothing lost from the total
    assert stats["num_running"] == stats["num_waiting"] == 0 and stats["kv_usage"] == 0.0


def test_a_busy_tenant_is_never_forgotten():
    sched = Scheduler(SchedulerConfig(num_blocks=64, block_size=4, max_idle_tenants=2, policy="vtc"))
    sched.add_request(
        Request("long", [1, 2, 3], SamplingParams(max_tokens=200, ignore_eos=True), tenant="busy")
    )
    sched.schedule()
    for i in range(20):
        run_one(sched, f"r{i}", f"user-{i}")
    assert "busy" in sched.stats()["tenants"] and "busy" in sched.policy.counters()


def test_a_returning_tenant_starts_from_the_backlogged_minimum():
    """Forgetting an idle tenant's counter loses nothing: VTC lifts a returning tenant to the floor anyway."""
    sched = Scheduler(SchedulerConfig(num_blocks=64, block_size=4, max_idle_tenants=1, policy="vtc"))
    run_one(sched, "a0", "alice")
    for i in range(3):
        run_one(sched, f"b{i}", f"bob-{i}")
    assert "alice" not in sched.policy.counters()
    sched.add_request(Request("hog", [1] * 8, SamplingParams(max_tokens=50, ignore_eos=True), tenant="carol"))
    sched.add_request(Request("a1", [1, 2, 3], SamplingParams(max_tokens=1), tenant="alice"))
    counters = sched.policy.counters()
    assert counters["alice"] == counters["carol"]
