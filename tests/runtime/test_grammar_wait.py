"""A request waits for its grammar off the step: while a large grammar compiles, the others keep decoding.

The real engine and llguidance; the grammar is a 2,000-branch `anyOf` schema, which takes over a second to
compile on these CPUs (each engine step takes tens of milliseconds).
"""

from __future__ import annotations

import time

import pytest

from runtime.sample.structured_output import json_spec
from scheduler import SamplingParams, StructuredOutput

pytestmark = pytest.mark.slow  # loads the real model

BRANCHES = 2000
SCHEMA = {
    "anyOf": [
        {
            "type": "object",
            "properties": {f"k{i}_{j}": {"type": "string", "pattern": f"^a{i}b{j}[0-9]+$"} for j in range(3)},
            "required": [f"k{i}_0"],
        }
        for i in range(BRANCHES)
    ]
}
COMPILE_TO_STEP = 3
"""The compile must span at least this many of the plain stream's steps: compiled inside one step (as it was),
that step alone would last the whole wait."""


def test_a_stream_keeps_decoding_while_another_requests_grammar_compiles(engine_fp32):
    engine = engine_fp32
    # the engine's first constrained request also builds llguidance's tokenizer, which holds the GIL (about
    # 0.4 s for this vocabulary): done here first, so that what is timed below is the grammar's compile
    small = StructuredOutput("json_schema", json_spec({"type": "object"}))
    engine.generate(["{"], SamplingParams(max_tokens=1, structured_output=small))
    # as many tokens as fit: it must outlast the compile, however slow this machine is; aborted below
    plain = engine.add_request("plain", "Tell me a story:", SamplingParams(max_tokens=None, ignore_eos=True))
    while plain.num_output_tokens < 2:
        engine.step()
    structured = StructuredOutput("json_schema", json_spec(SCHEMA))
    constrained = engine.add_request(
        "constrained", "Some JSON:", SamplingParams(max_tokens=6, structured_output=structured)
    )
    steps, before = [], plain.num_output_tokens
    while not constrained.output_token_ids and not plain.is_finished:
        start = time.monotonic()
        engine.step()
        steps.append(time.monotonic() - start)
    waited = sum(steps)
    assert constrained.output_token_ids, "the plain stream finished before the grammar compiled"
    # the longest gap between the plain stream's tokens is a fraction of the compile, not all of it
    assert max(steps) * COMPILE_TO_STEP < waited, (max(steps), waited, len(steps))
    # the plain stream was served all along: a token per step in which it ran
    assert plain.num_output_tokens - before >= len(steps) - 2, (plain.num_output_tokens, before, len(steps))
    engine.abort_request("plain")
    while engine.has_unfinished_requests():
        engine.step()
    assert constrained.is_finished and constrained.num_output_tokens >= 1
    text = engine.tokenizer.decode(constrained.output_token_ids)
    assert text.lstrip().startswith("{"), text
