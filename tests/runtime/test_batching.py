"""Continuous batching must not change what a request generates.

Each prompt generated alone is the oracle; the same prompts together, under
preemption (a tiny KV pool), under chunked prefill (a tiny token budget) and
with shared prefixes hitting the prefix cache must give exactly those tokens.
Float32 and greedy, so equality is exact.
"""

from __future__ import annotations

import pytest

from runtime import Engine, SamplingParams
from tests.runtime.conftest import CHATS, chat_ids

PARAMS = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


def variant(base: Engine, **kw) -> Engine:
    """Another engine over the same loaded model, with its own KV pool and scheduler."""
    kw.setdefault("num_blocks", 256)
    return Engine(base.model, base.tokenizer, **kw)


@pytest.fixture(scope="module")
def prompts(engine_fp32):
    return [chat_ids(engine_fp32.tokenizer, c) for c in CHATS]


@pytest.fixture(scope="module")
def alone(engine_fp32, prompts):
    return [variant(engine_fp32).generate([p], PARAMS)[0].token_ids for p in prompts]


def assert_no_leaks(engine: Engine):
    stats = engine.stats()
    assert stats["num_running"] == 0 and stats["num_waiting"] == 0
    assert stats["num_free_blocks"] == stats["num_blocks"]


def test_batched_equals_alone(engine_fp32, prompts, alone):
    engine = variant(engine_fp32)
    outs = engine.generate(prompts, PARAMS)
    assert [o.token_ids for o in outs] == alone
    assert_no_leaks(engine)


def test_preemption_under_tiny_kv_pool_equals_alone(engine_fp32, prompts, alone):
    longest = max(len(p) for p in prompts) + PARAMS.max_tokens
    bs = engine_fp32.kv.block_size
    num_blocks = (longest + bs - 1) // bs + 2  # room for one or two sequences at a time
    engine = variant(engine_fp32, num_blocks=num_blocks)
    outs = engine.generate(prompts, PARAMS)
    assert engine.stats()["num_preemptions"] > 0, "the pool was meant to force preemption"
    assert [o.token_ids for o in outs] == alone
    assert_no_leaks(engine)


def test_chunked_prefill_equals_alone(engine_fp32, prompts, alone):
    engine = variant(engine_fp32, max_num_batched_tokens=7)  # every prompt spans several steps
    outs = engine.generate(prompts, PARAMS)
    assert [o.token_ids for o in outs] == alone
    assert_no_leaks(engine)


def test_shared_prefix_hits_cache_and_equals_alone(engine_fp32):
    system = (
        "You are a meticulous assistant. Answer carefully, cite your reasoning step by step, "
        "and keep every answer under fifty words. "
    ) * 3
    prompts = [
        engine_fp32.tokenizer.apply_chat_template(
            [{"role": "system", "content": system}, {"role": "user", "content": c}], tokenize=True
        )
        for c in CHATS[:4]
    ]
    expected = [
        variant(engine_fp32, enable_prefix_caching=False).generate([p], PARAMS)[0].token_ids for p in prompts
    ]
    engine = variant(engine_fp32)
    first = engine.generate(prompts[:1], PARAMS)  # fills the cache with the shared prefix
    rest = engine.generate(prompts[1:], PARAMS)
    outs = first + rest
    assert [o.token_ids for o in outs] == expected
    shared = len(
        engine_fp32.tokenizer.apply_chat_template(
            [{"role": "system", "content": system}], add_generation_prompt=False, tokenize=True
        )
    )
    bs = engine.kv.block_size
    for out in rest:
        assert out.num_cached_tokens >= (shared // bs) * bs - bs
    stats = engine.stats()
    assert stats["prefix_cache_hits"] >= sum(o.num_cached_tokens for o in rest) > 0
    assert_no_leaks(engine)


def test_abort_midway_frees_everything(engine_fp32, prompts):
    engine = variant(engine_fp32)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, PARAMS)
    for _ in range(3):
        engine.step()
    for i in range(0, len(prompts), 2):
        final = engine.abort_request(f"r{i}")
        assert final.finished and final.finish_reason == "abort"
    while engine.has_unfinished_requests():
        engine.step()
    assert_no_leaks(engine)
