"""Structured output's cost in the batched step: 16 decoding sequences, half held to a JSON schema.

Two cases, alternated within one run (the machine is shared): all 16 unconstrained (the baseline) and
8 constrained + 8 unconstrained. Each round prefills the 16 prompts, then times DECODE_STEPS decode
steps of the whole batch. The schema asks for an array of at least 1,000 objects, so no constrained
sequence can finish within the timed steps: every one pays for its mask on every step. The issue's
target: the half-constrained step within 15% of the unconstrained one. The time spent in the grammar
(mask fill, unpacking, masking, advancing the matchers) is measured in the same steps.
"""

from __future__ import annotations

import json
import statistics
import time

from runtime import Engine, SamplingParams, StructuredOutput

BATCH = 16
DECODE_STEPS = 24
ROUNDS = 5
SCHEMA = {
    "type": "array",
    "minItems": 1000,
    "items": {
        "type": "object",
        "properties": {
            "name": {"type": "string"},
            "age": {"type": "integer"},
            "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}},
        },
        "required": ["name", "age", "tags"],
    },
}


class _Timed:
    """Wraps the runner's grammar backend to add up the seconds spent in it."""

    def __init__(self, backend):
        self.backend = backend
        self.seconds = 0.0

    def __getattr__(self, name):
        return getattr(self.backend, name)

    def apply_masks(self, *args):
        start = time.perf_counter()
        self.backend.apply_masks(*args)
        self.seconds += time.perf_counter() - start

    def accept(self, *args):
        start = time.perf_counter()
        self.backend.accept(*args)
        self.seconds += time.perf_counter() - start


def _decode_steps(engine: Engine, prompts: list[list[int]], constrained: int) -> tuple[float, float]:
    """(median seconds per decode step, median seconds per step in the grammar)."""
    so = StructuredOutput("json_schema", json.dumps(SCHEMA))
    ids = []
    for i, prompt in enumerate(prompts):
        params = SamplingParams(
            max_tokens=DECODE_STEPS + 8,
            temperature=0.8,
            seed=i,
            ignore_eos=True,
            structured_output=so if i < constrained else None,
        )
        ids.append(engine.add_request(None, prompt, params).request_id)
    started: set[str] = set()
    while len(started) < len(prompts):  # prefill every prompt and sample its first token
        started |= {out.request_id for out in engine.step() if out.token_ids}
    timed = engine.runner.grammar = _Timed(engine.grammar)
    steps, grammar = [], []
    for _ in range(DECODE_STEPS):
        timed.seconds = 0.0
        start = time.perf_counter()
        outs = engine.step()
        steps.append(time.perf_counter() - start)
        grammar.append(timed.seconds)
        assert len(outs) == len(prompts), "a sequence left the batch: the timed steps must be full"
    engine.runner.grammar = engine.grammar
    for request_id in ids:
        engine.abort_request(request_id)
    engine.step()
    return statistics.median(steps), statistics.median(grammar)


def run() -> dict:
    engine = Engine.from_pretrained(dtype="float32", kv_cache_bytes=256 << 20, max_num_seqs=BATCH)
    questions = [f"List people as JSON, starting with person number {i}." for i in range(BATCH)]
    prompts = [
        engine.tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=True)
        for q in questions
    ]
    _decode_steps(engine, prompts, BATCH // 2)  # warm-up: the grammar tokenizer, compiled schema, kernels
    cases = {"unconstrained": 0, f"{BATCH // 2} of {BATCH} constrained": BATCH // 2}
    step_times: dict[str, list[float]] = {name: [] for name in cases}
    grammar_times: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(ROUNDS):
        for name, constrained in cases.items():
            step, grammar = _decode_steps(engine, prompts, constrained)
            step_times[name].append(step)
            grammar_times[name].append(grammar)
    base = statistics.median(step_times["unconstrained"])
    rows = [
        {
            "case": name,
            "step_ms": 1000 * statistics.median(step_times[name]),
            "grammar_ms": 1000 * statistics.median(grammar_times[name]),
            "ratio_to_unconstrained": statistics.median(step_times[name]) / base,
        }
        for name in cases
    ]
    return {
        "title": f"structured output: decode step of a batch of {BATCH}, half JSON-schema constrained (fp32)",
        "rows": rows,
        "notes": [
            f"median step of {DECODE_STEPS} decode steps, median over {ROUNDS} alternating rounds; "
            "target: ratio <= 1.15",
            "grammar_ms: mask fill (llguidance), unpack + masked_fill (torch), matcher advance, per step",
        ],
    }
