"""Block manager: ref counts, LRU eviction, prefix hits counted in tokens, no leaks."""
from __future__ import annotations

import random

import pytest

from scheduler import BlockManager, RequestStatus, Scheduler, SchedulerConfig
from tests.scheduler.sim import make_request, step


def admit(bm: BlockManager, req) -> int:
    cached = bm.find_cached_prefix(req)
    req.num_computed_tokens = len(cached) * bm.block_size
    assert bm.allocate(req, req.num_tokens - req.num_computed_tokens, cached)
    hit = req.num_computed_tokens
    req.num_computed_tokens = req.num_tokens
    bm.cache_full_blocks(req)
    return hit


def test_shared_prefix_reuses_blocks_and_counts_tokens():
    bm = BlockManager(num_blocks=32, block_size=4)
    a = make_request("a", 10, 1)
    b = make_request("b", 10, 1)
    b.prompt_token_ids = a.prompt_token_ids[:8] + [40, 41, 42]
    assert admit(bm, a) == 0
    assert admit(bm, b) == 8          # two full blocks of 4 tokens shared
    assert a.block_table[:2] == b.block_table[:2]
    assert a.block_table[2] != b.block_table[2]
    assert bm.ref_counts[a.block_table[0]] == 2
    bm.check_invariants([a.block_table, b.block_table])


def test_full_prompt_hit_leaves_last_token_to_compute():
    bm = BlockManager(num_blocks=16, block_size=4)
    a = make_request("a", 8, 1)
    admit(bm, a)
    b = make_request("b", 8, 1)
    assert b.prompt_token_ids == a.prompt_token_ids
    assert admit(bm, b) == 4          # not 8: the last block is recomputed to get logits


def test_freed_blocks_stay_cached_until_evicted_in_lru_order():
    bm = BlockManager(num_blocks=6, block_size=4)
    first = make_request("first", 9, 1, seed=1)     # 3 blocks, the first 2 full and cached
    second = make_request("second", 9, 1, seed=2)
    admit(bm, first)
    bm.free(first)
    admit(bm, second)
    bm.free(second)
    assert bm.num_free_blocks == 6
    # Both prefixes survive their owners.
    assert len(bm.find_cached_prefix(make_request("p1", 9, 1, seed=1))) == 2
    assert len(bm.find_cached_prefix(make_request("p2", 9, 1, seed=2))) == 2
    # Two fresh blocks come from the least recently freed: first's tail, then first's second full block.
    filler = make_request("filler", 8, 1, seed=3)
    assert bm.allocate(filler, 8)
    bm.free(filler)
    assert len(bm.find_cached_prefix(make_request("p3", 9, 1, seed=1))) == 1  # block 0 survived, block 1 evicted
    assert len(bm.find_cached_prefix(make_request("p4", 9, 1, seed=2))) == 2  # freed later: untouched


def test_allocation_fails_cleanly_when_short():
    bm = BlockManager(num_blocks=3, block_size=4)
    a = make_request("a", 12, 1)
    assert bm.allocate(a, 12)
    b = make_request("b", 2, 1, seed=5)
    assert not bm.allocate(b, 2)
    assert b.block_table == []
    bm.free(a)
    assert bm.allocate(b, 2)


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("policy", ["fcfs", "vtc", "priority"])
def test_random_mix_of_finish_abort_preempt_leaks_nothing(seed, policy):
    rng = random.Random(seed)
    sched = Scheduler(SchedulerConfig(num_blocks=24, block_size=4, max_num_seqs=6, max_num_batched_tokens=20,
                                      policy=policy))
    reqs = {}
    shared = [rng.randrange(3, 50) for _ in range(12)]
    for i in range(40):
        prompt_len = rng.randrange(1, 30)
        req = make_request(f"r{i}", prompt_len, rng.randrange(1, 20), tenant=rng.choice("abc"),
                           priority=rng.randrange(3), arrival=i, seed=seed * 100 + i)
        if rng.random() < 0.4:
            req.prompt_token_ids = (shared + req.prompt_token_ids)[:max(prompt_len, 13)]
        reqs[req.request_id] = req
    pending = list(reqs.values())
    done = set()
    for _ in range(2000):
        if pending and rng.random() < 0.5:
            sched.add_request(pending.pop(0))
        if rng.random() < 0.05 and sched.requests:
            victim = rng.choice(sorted(sched.requests))
            sched.abort_request(victim)
            done.add(victim)
        finished, _, _ = step(sched, token_of=lambda r: rng.randrange(3, 50))
        done.update(r.request_id for r in finished)
        if not pending and not sched.has_unfinished_requests():
            break
    assert done == set(reqs)
    assert sched.num_running == 0 and sched.num_waiting == 0
    assert sched.block_manager.num_free_blocks == 24
    assert all(c == 0 for c in sched.block_manager.ref_counts)
    for req in reqs.values():
        if req.status != RequestStatus.FINISHED_ABORTED:
            assert req.num_output_tokens == req.sampling_params.max_tokens
    assert sched.num_preemptions > 0 or seed % 2, "the pool is sized to force preemption in most runs"
