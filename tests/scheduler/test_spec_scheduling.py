"""Speculative decoding in the scheduler: proposals scheduled under the budget, accepted tokens booked
one by one (stops inside the run), rejected slots rolled back and their blocks freed, tenants charged
for the tokens they receive, metrics counted."""

from __future__ import annotations

from scheduler import RequestStatus, SamplingParams, Scheduler, SchedulerConfig
from tests.scheduler.sim import make_request


def sched(**kw) -> Scheduler:
    cfg = dict(num_blocks=32, block_size=4, max_num_seqs=8, max_num_batched_tokens=64, policy="vtc")
    cfg.update(kw)
    return Scheduler(SchedulerConfig(**cfg))


def decoding(s: Scheduler, rid: str, prompt: int = 6, max_tokens: int = 50, **params):
    req = make_request(rid, prompt, max_tokens, seed=sum(map(ord, rid)))
    if params:
        req.sampling_params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, **params)
    s.add_request(req)
    for _ in range(10):  # prefill (in chunks under a small budget) to its first token
        s.update_from_output(s.schedule(), {rid: 100})
        if req.output_token_ids:
            break
    assert req.output_token_ids, f"{rid} did not start"
    return req


def test_proposals_are_verified_in_one_step_and_rejected_slots_freed():
    s = sched()
    req = decoding(s, "r")  # 6 prompt tokens + 1 output: 7 tokens, 6 computed, 2 blocks
    req.spec_token_ids = [101, 102, 103, 104, 105]
    plan = s.schedule()
    assert plan.scheduled == [(req, 6)] and plan.num_batched_tokens == 6
    assert plan.spec_token_ids == {"r": [101, 102, 103, 104, 105]}
    assert req.spec_token_ids == [] and len(req.block_table) == 3  # slots 6..11 allocated
    s.update_from_output(plan, {"r": [101, 102, 7]})  # two accepted, then a token of its own
    assert req.output_token_ids == [100, 101, 102, 7]
    assert req.num_computed_tokens == req.num_tokens - 1 == 9
    assert len(req.block_table) == 3  # 10 tokens need 3 blocks of 4
    req.spec_token_ids = [8, 9, 10, 11, 12, 13]
    plan = s.schedule()
    s.update_from_output(plan, {"r": [5]})  # all rejected
    assert req.num_computed_tokens == 10 and req.num_tokens == 11
    assert len(req.block_table) == 3, "the blocks of rejected proposals go back"
    s.block_manager.check_invariants([req.block_table])
    stats = s.stats()
    assert stats.spec_num_drafts == 2 and stats.spec_num_draft_tokens == 11
    assert stats.spec_num_accepted_tokens == 2 and stats.spec_accepted_per_pos == (1, 1, 0, 0, 0, 0)


def test_runner_is_told_how_many_block_entries_it_keeps_after_a_trim():
    s = sched()
    req = decoding(s, "r", prompt=7)  # 8 tokens: 2 full blocks
    req.spec_token_ids = [1] * 6
    plan = s.schedule()
    assert len(req.block_table) == 4
    s.update_from_output(plan, {"r": [9]})
    assert len(req.block_table) == 3
    req.spec_token_ids = [1, 2, 3, 4, 5]
    plan = s.schedule()
    (cached,) = plan.cached_requests
    assert cached.num_kept_blocks == 3  # its 4th entry is another block now, or none
    assert cached.new_block_ids == req.block_table[3:]


def test_budget_context_and_max_tokens_bound_the_proposals():
    s = sched(max_num_batched_tokens=4)
    req = decoding(s, "r")
    req.spec_token_ids = [1, 2, 3, 4, 5, 6]
    plan = s.schedule()
    assert plan.spec_token_ids == {"r": [1, 2, 3]} and plan.num_batched_tokens == 4
    s = sched()
    req = decoding(s, "m", max_tokens=3)  # 1 generated, 2 to go: one proposal and the token after it
    req.spec_token_ids = [1, 2, 3, 4]
    assert s.schedule().spec_token_ids == {"m": [1]}
    s = sched(max_model_len=9)
    req = decoding(s, "c")  # 7 tokens of 9
    req.spec_token_ids = [1, 2, 3, 4]
    assert s.schedule().spec_token_ids == {"c": [1, 2]}


def test_a_stop_inside_the_accepted_run_ends_it_there_and_tenants_pay_for_what_they_get():
    s = sched()
    req = decoding(s, "r", stop_token_ids=[55])
    before = s.stats().tenants["default"].service_tokens
    req.spec_token_ids = [54, 55, 56, 57]
    plan = s.schedule()
    finished = s.update_from_output(plan, {"r": [54, 55, 56, 57, 58]})
    assert finished == [req] and req.status is RequestStatus.FINISHED_STOPPED and req.stop_reason == 55
    assert req.output_token_ids == [100, 54, 55]
    assert s.stats().tenants["default"].service_tokens == before + 2
    assert s.block_manager.num_free_blocks == s.block_manager.num_blocks


def test_out_of_blocks_a_decode_drops_its_proposals_rather_than_preempt():
    s = sched(num_blocks=4, watermark=0)
    a = decoding(s, "a", prompt=7, max_tokens=8)  # 2 blocks
    decoding(s, "b", prompt=7, max_tokens=8)  # 2 blocks: the pool is full
    a.spec_token_ids = [1, 2, 3]
    plan = s.schedule()
    assert not plan.spec_token_ids and not plan.preempted
    assert {r.request_id: n for r, n in plan.scheduled} == {"a": 1, "b": 1}
