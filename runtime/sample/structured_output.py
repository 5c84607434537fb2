"""Structured output: grammars that decide which tokens a sequence may sample next.

A request's SamplingParams.structured_output (a JSON schema, any JSON object, or
a Lark grammar) is compiled by llguidance, chosen over xgrammar for its much shorter
compile time per schema at a comparable per-token mask cost
(`python -m tests.bench structured` measures the mask cost in a step). Each
constrained sequence holds one matcher (its grammar state). Every step the
matchers of the constrained rows fill a packed bitmask (one bit per vocabulary
entry); it is unpacked here in torch and applied with one masked_fill to
those rows only, so an unconstrained sequence pays nothing.

The state is a function of the tokens generated so far: a sequence that was
preempted, or forked from a parent (n > 1), rebuilds its matcher by replaying
its output tokens. When the grammar is complete it allows only the end-of-
sequence token, so the sequence ends with finish_reason "stop".
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections import OrderedDict
from collections.abc import Callable
from functools import cache
from typing import TYPE_CHECKING

import llguidance

from runtime.model.tokenizer import Tokenizer
from scheduler import InvalidRequestError, StructuredOutput

if (
    TYPE_CHECKING
):  # the masks' module loads torch when first used: the server's front end only checks grammars
    import torch


@cache
def _banned_bits() -> torch.Tensor:
    """[256, 8]: for each byte of a bitmask, which of its 8 tokens are not allowed (bit clear). The bitmask's
    int32 words are little-endian, so byte k of the flattened mask holds tokens 8k .. 8k+7."""
    import torch

    return ((torch.arange(256).unsqueeze(1) >> torch.arange(8)) & 1) == 0


JSON_WHITESPACE = r"\x0A?[\x20\x09]{0,24}"
"""Whitespace allowed between JSON tokens: at most one line break and an indent. Unbounded whitespace
lets a small model loop on blank lines until max_tokens; this keeps pretty-printed JSON possible."""


class _GrammarCache:
    """Values made from a client's spec, keyed by the spec's kind and SHA-256 (never by the spec's text,
    which may be large) and bounded by the bytes of the values kept: the least recently used go first.
    Safe from any thread; two threads missing the same key both compute it, and one value is kept."""

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self.bytes = 0
        self._values: OrderedDict[tuple[str, bytes], str] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, kind: str, spec: str, make: Callable[[str, str], str]) -> str:
        key = (kind, hashlib.sha256(spec.encode("utf-8", "surrogatepass")).digest())
        with self._lock:
            if key in self._values:
                self._values.move_to_end(key)
                return self._values[key]
        value = make(kind, spec)  # outside the lock: a compile may take a while
        with self._lock:
            if key not in self._values and _cost(value) <= self.max_bytes:
                self._values[key] = value
                self.bytes += _cost(value)
                while self.bytes > self.max_bytes:
                    self.bytes -= _cost(self._values.popitem(last=False)[1])
        return value


def _cost(value: str) -> int:
    """Bytes an entry holds, about: its text and its key (an empty text still counts)."""
    return len(value) + 128


GRAMMAR_CACHE_BYTES = 64 << 20
"""Compiled grammar text kept per process (the server's, and the engine core's), least recently used
dropped first; the server caps a schema at server.schema.request_fields.MAX_SCHEMA_CHARS."""
_grammars = _GrammarCache(GRAMMAR_CACHE_BYTES)
_problems = _GrammarCache(1 << 20)


def _make_grammar(kind: str, spec: str) -> str:
    """llguidance's grammar text for a spec (raises ValueError on input it cannot read)."""
    options = {"whitespace_pattern": JSON_WHITESPACE}
    if kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, overrides=options)
    if kind == "json_schema":
        return llguidance.LLMatcher.grammar_from_json_schema(spec, overrides=options)
    if kind == "lark":
        return llguidance.LLMatcher.grammar_from_lark(spec)
    raise ValueError(f"unknown structured output kind {kind!r}")


