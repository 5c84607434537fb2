"""Block manager: ref counts, LRU eviction, prefix hits counted in tokens, no leaks."""

from __future__ import annotations

import random

import pytest

from scheduler import BlockManager, RequestStatus, Scheduler, SchedulerConfig
from tests.scheduler.sim import ShadowKV, make_request, step


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
    b = make_request("b", 11, 1, prefix=a.prompt_token_ids[:8] + [40, 41, 42])
    assert admit(bm, a) == 0
    assert admit(bm, b) == 8  # two full blocks of 4 tokens shared
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
    assert admit(bm, b) == 4  # not 8: the last block is recomputed to get logits


def test_freed_blocks_stay_cached_and_are_evicted_uncached_first_then_lru():
    bm = BlockManager(num_blocks=6, block_size=4)
    first = make_request("first", 9, 1, seed=1)  # 3 blocks: 2 full (cached) + a partial tail
    second = make_request("second", 9, 1, seed=2)
    admit(bm, first)
    bm.free(first)
    admit(bm, second)
    bm.free(second)
    assert bm.num_free_blocks == 6 and bm.num_cached_blocks == 4

    def hits(seed):
        return len(bm.find_cached_prefix(make_request("probe", 9, 1, seed=seed)))

    assert hits(1) == 2 and hits(2) == 2  # both prefixes survive their owners
    filler = make_request("filler", 8, 1, seed=3)
    assert bm.allocate(filler, 8)  # takes the two uncached tails: nothing evicted
    assert hits(1) == 2 and hits(2) == 2
    more = make_request("more", 4, 1, seed=4)
    assert bm.allocate(more, 4)  # least recently used: first's chain, deepest block first
    assert hits(1) == 1 and hits(2) == 2
    assert bm.allocate(more, 8 - more.num_computed_tokens)
    assert hits(1) == 0 and hits(2) == 2


def test_a_cache_hit_makes_the_block_recently_used_again():
    bm = BlockManager(num_blocks=4, block_size=4)
    first = make_request("first", 8, 1, seed=1)  # 2 full blocks; 1 block's worth is reused on a hit
    second = make_request("second", 8, 1, seed=2)
    admit(bm, first)
    admit(bm, second)
    bm.free(first)
    bm.free(second)
    again = make_request("again", 8, 1, seed=1)
    assert admit(bm, again) == 4  # revives first's head block (ref 0 -> 1)
    bm.free(again)  # ... which is now more recent than second's blocks
    filler = make_request("filler", 8, 1, seed=3)
    assert bm.allocate(filler, 8)
    assert len(bm.find_cached_prefix(make_request("p1", 8, 1, seed=1))) == 1
    assert len(bm.find_cached_prefix(make_request("p2", 8, 1, seed=2))) == 0


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
    sched = Scheduler(
        SchedulerConfig(num_blocks=24, block_size=4, max_num_seqs=6, max_num_batched_tokens=20, policy=policy)
    )
    reqs = {}
    shared = [rng.randrange(3, 50) for _ in range(12)]
    for i in range(40):
        prompt_len = rng.randrange(1, 30)
        prefix = shared if rng.random() < 0.4 else []
        req = make_request(
            f"r{i}",
            max(prompt_len, len(prefix) + 1),
            rng.randrange(1, 20),
            tenant=rng.choice("abc"),
            priority=rng.randrange(3),
            arrival=i,
            seed=seed * 100 + i,
            prefix=prefix,
        )
        reqs[req.request_id] = req
    pending = list(reqs.values())
    done = set()
    kv = ShadowKV(4)
    stopped_by_runtime = set()
    for _ in range(2000):
        if pending and rng.random() < 0.5:
            sched.add_request(pending.pop(0))
        if rng.random() < 0.05 and sched.requests:
            victim = rng.choice(sorted(sched.requests))
            sched.abort_request(victim)
            done.add(victim)
        if rng.random() < 0.03 and sched.running:  # the runtime saw a stop string
            stopped = rng.choice(sched.running).request_id
            sched.finish_request(stopped, RequestStatus.FINISHED_STOPPED, "stop")
            done.add(stopped)
            stopped_by_runtime.add(stopped)
        finished, _, _ = step(sched, token_of=lambda r: rng.randrange(3, 50), kv=kv)
        done.update(r.request_id for r in finished)
        if not pending and not sched.has_unfinished_requests():
            break
    assert done == set(reqs)
    assert sched.num_running == 0 and sched.num_waiting == 0
    assert sched.block_manager.num_free_blocks == 24
    assert all(c == 0 for c in sched.block_manager.ref_counts)
    assert sched.block_manager.num_shared_refs == 0
    for req in reqs.values():
        if req.status is RequestStatus.FINISHED_LENGTH:
            assert req.num_output_tokens == req.sampling_params.max_tokens
        else:
            assert req.request_id in stopped_by_runtime or req.status is RequestStatus.FINISHED_ABORTED
    stats = sched.stats()
    assert stats["prefix_cache_hits"] > 0, "shared prefixes must hit"
    assert sched.num_preemptions > 0 or seed % 2, "the pool is sized to force preemption in most runs"
