"""Each tenant gets its share of the waiting queue: the tenant over its share is refused, not the others."""

from __future__ import annotations

from scheduler.waiting_share import waiting_refusal


def refused(in_flight, running, tenant, max_num_seqs=2, max_waiting=4) -> bool:
    return waiting_refusal(in_flight, running, tenant, max_num_seqs, max_waiting) is not None


def test_a_lone_tenant_has_the_whole_queue():
    # 2 running + 3 waiting: room for one more; 2 running + 4 waiting: full
    assert not refused({"a": 5}, {"a": 2}, "a")
    assert refused({"a": 6}, {"a": 2}, "a")
    # a burst before the engine admitted anyone: max_num_seqs of it will run
    assert not refused({"a": 5}, {}, "a")
    assert refused({"a": 6}, {}, "a")


def test_a_tenant_that_filled_the_queue_does_not_refuse_another():
    flooded = {"plain": 6}, {"plain": 2}
    assert refused(*flooded, "plain")
    assert not refused(*flooded, "keyed")
    # the newcomer gets its half (2 of 4), then is refused itself; the flooder stays refused
    assert not refused({"plain": 6, "keyed": 1}, {"plain": 2}, "keyed")
    assert refused({"plain": 6, "keyed": 2}, {"plain": 2}, "keyed")
    assert refused({"plain": 6, "keyed": 2}, {"plain": 2}, "plain")


def test_running_requests_do_not_count_against_a_share():
    assert not refused({"plain": 6, "keyed": 2}, {"plain": 1, "keyed": 1}, "keyed")


def test_made_up_tenants_cannot_grow_the_queue_past_twice_its_limit():
    in_flight = {"r": 2} | {f"t{i}": 1 for i in range(8)}  # 2 running, 8 waiting = 2 x max_waiting
    assert refused(in_flight, {"r": 2}, "new")
    in_flight.pop("t7")
    assert not refused(in_flight, {"r": 2}, "new")


def test_no_limit_refuses_nobody():
    assert not refused({"a": 10**6}, {}, "a", max_waiting=None)
