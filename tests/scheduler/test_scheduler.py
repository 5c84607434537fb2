"""The step contract the runtime codes against: plans, lazy blocks, stops, aborts, preemption, stats."""

from __future__ import annotations

import pytest

from scheduler import Request, RequestStatus, SamplingParams, Scheduler, SchedulerConfig, TenantStats
from tests.scheduler.sim import check_invariants, make_request, step


def sched(**kw) -> Scheduler:
    cfg = dict(num_blocks=64, block_size=4, max_num_seqs=8, max_num_batched_tokens=64, policy="fcfs")
    cfg.update(kw)
    return Scheduler(SchedulerConfig(**cfg))


def run_to_end(s: Scheduler, token_of=lambda r: 7, limit: int = 1000) -> list[Request]:
    done = []
    for _ in range(limit):
        if not s.has_unfinished_requests():
            return done
        finished, _, _ = step(s, token_of)
        done += finished
    raise AssertionError("requests did not finish")


def test_plan_names_the_tokens_and_blocks_cover_them_before_num_computed_advances():
    s = sched()
    req = make_request("r", 10, 3)
    s.add_request(req)
    plan = s.schedule()
    assert plan.scheduled == [(req, 10)] and plan.num_batched_tokens == 10
    assert req.num_computed_tokens == 0 and len(req.block_table) == 3
    assert req.status is RequestStatus.RUNNING and req.first_scheduled_time is not None
    assert req.num_cached_tokens == 0
    s.update_from_output(plan, {"r": 11})
    assert req.num_computed_tokens == 10 and req.output_token_ids == [11]
    assert req.all_token_ids[-2:] == [req.prompt_token_ids[-1], 11]
    assert req.first_token_time is not None
    plan = s.schedule()
    assert plan.scheduled == [(req, 1)]  # decode: the token sampled last step


def test_blocks_are_allocated_lazily_for_the_scheduled_chunk_only():
    s = sched(max_num_batched_tokens=8)
    req = make_request("long", 40, 2)
    s.add_request(req)
    _, _, plan = step(s)
    assert plan.scheduled == [(req, 8)]
    assert len(req.block_table) == 2  # 8 tokens of 40, not 10 blocks up front
    assert s.stats()["live_token_slots"] == s.stats()["allocated_token_slots"] == 8


def test_prompt_longer_than_the_budget_makes_progress_every_step():
    s = sched(max_num_batched_tokens=5)
    req = make_request("long", 23, 1)
    s.add_request(req)
    sizes = []
    while s.has_unfinished_requests():
        _, sampled, plan = step(s)
        sizes.append(plan.num_batched_tokens)
    assert sizes == [5, 5, 5, 5, 3] and req.num_output_tokens == 1


def test_long_prompt_is_chunked_and_decodes_keep_running():
    s = sched(num_blocks=200, max_num_seqs=4, max_num_batched_tokens=16)
    short = make_request("short", 3, 30, arrival=0.0)
    s.add_request(short)
    step(s)
    s.add_request(make_request("long", 100, 2, arrival=1.0))
    chunks = []
    for _ in range(10):
        _, sampled, plan = step(s)
        sizes = {r.request_id: n for r, n in plan.scheduled}
        assert sizes.get("short") == 1, "the running decode is served every step"
        assert "short" in sampled
        chunks.append(sizes.get("long", 0))
    assert chunks[:6] == [15] * 6 and sum(chunks) >= 100


def test_max_num_seqs_caps_the_running_batch():
    s = sched(max_num_seqs=3)
    for i in range(7):
        s.add_request(make_request(f"r{i}", 4, 5, arrival=float(i), seed=i))
    _, _, plan = step(s)
    assert len(plan.scheduled) == 3 and s.num_running == 3 and s.num_waiting == 4
    assert len(run_to_end(s)) == 7


@pytest.mark.parametrize(
    "params, token, status, length, reason",
    [
        (SamplingParams(max_tokens=5), 2, RequestStatus.FINISHED_STOPPED, 1, None),  # eos
        (SamplingParams(max_tokens=5, ignore_eos=True), 2, RequestStatus.FINISHED_LENGTH, 5, None),
        (SamplingParams(max_tokens=5, stop_token_ids=[9]), 9, RequestStatus.FINISHED_STOPPED, 1, 9),
        (SamplingParams(max_tokens=4), 7, RequestStatus.FINISHED_LENGTH, 4, None),
    ],
)
def test_stop_conditions(params, token, status, length, reason):
    s = sched()
    req = Request("r", [5, 6, 7], params, eos_token_id=2)
    s.add_request(req)
    done = run_to_end(s, token_of=lambda r: token)
    assert done == [req] and req.status is status and req.num_output_tokens == length
    assert req.stop_reason == reason and req.finished_time is not None
    assert s.block_manager.num_free_blocks == 64


