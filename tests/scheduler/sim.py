"""Drive the scheduler the way the engine does, with a fake "model" that emits token ids.

No tensors: each step every request that reaches its end gets one token. The
simulation checks the block manager's invariants after every step.
"""
from __future__ import annotations

import random

from scheduler import Request, SamplingParams, Scheduler


def make_request(rid: str, prompt_len: int, max_tokens: int, tenant: str = "default", weight: float = 1.0,
                 arrival: float = 0.0, priority: int = 0, vocab: int = 50, seed: int = 0) -> Request:
    rng = random.Random(seed)
    return Request(rid, [rng.randrange(3, vocab) for _ in range(prompt_len)],
                   SamplingParams(max_tokens=max_tokens, ignore_eos=True), eos_token_id=2, tenant=tenant,
                   weight=weight, priority=priority, arrival_time=arrival)


def step(scheduler: Scheduler, token_of=lambda req: 7):
    """One engine iteration; returns (finished requests, {request id: token}, the plan)."""
    plan = scheduler.schedule()
    budget = scheduler.config.max_num_batched_tokens
    assert plan.num_batched_tokens <= budget
    assert len({id(r) for r, _ in plan.scheduled}) == len(plan.scheduled)
    assert scheduler.num_running <= scheduler.config.max_num_seqs
    bs = scheduler.config.block_size
    sampled = {}
    for req, n in plan.scheduled:
        assert n >= 1
        assert len(req.block_table) * bs >= req.num_computed_tokens + n, "blocks must cover the scheduled tokens"
        if req.num_computed_tokens + n == req.num_tokens:
            sampled[req.request_id] = token_of(req)
    finished = scheduler.update_from_output(plan, sampled)
    scheduler.block_manager.check_invariants([r.block_table for r in scheduler.running])
    return finished, sampled, plan
