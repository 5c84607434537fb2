"""The admission rule on the real engine, at its exact boundaries: the largest request that fits is
admitted and runs to its end; one token more is refused with `param` naming the field."""

from __future__ import annotations

import pytest

from runtime import Engine, SamplingParams
from scheduler import InvalidRequestError

PROMPT = list(range(100, 110))  # 10 token ids


def engine_over(base: Engine, **settings) -> Engine:
    """Another engine over the already loaded model, with its own KV pool and scheduler."""
    return Engine(base.model, base.tokenizer, **settings)


def run(engine: Engine, prompt: list[int], max_tokens: int | None):
    return engine.generate([prompt], SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))[0]


def test_kv_capacity_boundary(engine_fp32):
    engine = engine_over(engine_fp32, num_blocks=4, block_size=8)  # 32 tokens of KV
    out = run(engine, PROMPT, 23)  # 10 + 23 - 1 = 32 tokens hold KV: fits exactly
    assert len(out.token_ids) == 23 and out.finish_reason == "length"
    with pytest.raises(InvalidRequestError) as err:
        run(engine, PROMPT, 24)
    assert err.value.param == "max_tokens"
    assert not engine.has_unfinished_requests()
    assert len(run(engine, PROMPT, None).token_ids) == 23  # None: all the room there is


def test_context_boundary(engine_fp32):
    engine = engine_over(engine_fp32, num_blocks=64, block_size=8, max_model_len=24)
    out = run(engine, PROMPT, 14)  # 10 + 14 = 24 = the context
    assert len(out.token_ids) == 14
    with pytest.raises(InvalidRequestError) as err:
        run(engine, PROMPT, 15)
    assert err.value.param == "max_tokens"
    assert len(run(engine, list(range(100, 123)), 1).token_ids) == 1  # 23-token prompt + 1
    with pytest.raises(InvalidRequestError) as err:
        run(engine, list(range(100, 124)), 1)
    assert err.value.param == "prompt"
