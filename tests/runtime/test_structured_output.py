"""Structured output on the real engine: every sequence's text parses and validates against its schema
(checked with jsonschema, an implementation independent of llguidance), forks and preempted sequences
included; the mask applied in torch equals llguidance's own bitmask application."""

from __future__ import annotations

import json

import jsonschema
import numpy as np
import pytest
import torch
from llguidance.numpy import apply_token_bitmask_inplace

from runtime import Engine, SamplingParams, StructuredOutput
from runtime.sample.structured_output import check_structured_output, json_spec
from scheduler import InvalidRequestError

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "color": {"enum": ["red", "green", "blue"]},
    },
    "required": ["name", "age", "color"],
    "additionalProperties": False,
}
ORDER = {
    "type": "object",
    "properties": {
        "items": {
            "type": "array",
            "minItems": 1,
            "maxItems": 2,
            "items": {
                "type": "object",
                "properties": {"sku": {"type": "string", "maxLength": 8}, "price": {"type": "number"}},
                "required": ["sku", "price"],
                "additionalProperties": False,
            },
        },
        "paid": {"type": "boolean"},
    },
    "required": ["items", "paid"],
    "additionalProperties": False,
}


def chat(engine: Engine, text: str) -> list[int]:
    return engine.tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=True)


def constrained(schema: dict, **kw) -> SamplingParams:
    return SamplingParams(structured_output=StructuredOutput("json_schema", json_spec(schema)), **kw)


def test_schemas_hold_for_greedy_sampled_and_forked_sequences(engine_fp32):
    prompt = chat(engine_fp32, "Describe a person (name, age, favourite colour) as JSON.")
    order = chat(engine_fp32, "Give me a small shop order as JSON.")
    outs = engine_fp32.generate(
        [prompt, prompt, order, prompt],
        [
            constrained(PERSON, max_tokens=60, temperature=0),
            constrained(PERSON, max_tokens=60, temperature=1.0, seed=5, n=3),
            constrained(ORDER, max_tokens=120, temperature=0.7, seed=1),
            SamplingParams(max_tokens=8, temperature=0),  # unconstrained beside them
        ],
    )
    for out, schema in zip(outs[:5], [PERSON] * 4 + [ORDER]):
        assert out.finish_reason == "stop", out.text
        jsonschema.validate(json.loads(out.text), schema)
    assert len({o.text for o in outs[1:4]}) > 1  # the forks sample their own outputs
    free = engine_fp32.generate(prompt, SamplingParams(max_tokens=8, temperature=0))[0]
    assert outs[5].token_ids == free.token_ids  # a neighbour's mask does not touch this row


def test_json_object_survives_preemption(engine_fp32):
    # 12 blocks of 16 tokens for 4 sequences of ~100 tokens each: they preempt one another. One seed:
    # a preempted sequence, its grammar state rebuilt by replaying its tokens, ends as the others do.
    engine = Engine(engine_fp32.model, engine_fp32.tokenizer, num_blocks=12, block_size=16)
    prompt = chat(engine, "Describe a person (name, age, favourite colour) as JSON.")
    params = SamplingParams(
        max_tokens=60, temperature=0.8, seed=2, structured_output=StructuredOutput("json_object")
    )
    outs = engine.generate([prompt] * 4, [params] * 4)
    assert any(o.num_preemptions for o in outs) and not all(o.num_preemptions for o in outs)
    for out in outs:
        assert out.finish_reason == "stop" and isinstance(json.loads(out.text), dict)
        assert out.token_ids == outs[0].token_ids


def test_mask_equals_llguidance_application(engine_fp32):
    grammar = engine_fp32.grammar
    so = StructuredOutput("json_schema", json_spec(ORDER))
    prefixes = [
        '{"items": [{"sku": "ab',
        '{"items": [{"sku": "x", "price": 1',
        '{"items": [{"sku": "", "price": 2}], "pa',
    ]
    matchers = [
        grammar.matcher(so, engine_fp32.tokenizer.encode(p, add_special_tokens=False)) for p in prefixes
    ]
    logits = torch.randn(5, engine_fp32.vocab_size)
    expected = logits.numpy().copy()
    rows = [0, 2, 4]
    grammar.apply_masks(logits, rows, matchers, [None] * 3)
    for row, m in zip(rows, matchers):
        mask = np.frombuffer(m.compute_bitmask(), dtype=np.int32).reshape(1, -1)
        apply_token_bitmask_inplace(expected[row : row + 1], mask)
    assert np.array_equal(logits.numpy(), expected)
    assert torch.isinf(logits[0]).sum() > 0 and not torch.isinf(logits[1]).any()


def test_invalid_schema_names_the_field():
    with pytest.raises(InvalidRequestError) as err:
        check_structured_output(
            StructuredOutput("json_schema", json.dumps({"type": "bogus"}), "response_format.json_schema")
        )
    assert err.value.param == "response_format.json_schema" and "bogus" in str(err.value)
