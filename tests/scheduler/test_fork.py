"""n sequences of one prompt: computed once, blocks shared by reference, the partial block copied on write."""

from __future__ import annotations

from scheduler import Request, SamplingParams, Scheduler, SchedulerConfig
from tests.scheduler.sim import ShadowKV, check_invariants, make_request, step


def forked(rid: str, prompt_len: int, n: int, max_tokens: int = 4) -> Request:
    parent = make_request(rid, prompt_len, max_tokens)
    for j in range(1, n):
        parent.forks.append(
            Request(
                f"{rid}#{j}",
                parent.prompt_token_ids,
                SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                eos_token_id=2,
                index=j,
            )
        )
    return parent


def test_fork_shares_prompt_blocks_and_copies_the_partial_one_on_write():
    s = Scheduler(SchedulerConfig(num_blocks=32, block_size=4, max_num_batched_tokens=64))
    kv = ShadowKV(4)
    s.add_request(forked("a", 10, 4))  # blocks: 2 full + 1 partial (2 of 4 tokens)
    _, sampled, plan = step(s, kv=kv)
    assert plan.num_batched_tokens == 10 and set(sampled) == {"a", "a#1", "a#2", "a#3"}
    tables = [r.block_table for r in s.running]
    assert len(s.running) == 4 and all(t == tables[0] for t in tables)
    assert s.block_manager.num_used_blocks == 3  # the prompt's blocks, once
    assert s.stats()["computed_tokens"] == 10
    _, _, plan = step(s, kv=kv, token_of=lambda r: 10 + r.index)  # each writes its own token at position 10
    assert len(plan.block_copies) == 3  # the last writer keeps the original
    full = {t[0] for t in (r.block_table for r in s.running)} | {
        t[1] for t in (r.block_table for r in s.running)
    }
    assert len(full) == 2  # full blocks still shared by all four
    assert s.block_manager.num_used_blocks == 2 + 4
    while s.has_unfinished_requests():
        step(s, kv=kv, token_of=lambda r: 10 + r.index)
    assert s.block_manager.num_used_blocks == 0


def test_forks_count_against_max_num_seqs_and_are_charged_for_their_tokens():
    s = Scheduler(SchedulerConfig(num_blocks=64, block_size=4, max_num_seqs=4, max_num_batched_tokens=64))
    s.add_request(forked("a", 6, 3, max_tokens=2))
    s.add_request(make_request("b", 6, 2, seed=1))
    s.add_request(make_request("c", 6, 2, seed=2))
    step(s)
    assert sorted(r.request_id for r in s.running) == ["a", "a#1", "a#2", "b"]  # c waits: 3 + 1 + 1 > 4
    while s.has_unfinished_requests():
        step(s)
    assert s.stats()["tenants"]["default"]["service_tokens"] == 3 * 6 + 5 * 2  # prompts once each, 5 outputs


def test_preempted_fork_is_recomputed_from_its_own_tokens():
    s = Scheduler(SchedulerConfig(num_blocks=9, block_size=4, max_num_batched_tokens=64, watermark=0))
    kv = ShadowKV(4)
    s.add_request(forked("a", 7, 3, max_tokens=12))
    while s.has_unfinished_requests():
        step(s, kv=kv, token_of=lambda r: 10 + r.index)
        check_invariants(s)
    assert s.num_preemptions > 0 and s.block_manager.num_used_blocks == 0