def test_max_model_len_stops_the_request():
    s = sched(max_model_len=12)
    req = make_request("r", 10, 100)
    s.add_request(req)
    run_to_end(s)
    assert req.status is RequestStatus.FINISHED_LENGTH and req.num_tokens == 12


def test_runtime_finish_and_abort_free_blocks_at_once():
    s = sched(max_num_seqs=1)
    running = make_request("running", 9, 50, arrival=0.0)
    waiting = make_request("waiting", 9, 50, arrival=1.0, seed=1)
    s.add_request(running)
    s.add_request(waiting)
    step(s)
    assert s.abort_request("waiting") is waiting and waiting.status is RequestStatus.FINISHED_ABORTED
    assert s.num_waiting == 0 and s.abort_request("waiting") is None and s.abort_request("nope") is None
    s.finish_request("running", RequestStatus.FINISHED_STOPPED, stop_reason="###")
    assert running.status is RequestStatus.FINISHED_STOPPED and running.stop_reason == "###"
    assert s.block_manager.num_free_blocks == 64 and not s.has_unfinished_requests()
    check_invariants(s)
    with pytest.raises(ValueError, match="status"):
        s.finish_request("x", RequestStatus.RUNNING)


def test_abort_between_schedule_and_update_is_ignored_by_update():
    s = sched()
    req = make_request("r", 6, 4)
    s.add_request(req)
    plan = s.schedule()
    s.abort_request("r")
    assert s.update_from_output(plan, {"r": 7}) == []
    assert req.output_token_ids == [] and s.block_manager.num_free_blocks == 64


def test_preemption_recomputes_from_scratch_and_keeps_generated_tokens():
    # 6 blocks of 4: two requests of 8 prompt tokens each grow until the pool is dry.
    s = sched(num_blocks=6, watermark=0.0)
    old = make_request("old", 8, 12, arrival=0.0, seed=1)
    new = make_request("new", 8, 12, arrival=1.0, seed=2)
    s.add_request(old)
    s.add_request(new)
    preempted = None
    for _ in range(20):
        _, _, plan = step(s)
        if plan.preempted:
            preempted = plan.preempted
            break
    assert preempted == [new]  # fcfs: the newest
    assert new.status is RequestStatus.PREEMPTED and new.num_preemptions == 1
    assert new.num_computed_tokens == 0 and new.block_table == [] and new.num_output_tokens > 0
    assert s.num_waiting == 1 and s.stats()["num_preemptions"] == 1
    generated = list(new.output_token_ids)
    while new.status is RequestStatus.PREEMPTED:
        _, _, plan = step(s)
    assert new.status is RequestStatus.RUNNING
    assert new.output_token_ids[: len(generated)] == generated
    run_to_end(s)
    assert old.num_output_tokens == new.num_output_tokens == 12


def test_admission_waits_for_blocks_of_the_whole_prompt_instead_of_thrashing():
    # A 40-token prompt is chunked 8 at a time; with 12 blocks and a 16-token decode running, its
    # whole prompt (10 blocks) does not fit beside the decode's growth: it must wait, not be
    # admitted and preempted over and over.
    s = sched(num_blocks=12, max_num_batched_tokens=8, watermark=0.0)
    s.add_request(make_request("decode", 8, 30, arrival=0.0, seed=1))
    step(s)
    s.add_request(make_request("prompt", 40, 2, arrival=1.0, seed=2))
    run_to_end(s)
    assert s.num_preemptions == 0


def test_a_request_at_its_end_without_a_sampled_token_is_rolled_back_not_stalled():
    s = sched()
    req = make_request("r", 5, 2)
    s.add_request(req)
    plan = s.schedule()
    s.update_from_output(plan, {})  # the runtime sampled nothing
    assert req.num_computed_tokens == 4
    plan = s.schedule()
    assert plan.scheduled == [(req, 1)]
    s.update_from_output(plan, {"r": 3})
    assert req.output_token_ids == [3]


