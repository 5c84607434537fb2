"""Drive the scheduler the way the engine does, with a fake "model" that emits token ids.

No tensors: each step every request that reaches its end gets one token. The
simulation checks the block manager's invariants after every step.
"""

from __future__ import annotations

import random

from scheduler import Request, SamplingParams, Scheduler


def make_request(
    rid: str,
    prompt_len: int,
    max_tokens: int,
    tenant: str = "default",
    weight: float = 1.0,
    arrival: float = 0.0,
    priority: int = 0,
    vocab: int = 50,
    seed: int = 0,
    prefix: list[int] = (),
) -> Request:
    """A request of prompt_len tokens: `prefix` (cut to prompt_len) then random ids from `seed`."""
    rng = random.Random(seed)
    prompt = list(prefix[:prompt_len]) + [rng.randrange(3, vocab) for _ in range(prompt_len - len(prefix))]
    return Request(
        rid,
        prompt,
        SamplingParams(max_tokens=max_tokens, ignore_eos=True),
        eos_token_id=2,
        tenant=tenant,
        weight=weight,
        priority=priority,
        arrival_time=arrival,
    )


class ShadowKV:
    """What a real KV pool would hold: each slot gets the identity of the token prefix it encodes.

    K/V at position p depend on tokens[0..p], so a slot is written with a hash chained over
    them; a request may only read (as computed) slots that hold exactly its own prefix. That
    catches a prefix-cache hit on wrong contents, a block evicted or overwritten while in use,
    and two sequences writing one slot.
    """

    def __init__(self, block_size: int):
        self.block_size = block_size
        self.slots: dict[int, int] = {}

    def run(self, plan) -> None:
        bs = self.block_size
        for src, dst in plan.block_copies:  # copy on write of a forked block, before the step
            for offset in range(bs):
                if src * bs + offset in self.slots:
                    self.slots[dst * bs + offset] = self.slots[src * bs + offset]
        written = set()
        for req, n in plan.scheduled:
            tokens, table, h = req.all_token_ids, req.block_table, 0
            for p in range(req.num_computed_tokens + n):
                h = hash((h, tokens[p]))
                slot = table[p // bs] * bs + p % bs
                if p < req.num_computed_tokens:
                    assert self.slots.get(slot) == h, f"{req.request_id} reads wrong K/V at position {p}"
                else:
                    assert slot not in written, "two sequences write one slot in a step"
                    written.add(slot)
                    self.slots[slot] = h


def step(scheduler: Scheduler, token_of=lambda req: 7, kv: ShadowKV | None = None):
    """One engine iteration; returns (finished requests, {request id: token}, the plan)."""
    plan = scheduler.schedule()
    if kv is not None:
        kv.run(plan)
    budget = scheduler.config.max_num_batched_tokens
    assert plan.num_batched_tokens <= budget
    assert len({id(r) for r, _ in plan.scheduled}) == len(plan.scheduled)
    assert scheduler.num_running <= scheduler.config.max_num_seqs
    bs = scheduler.config.block_size
    sampled = {}
    for req, n in plan.scheduled:
        assert n >= 1
        assert len(req.block_table) * bs >= req.num_computed_tokens + n, (
            "blocks must cover the scheduled tokens"
        )
        if req.num_computed_tokens + n == req.num_tokens:
            sampled[req.request_id] = token_of(req)
            for child in req.forks:  # sequences of the same prompt sample from its last row
                sampled[child.request_id] = token_of(child)
    finished = scheduler.update_from_output(plan, sampled)
    check_invariants(scheduler)
    return finished, sampled, plan


def check_invariants(scheduler: Scheduler) -> None:
    """Blocks, tallies and slot counts agree with the requests themselves."""
    bm = scheduler.block_manager
    bm.check_invariants([r.block_table for r in scheduler.running])
    bs = bm.block_size
    for r in scheduler.running:
        assert r.status.value == "running"
        assert len(r.block_table) == bm.blocks_needed(r.num_computed_tokens), "blocks beyond computed tokens"
    stats = scheduler.stats()
    tenants = stats["tenants"].values()
    assert sum(t["running"] for t in tenants) == stats["num_running"] == len(scheduler.running)
    assert sum(t["waiting"] for t in tenants) == stats["num_waiting"] == len(list(scheduler.policy.waiting()))
    assert stats["num_running"] + stats["num_waiting"] == len(scheduler.requests)
    slots = {}  # physical slots holding a computed token
    for r in scheduler.running:
        for p in range(r.num_computed_tokens):
            slots[r.block_table[p // bs] * bs + p % bs] = True
    assert stats["live_token_slots"] == len(slots)
    assert stats["allocated_token_slots"] == (bm.num_blocks - bm.num_free_blocks) * bs
