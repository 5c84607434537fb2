"""Admission order and preemption victims of each policy; chunked prefill under the token budget."""

from __future__ import annotations

import pytest

from scheduler import RequestStatus, Scheduler, SchedulerConfig, VTCPolicy
from tests.scheduler.sim import make_request, step


def admitted_order(policy: str, requests) -> list[str]:
    sched = Scheduler(
        SchedulerConfig(num_blocks=64, block_size=4, max_num_seqs=1, max_num_batched_tokens=64, policy=policy)
    )
    for r in requests:
        sched.add_request(r)
    order = []
    while sched.has_unfinished_requests():
        _, _, plan = step(sched)
        for req, _ in plan.scheduled:
            if req.request_id not in order:
                order.append(req.request_id)
    return order


def test_fcfs_admits_by_arrival():
    reqs = [
        make_request("late", 4, 2, arrival=3.0),
        make_request("early", 4, 2, arrival=1.0),
        make_request("mid", 4, 2, arrival=2.0, priority=-5),
    ]
    assert admitted_order("fcfs", reqs) == ["early", "mid", "late"]


def test_priority_admits_lower_value_first_then_arrival():
    reqs = [
        make_request("p1-late", 4, 2, arrival=3.0, priority=1),
        make_request("p1-early", 4, 2, arrival=1.0, priority=1),
        make_request("p0", 4, 2, arrival=5.0, priority=0),
        make_request("pneg", 4, 2, arrival=9.0, priority=-1),
    ]
    assert admitted_order("priority", reqs) == ["pneg", "p0", "p1-early", "p1-late"]


def test_vtc_alternates_between_tenants_with_equal_requests():
    reqs = [make_request(f"a{i}", 8, 4, tenant="a", arrival=float(i)) for i in range(4)] + [
        make_request(f"b{i}", 8, 4, tenant="b", arrival=10.0 + i) for i in range(4)
    ]
    order = admitted_order("vtc", reqs)
    assert order[:4] in (["a0", "b0", "a1", "b1"], ["b0", "a0", "b1", "a1"])


@pytest.mark.parametrize("policy, expected", [("fcfs", "newest"), ("priority", "lowprio"), ("vtc", "heavy")])
def test_preemption_victim_follows_policy(policy, expected):
    sched = Scheduler(
        SchedulerConfig(num_blocks=12, block_size=4, max_num_seqs=8, max_num_batched_tokens=64, policy=policy)
    )
    reqs = [
        make_request("heavy", 4, 40, tenant="h", arrival=0.0, priority=0),
        make_request("lowprio", 3, 40, tenant="l", arrival=1.0, priority=9),
        make_request("newest", 3, 40, tenant="l", arrival=2.0, priority=0),
    ]
    for r in reqs:
        sched.add_request(r)
    step(sched)
    if policy == "vtc":  # the heavy tenant has already been served far more than the other
        sched.policy.charge_output(reqs[0], 150)
    preempted = []
    for _ in range(30):
        _, _, plan = step(sched)
        preempted += [r.request_id for r in plan.preempted]
        if preempted:
            break
    assert preempted and preempted[0] == expected


def test_vtc_charges_weighted_prompt_once_and_each_output_token():
    vtc = VTCPolicy(prompt_token_weight=1.0, output_token_weight=2.0)
    req = make_request("r", 10, 5, tenant="t", weight=2.0)
    vtc.add(req)
    vtc.remove(req)
    vtc.charge_admission(req)
    vtc.charge_output(req, 3)
    assert vtc.counters()["t"] == (10 + 2 * 3) / 2
    req.status = RequestStatus.PREEMPTED  # recomputing is not new service
    vtc.add(req)
    vtc.remove(req)
    vtc.charge_admission(req)
    assert vtc.counters()["t"] == 8.0


def test_vtc_lifts_a_returning_tenant_to_the_smallest_backlogged_counter():
    vtc = VTCPolicy()
    a, b, c = (make_request(t, 4, 1, tenant=t) for t in "abc")
    vtc.add(a)
    vtc.add(b)
    vtc.counters()["a"] = 100.0
    vtc.counters()["b"] = 40.0
    vtc.add(c)  # c was idle at 0: lifted to min(100, 40), not below
    assert vtc.counters()["c"] == 40.0
    assert vtc.peek() is b  # ties go to the tenant backlogged first
    vtc.counters()["c"] = 500.0
    late = make_request("c2", 4, 1, tenant="c")
    vtc.add(late)  # c already backlogged: no change
    assert vtc.counters()["c"] == 500.0


def test_vtc_lifts_to_the_last_served_tenant_when_nobody_waits():
    vtc = VTCPolicy()
    a = make_request("a", 4, 1, tenant="a")
    vtc.add(a)
    vtc.remove(a)
    vtc.charge_admission(a)
    vtc.charge_output(a, 10)  # a: 24, last served, nobody waiting
    b = make_request("b", 4, 1, tenant="b")
    vtc.add(b)
    assert vtc.counters()["b"] == 24.0


def test_vtc_does_not_lift_a_preempted_request_coming_back():
    vtc = VTCPolicy()
    heavy = make_request("h", 4, 1, tenant="h")
    vtc.add(heavy)
    vtc.counters()["h"] = 1000.0
    light = make_request("l", 4, 1, tenant="l")
    light.status = RequestStatus.PREEMPTED
    vtc.add(light)  # l was being served, not idle: keeps its low counter
    assert vtc.counters()["l"] == 0.0 and vtc.peek() is light