def test_request_that_can_never_fit_is_refused_upfront():
    cfg = SchedulerConfig(num_blocks=4, block_size=4)  # 16 token slots
    cfg.check_request(10, 7)  # 16 tokens hold KV; the 17th never does
    with pytest.raises(ValueError, match="max_tokens"):
        cfg.check_request(10, 8)
    SchedulerConfig(num_blocks=4, block_size=4, max_model_len=12).check_request(10, 100)
    s = Scheduler(cfg)
    with pytest.raises(ValueError, match="prompt"):  # the prompt alone overfills the pool
        s.add_request(make_request("big", 17, 1))
    s.add_request(make_request("ok", 16, 1))
    with pytest.raises(ValueError, match="request_id"):
        s.add_request(make_request("ok", 3, 1))


def test_stats_report_per_tenant_service_and_queue():
    s = sched(max_num_seqs=1, policy="vtc")
    s.add_request(make_request("a1", 6, 3, tenant="a", arrival=0.0))
    s.add_request(make_request("a2", 6, 3, tenant="a", arrival=1.0, seed=1))
    s.add_request(make_request("b1", 4, 3, tenant="b", arrival=2.0, seed=2))
    step(s)
    t = s.stats()["tenants"]
    assert t["a"] == TenantStats(
        counter=6 + 2, service_tokens=6 + 1, waiting=1, running=1, since=1, prefix_hits=0, prefix_queries=6
    )
    assert t["b"] == TenantStats(counter=0.0, service_tokens=0, waiting=1, running=0, since=2)
    run_to_end(s)
    t = s.stats()["tenants"]
    assert t["a"]["service_tokens"] == 18 and t["b"]["service_tokens"] == 7
    assert t["a"]["counter"] == 2 * 6 + 2 * 2 * 3 and t["b"]["counter"] >= 4 + 2 * 3
    stats = s.stats()
    assert stats["kv_usage"] == 0.0 and stats["num_free_blocks"] == 64 and stats["generated_tokens"] == 9


def test_config_errors_name_the_field():
    with pytest.raises(ValueError, match="policy"):
        SchedulerConfig(num_blocks=4, policy="lottery")
    with pytest.raises(ValueError, match="max_num_seqs"):
        SchedulerConfig(num_blocks=4, max_num_seqs=0)
    with pytest.raises(ValueError, match="watermark"):
        SchedulerConfig(num_blocks=4, watermark=1.0)


def test_a_victim_already_planned_this_step_leaves_the_batch_and_returns_its_budget():
    s = sched(num_blocks=2, policy="vtc", watermark=0.0)
    heavy = make_request("heavy", 2, 5, tenant="h", arrival=0.0)  # room left in its block
    light = make_request("light", 4, 4, tenant="l", arrival=1.0, seed=1)  # its next token needs a block
    s.add_request(heavy)
    s.add_request(light)
    step(s)
    s.policy.charge_output(heavy, 100)  # h is far above its share
    plan = s.schedule()
    assert plan.preempted == [heavy] and plan.scheduled == [(light, 1)] and plan.num_batched_tokens == 1
    assert heavy.status is RequestStatus.PREEMPTED and heavy.block_table == []
    s.update_from_output(plan, {"light": 7})
    check_invariants(s)


def test_a_burst_of_short_prompts_is_admitted_in_waves_and_a_long_prompt_keeps_the_whole_budget():
    s = sched(num_blocks=512, max_num_seqs=32, max_num_batched_tokens=512, prefill_wave_tokens=128)
    burst = [make_request(f"r{i}", 16, 4, seed=i) for i in range(32)]
    for req in burst:
        s.add_request(req)
    first_token_step = {}
    for k in range(8):
        _, sampled, plan = step(s)
        assert sum(n for _, n in plan.scheduled if n > 1) <= 128  # each wave: 8 prompts of 16 tokens
        for request_id in sampled:
            first_token_step.setdefault(request_id, k)
    # in arrival order, 8 at a time; the earlier waves decode while the later ones prefill
    assert [first_token_step[r.request_id] for r in burst] == [i // 8 for i in range(32)]

    assert all(r.is_finished for r in burst)
    long = make_request("long", 1000, 1)
    s.add_request(long)
    _, _, plan = step(s)
    assert plan.scheduled == [(long, 512)]  # one long prompt: chunks of the whole budget, not of a wave


def test_without_waves_the_burst_is_admitted_while_the_budget_lasts():
    s = sched(num_blocks=512, max_num_seqs=32, max_num_batched_tokens=512)  # the default: no waves
    for i in range(32):
        s.add_request(make_request(f"r{i}", 16, 4, seed=i))
    _, sampled, _ = step(s)
    assert len(sampled) == 32
