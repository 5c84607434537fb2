"""Speculative decoding on the real model (SmolLM2): greedy outputs token for token those without it, with
the n-gram proposer on prompts it copies from, with and without prefix caching, at one and several
streams, in float32 and with the GGUF's blocks packed (the C decode loop verifying proposals); structured
output checks each proposal against the grammar."""

from __future__ import annotations

import json

import jsonschema
import pytest

import runtime.model.decode_layers as native_decode
from runtime import Engine, SamplingParams
from scheduler import StructuredOutput
from tests.runtime.conftest import chat_ids

NGRAM = {
    "method": "ngram",
    "num_speculative_tokens": 5,
    "prompt_lookup_min": 2,
    "prompt_lookup_max": 5,
    "disable_by_batch_size": 1000,  # proposals at every batch size
}
TEXT = (
    "The lighthouse keeper climbed the spiral stairs every evening at dusk, carrying a small brass lamp "
    "and a notebook in which he recorded the wind, the tide and the ships that passed."
)
ASKS = [f"Repeat this text exactly, word for word:\n\n{TEXT}", "Write a short poem about the sea."]
PARAMS = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


def variant(base: Engine, **kw) -> Engine:
    kw.setdefault("num_blocks", 256)
    return every_proposal_pays(Engine(base.model, base.tokenizer, **kw))


def every_proposal_pays(engine: Engine) -> Engine:
    """Proposals at every batch size and rate (no step-cost model): the tests check verification."""
    if engine.speculator is not None:
        engine.speculator.row_cost = 0.0
    return engine


@pytest.fixture(scope="module")
def prompts(engine_fp32):
    return [chat_ids(engine_fp32.tokenizer, a) for a in ASKS]


@pytest.fixture(scope="module")
def want(engine_fp32, prompts):
    return [o.token_ids for o in variant(engine_fp32).generate(prompts, PARAMS)]


def test_greedy_is_lossless_on_the_real_model(engine_fp32, prompts, want):
    spec = variant(engine_fp32, speculative_config=NGRAM)
    assert [o.token_ids for o in spec.generate(prompts, PARAMS)] == want  # two streams, prefix caching
    stats = spec.stats()
    assert stats.spec_num_accepted_tokens > 10, "the copy prompt should have proposals accepted"
    assert stats.num_free_blocks == stats.num_blocks
    alone = variant(engine_fp32, enable_prefix_caching=False, speculative_config=NGRAM)
    assert [o.token_ids for o in alone.generate(prompts[:1], PARAMS)] == want[:1]  # one, no caching


def test_greedy_is_lossless_through_the_c_decode_loop(prompts, monkeypatch):
    """Packed weights: a verifying sequence's rows go through the C layer loop with the plain decodes, and
    the greedy tokens are those without speculation, at one stream and at three."""
    packed = Engine.from_pretrained(
        dtype="float32", device="cpu", quantization="gguf", kv_cache_bytes=64 << 20
    )
    rows = []
    forward = native_decode.NativeDecode.forward

    def counted(self, h, *args):
        rows.append(h.shape[0])
        return forward(self, h, *args)

    monkeypatch.setattr(native_decode.NativeDecode, "forward", counted)
    three = prompts + prompts[:1]
    want = [o.token_ids for o in variant(packed).generate(three, PARAMS)]
    plain_rows = max(rows)
    rows.clear()
    spec = variant(packed, speculative_config=NGRAM)
    assert [o.token_ids for o in spec.generate(three, PARAMS)] == want
    assert [o.token_ids for o in spec.generate(prompts[:1], PARAMS)] == want[:1]
    assert spec.stats().spec_num_accepted_tokens > 10
    assert plain_rows <= 3 and max(rows) > 3  # steps with proposals' rows ran in the C loop


def test_structured_output_checks_proposals_against_the_grammar(engine_fp32):
    schema = {
        "type": "object",
        "properties": {"text": {"type": "string", "maxLength": 60}, "words": {"type": "integer"}},
        "required": ["text", "words"],
        "additionalProperties": False,
    }
    prompt = chat_ids(engine_fp32.tokenizer, f"Return JSON with the text quoted and its word count:\n{TEXT}")
    params = SamplingParams(
        max_tokens=40, temperature=0, structured_output=StructuredOutput("json_schema", json.dumps(schema))
    )
    want = variant(engine_fp32).generate(prompt, params)[0]
    spec = variant(engine_fp32, speculative_config=NGRAM)
    got = spec.generate(prompt, params)[0]
    assert got.token_ids == want.token_ids and got.finish_reason == want.finish_reason == "stop"
    jsonschema.validate(json.loads(got.text), schema)
    assert spec.stats().spec_num_accepted_tokens > 0