def _grammar(kind: str, spec: str) -> str:
    return _grammars.get(kind, spec, _make_grammar)


def _make_problem(kind: str, spec: str) -> str:
    try:
        grammar = _grammar(kind, spec)
    except Exception as exc:  # whatever the compiler makes of a client's schema is the client's error
        return str(exc) or type(exc).__name__
    return llguidance.LLMatcher.validate_grammar(grammar)


def _problem(kind: str, spec: str) -> str:
    """'' when the spec compiles, else llguidance's reason."""
    return _problems.get(kind, spec, _make_problem)


def check_structured_output(structured: StructuredOutput | None) -> None:
    """The rule where a request enters: its grammar compiles, or InvalidRequestError naming the
    request field it came from (e.g. response_format.json_schema). Needs no tokenizer."""
    if structured is None:
        return
    problem = _problem(structured.kind, structured.spec)
    if problem:
        raise InvalidRequestError(
            structured.source, f"is not a grammar this server can enforce: {problem[:300]}; fix the schema"
        )


class GrammarBackend:
    """llguidance over one model's tokenizer: builds matchers and applies their masks to logits.

    The llguidance tokenizer (its view of every token's bytes) takes a second or two to build, so it
    is made on the first constrained request, not at start-up."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.words = (vocab_size + 31) // 32
        """int32 words of one row's bitmask."""
        self._ll: llguidance.LLTokenizer | None = None
        self._lock = threading.Lock()

    @property
    def ll_tokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._ll is None:
                self._ll = llguidance.LLTokenizer(
                    self.tokenizer.tokenizer_json(),
                    n_vocab=self.vocab_size,
                    eos_token=self.tokenizer.eos_token_id,
                )
            return self._ll

    def matcher(self, structured: StructuredOutput, output_ids: list[int] = ()) -> llguidance.LLMatcher:
        """A matcher at the state after output_ids (replayed: a resumed or forked sequence)."""
        grammar = _grammar(structured.kind, structured.spec)
        matcher = llguidance.LLMatcher(self.ll_tokenizer, grammar, log_level=0)
        for token in output_ids:
            matcher.consume_token(token)
        return matcher

    def apply_masks(
        self,
        logits: torch.Tensor,
        rows: list[int],
        matchers: list[llguidance.LLMatcher],
        eos_token_ids: list[int | None],
    ) -> None:
        """logits: float32 [N, vocab], edited in place on `rows` only: tokens the row's grammar does
        not allow become -inf. A row left with no token at all (min_tokens banning the end-of-sequence
        a complete grammar asks for, or a matcher in error) gets its end-of-sequence token back."""
        import torch

        with torch.inference_mode():
            bitmask = torch.empty(len(rows), self.words, dtype=torch.int32)
            for j, m in enumerate(matchers):
                if m.is_error():
                    bitmask[j] = -1  # let it run out; its output is no longer checked
                else:
                    m.unsafe_compute_mask_ptr(bitmask[j].data_ptr(), self.words * 4)
            vocab = logits.shape[-1]
            banned = _banned_bits()[bitmask.view(torch.uint8).long()].view(len(rows), -1)[:, :vocab]
            banned = banned.to(logits.device, non_blocking=True)
            whole = len(rows) == logits.shape[0]
            sub = logits if whole else logits[rows]
            sub.masked_fill_(banned, float("-inf"))
            dead = (sub.amax(dim=-1) == float("-inf")).nonzero().flatten().tolist()
            for j in dead:
                if eos_token_ids[j] is not None:
                    sub[j, eos_token_ids[j]] = 0.0
            if not whole:
                logits[rows] = sub

    @staticmethod
    def accept(matcher: llguidance.LLMatcher, token: int) -> None:
        """Advance a sequence's grammar by the token it sampled."""
        if not matcher.is_error():
            matcher.consume_token(token)


def json_spec(schema: dict | str) -> str:
    """A schema as text, the cache key of its compiled grammar. Keys keep their order: the grammar
    writes properties in the order the schema lists them."""
    return schema if isinstance(schema, str) else json.dumps(schema)
