"""Speculative decoding on the real model (SmolLM2): greedy outputs token for token those without it, with
the n-gram proposer on prompts it copies from, with and without prefix caching, at one and several
streams, in float32 and with the GGUF's blocks packed (the C decode loop verifying proposals); structured
output checks each proposal against the grammar."""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch

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


def test_greedy_is_lossless_with_the_decode_rows_split_between_threads(prompts, monkeypatch):
    """Where other processes share the cores the engine splits a step's decode rows between threads
    (set_split), each part alone: a verifying sequence's rows attend to the keys its earlier rows write in the
    same layer, so they stay in one part. One thread, rows split in two, with and without speculation: the
    same greedy tokens, at one stream (a verifying sequence alone: not split) and at three."""
    packed = Engine.from_pretrained(
        dtype="float32", device="cpu", quantization="gguf", kv_cache_bytes=64 << 20, adaptive_threads=False
    )
    threads = torch.get_num_threads()
    cut = []
    sequence_cuts = native_decode.sequence_cuts

    def watched(positions, tables, parts):
        got = sequence_cuts(positions, tables, parts)
        cut.append((positions.shape[0], got))
        return got

    monkeypatch.setattr(native_decode, "sequence_cuts", watched)
    try:
        torch.set_num_threads(1)
        three = prompts + prompts[:1]
        want = [o.token_ids for o in variant(packed).generate(three, PARAMS)]
        native_decode.set_split(2)
        spec = variant(packed, speculative_config=NGRAM)
        assert [o.token_ids for o in spec.generate(three, PARAMS)] == want
        assert [o.token_ids for o in spec.generate(prompts[:1], PARAMS)] == want[:1]
        assert spec.stats().spec_num_accepted_tokens > 10
        assert [o.token_ids for o in variant(packed).generate(three, PARAMS)] == want  # split, no proposals
    finally:
        native_decode.set_split(1)
        torch.set_num_threads(threads)
    assert any(rows > 3 and got for rows, got in cut)  # steps verifying proposals were split ...
    assert any(rows > 1 and not got for rows, got in cut)  # ... and one sequence's rows alone were not


def test_sequence_cuts_fall_between_sequences():
    # rows: A at 7, 8, 9 (verifying two proposals), B at 4, C at 12, 13 (one proposal)
    positions = torch.tensor([7, 8, 9, 4, 12, 13])
    tables = torch.tensor([[1, 2], [1, 2], [1, 2], [3, 0], [4, 5], [4, 5]])
    assert native_decode.sequence_cuts(positions, tables, 2) == [3]
    assert native_decode.sequence_cuts(positions, tables, 3) == [3, 4]
    assert native_decode.sequence_cuts(positions[:3], tables[:3], 2) == []
    # two sequences forked from one prompt decode at the same position on tables that share blocks
    assert native_decode.sequence_cuts(torch.tensor([5, 5]), torch.tensor([[1, 2], [1, 3]]), 2) == [1]
    assert native_decode.sequence_cuts(torch.arange(8), torch.arange(8).view(8, 1), 4) == [2, 4, 6]
