"""n samples of one prompt on the real engine: the prompt is prefilled once and its KV blocks shared; each
sequence j draws from its own seed stream (seed + j), so it equals a single-sequence request with that seed."""

from __future__ import annotations

import pytest

from runtime import RequestOutput, SamplingParams


def test_n_prefills_once_and_shares_blocks(engine_fp32):
    engine = engine_fp32
    prompt = list(range(1000, 1512))  # 512 tokens: 64 full blocks of 8
    before = engine.stats()["computed_tokens"]
    engine.add_request("fork-n4", prompt, SamplingParams(max_tokens=3, temperature=1.0, seed=11, n=4))
    outputs = []
    while not any(o.new_token_ids for o in outputs):
        outputs = engine.step()
    stats = engine.stats()
    assert stats["computed_tokens"] - before == 512  # the prompt went through the model once
    assert stats["num_running"] == 4
    bm = engine.scheduler.block_manager
    tables = [r.block_table for r in engine.scheduler.running]
    assert all(t == tables[0] for t in tables) and len(tables[0]) == 64
    assert bm.num_used_blocks == 64 and all(bm.ref_counts[b] == 4 for b in tables[0])
    done = {o.index: RequestOutput(o.request_id, prompt, index=o.index).append(o) for o in outputs}
    while engine.has_unfinished_requests():
        for o in engine.step():
            done[o.index].append(o)
    assert sorted(done) == [0, 1, 2, 3] and {o.request_id for o in done.values()} == {"fork-n4"}
    for j, out in done.items():  # the first token comes from the same prefill row: exactly equal
        alone = engine.generate([prompt], SamplingParams(max_tokens=1, temperature=1.0, seed=11 + j))[0]
        assert out.token_ids[0] == alone.token_ids[0]
    assert len({tuple(o.token_ids) for o in done.values()}) > 1


def test_n_with_a_partial_last_block_matches_single_requests(engine_fp32):
    prompt = "The three primary colors are"  # not a multiple of the block size: copy on write
    params = SamplingParams(max_tokens=12, temperature=0.9, seed=5, n=3, logprobs=1)
    outs = engine_fp32.generate([prompt], params)
    assert [o.index for o in outs] == [0, 1, 2]
    for j, out in enumerate(outs):
        alone = engine_fp32.generate(
            [prompt], SamplingParams(max_tokens=12, temperature=0.9, seed=5 + j, logprobs=1)
        )[0]
        assert out.token_ids == alone.token_ids and out.text == alone.text
        assert [s.logprob for s in out.logprobs] == pytest.approx(
            [s.logprob for s in alone.logprobs], abs=1e-4
        )
    assert engine_fp32.scheduler.block_manager.num_used_blocks == 0


def test_abort_of_a_forked_request_frees_every_sequence(engine_fp32):
    engine = engine_fp32
    engine.add_request("fork-abort", "Once upon a time", SamplingParams(max_tokens=50, n=3, seed=1))
    for _ in range(3):
        engine.step()
    assert engine.scheduler.num_running == 3
    engine.abort_request("fork-abort")
    assert not engine.has_unfinished_requests() and engine.scheduler.block_manager.num_used_blocks == 0
