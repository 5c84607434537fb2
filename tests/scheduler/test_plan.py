"""The runner's narrow view of the plan is enough: a runner that keeps its own per-sequence state from
new_requests / cached_requests / finished and preempted ids (and appends what it samples) always holds
exactly the scheduler's token ids and block table for every request it is asked to run."""

from __future__ import annotations

import random

import pytest

from scheduler import RequestStatus, Scheduler, SchedulerConfig
from tests.scheduler.sim import make_request


class PlanOnlyRunner:
    """State rebuilt from the narrow plan alone, the way runtime.ModelRunner keeps it."""

    def __init__(self):
        self.tokens: dict[str, list[int]] = {}
        self.tables: dict[str, list[int]] = {}
        self.forks: dict[str, tuple[int, list[str]]] = {}  # id -> (prompt length, its forks' ids)

    def apply(self, plan) -> None:
        for rid in plan.finished_request_ids + plan.preempted_request_ids:
            self.tokens.pop(rid, None)
            self.tables.pop(rid, None)
        self.computed = {}
        for new in plan.new_requests:
            assert new.request_id not in self.tokens, "a request sent as new twice without being dropped"
            self.tokens[new.request_id] = new.prompt_token_ids + new.output_token_ids
            self.tables[new.request_id] = list(new.block_ids)
            self.computed[new.request_id] = new.num_computed_tokens
            self.forks[new.request_id] = (len(new.prompt_token_ids), [rid for rid, _ in new.forks])
        for cached in plan.cached_requests:
            for index, block in cached.replaced_block_ids:
                self.tables[cached.request_id][index] = block
            self.tables[cached.request_id].extend(cached.new_block_ids)
            self.computed[cached.request_id] = cached.num_computed_tokens

    def sample(self, plan, token_of) -> dict[str, int]:
        sampled = {}
        for rid, n in plan.num_scheduled_tokens.items():
            if self.computed[rid] + n == len(self.tokens[rid]):
                prompt_len, forks = self.forks[rid]
                if self.computed[rid] < prompt_len:  # a prompt ends: its forks draw a first token too
                    sampled.update((child, token_of(child)) for child in forks)
                sampled[rid] = token_of(rid)
                self.tokens[rid].append(sampled[rid])
        return sampled


def drive(seed: int, policy: str) -> int:
    """A random workload (shared prefixes, a small pool, aborts, stop strings); returns the preemptions."""
    rng = random.Random(seed)
    sched = Scheduler(
        SchedulerConfig(num_blocks=20, block_size=4, max_num_seqs=6, max_num_batched_tokens=16, policy=policy)
    )
    shared = [rng.randrange(3, 50) for _ in range(12)]
    pending = [
        make_request(
            f"r{i}",
            rng.randrange(13, 30) if rng.random() < 0.4 else rng.randrange(1, 30),
            rng.randrange(1, 20),
            tenant=rng.choice("ab"),
            arrival=i,
            seed=seed * 100 + i,
            prefix=shared if rng.random() < 0.4 else [],
        )
        for i in range(30)
    ]
    runner = PlanOnlyRunner()
    preemptions = 0
    for _ in range(3000):
        if pending and rng.random() < 0.5:
            sched.add_request(pending.pop(0))
        if rng.random() < 0.04 and sched.requests:
            sched.abort_request(rng.choice(sorted(sched.requests)))
        if rng.random() < 0.03 and sched.running:
            sched.finish_request(rng.choice(sched.running).request_id, RequestStatus.FINISHED_STOPPED, "stop")
        plan = sched.schedule()
        preemptions += len(plan.preempted)
        assert [r.request_id for r, _ in plan.scheduled] == list(plan.num_scheduled_tokens)
        runner.apply(plan)
        for req, _ in plan.scheduled:  # what the runner holds is the scheduler's truth
            assert runner.tokens[req.request_id] == req.all_token_ids
            assert runner.tables[req.request_id] == req.block_table
            assert runner.computed[req.request_id] == req.num_computed_tokens
        assert set(runner.tokens) <= {r.request_id for r in sched.running}, "state of a request that left"
        sampled = runner.sample(plan, lambda rid: rng.randrange(3, 50))
        sched.update_from_output(plan, sampled)
        if not pending and not sched.has_unfinished_requests():
            break
    assert not pending and not sched.has_unfinished_requests()
    runner.apply(sched.schedule())  # the last finishes reach the runner with the next plan
    assert not runner.tokens
    return preemptions


@pytest.mark.parametrize("policy", ["fcfs", "vtc"])
def test_plan_only_runner_matches_the_scheduler(policy):
    preemptions = [drive(seed, policy) for seed in range(6)]
    assert sum(preemptions) > 0, "the pool is small enough that the workload preempts"


def test_forks_and_their_copies_on_write_reach_the_runner():
    """n > 1: the forks start from the parent's blocks; a shared partial block copied on write under a
    sequence the runner already holds replaces that entry of its table (CachedRequestData)."""
    from tests.scheduler.test_fork import forked

    sched = Scheduler(SchedulerConfig(num_blocks=40, block_size=4, max_num_batched_tokens=64))
    sched.add_request(forked("a", 10, 4, max_tokens=9))
    sched.add_request(forked("b", 7, 3, max_tokens=6))
    runner = PlanOnlyRunner()
    copies = 0
    while sched.has_unfinished_requests():
        plan = sched.schedule()
        copies += len(plan.block_copies)
        runner.apply(plan)
        for req, _ in plan.scheduled:
            assert runner.tables[req.request_id] == req.block_table
            assert runner.tokens[req.request_id] == req.all_token_ids
        sched.update_from_output(plan, runner.sample(plan, lambda rid: 7))
    assert copies == 3 + 2
