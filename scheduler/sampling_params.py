"""How to pick each next token and when to stop: the per-request knobs.

Plain data with validation. The scheduler reads the stop conditions that are
about token ids and lengths; the runtime reads the sampling knobs and the stop
strings (which need the detokenizer).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

MAX_LOGPROBS = 20
"""Most alternatives per position that logprobs / prompt_logprobs may ask for (OpenAI's limit)."""
GREEDY_TEMPERATURE = 1e-5
"""Temperatures below this sample greedily: dividing float32 logits by a smaller one can overflow
to inf (and NaN probabilities), and the distribution is already indistinguishable from argmax."""
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256
"""Bounds on stop strings: each step searches the new text for every one, and the longest sets how much
text is held back from a stream."""
MAX_STOP_TOKEN_IDS = 1024
SEED_RANGE = (-(1 << 63), 1 << 64)
"""Seeds a torch.Generator accepts: [-2**63, 2**64)."""


@dataclass(frozen=True)
class StructuredOutput:
    """A grammar the output must follow, enforced while decoding (runtime/sample/structured_output.py)."""

    kind: str
    """'json_object' (any JSON object), 'json_schema' (spec: the schema as JSON text) or 'lark'."""
    spec: str = ""
    source: str = "response_format"
    """The request field it came from, named by errors (e.g. 'response_format.json_schema')."""

    def __post_init__(self) -> None:
        if self.kind not in STRUCTURED_OUTPUT_KINDS:
            raise ValueError(
                f"structured_output kind must be one of {', '.join(STRUCTURED_OUTPUT_KINDS)}, got {self.kind!r}"
            )
        if not isinstance(self.spec, str):
            raise ValueError("structured_output spec must be text (a JSON schema as JSON, or a Lark grammar)")


STRUCTURED_OUTPUT_KINDS = ("json_object", "json_schema", "lark")
POOLING_KINDS = ("last", "mean")
"""How an embedding request pools its prompt's final hidden states: the last token's row, or the mean of
every row (then L2-normalised either way)."""


@dataclass
class SamplingParams:
    max_tokens: int | None = 16
    """Most tokens to generate (>= 1); None: as many as the context and the KV cache leave room for."""
    temperature: float = 1.0
    """0 (or anything below GREEDY_TEMPERATURE) means greedy; otherwise logits are divided by it."""
    top_p: float = 1.0
    """Nucleus sampling: keep the smallest set of tokens whose probability reaches top_p, in (0, 1]."""
    top_k: int = -1
    """Keep the k most likely tokens; -1 or 0 keeps all."""
    seed: int | None = None
    """Makes sampling of this request reproducible, whatever else is in the batch."""
    stop: list[str] = field(default_factory=list)
    """Stop when the text contains one of these; the stop string is not returned."""
    stop_token_ids: list[int] = field(default_factory=list)
    """Stop when one of these token ids is generated (it is kept in token_ids)."""
    ignore_eos: bool = False
    """Keep generating past the model's end-of-turn token (benchmarks)."""
    presence_penalty: float = 0.0
    """OpenAI's: subtracted once from the logit of every token already generated, in [-2, 2]."""
    frequency_penalty: float = 0.0
    """OpenAI's: subtracted from a token's logit once per time it was generated, in [-2, 2]."""
    repetition_penalty: float = 1.0
    """CTRL's (as in transformers and vLLM): logits of tokens in the prompt or the output are divided by it
    when positive and multiplied when negative; 1 disables it, > 0."""
    n: int = 1
    """Sequences sampled from the one prompt: its KV blocks are computed once and shared (forked)."""
    logprobs: int | None = None
    """Return the log-probability of each generated token and of the `logprobs` most likely
    alternatives (0: the chosen token only; None: no logprobs), at most MAX_LOGPROBS."""
    prompt_logprobs: int | None = None
    """The same for every prompt token after the first (the prompt is then never served from the
    prefix cache, whose blocks carry no logits)."""
    logprobs_mode: str = "raw"
    """'raw': log-softmax of the model's logits; 'processed': after logit_bias, min_tokens, penalties
    and temperature, the distribution the token was drawn from."""
    min_tokens: int = 0
    """End-of-sequence and stop_token_ids cannot be sampled before this many tokens are generated."""
    logit_bias: dict[int, float] = field(default_factory=dict)
    """Token id -> value added to its logit before sampling, in [-100, 100]."""
    structured_output: StructuredOutput | None = None
    """A grammar every generated token must keep the output inside (JSON schema, JSON object, Lark)."""
    pooling: str | None = None
    """Embed instead of generate: 'last' or 'mean' (POOLING_KINDS). The prompt is computed (prefill only,
    through the same scheduler) and its pooled, normalised hidden state returned as OutputDelta.embedding;
    nothing is sampled: the request ends after its prompt on a placeholder eos token (finish_reason 'stop')."""

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.max_tokens is not None:
            _check_int("max_tokens", self.max_tokens)
            if self.max_tokens < 1:
                raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        _check_number("temperature", self.temperature)
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        _check_number("top_p", self.top_p)
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        _check_int("top_k", self.top_k)
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1 (disabled), 0 (disabled) or positive, got {self.top_k}")
        if self.seed is not None:
            _check_int("seed", self.seed)
            if not SEED_RANGE[0] <= self.seed < SEED_RANGE[1]:
                raise ValueError("seed must fit in 64 bits: an integer in [-2**63, 2**64)")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise ValueError(f"stop may hold at most {MAX_STOP_STRINGS} strings, got {len(self.stop)}")
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop must be non-empty strings, got {str(s)[:20]!r}")
            if len(s) > MAX_STOP_CHARS:
                raise ValueError(f"stop strings may be at most {MAX_STOP_CHARS} characters, got {len(s)}")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise ValueError(
                f"stop_token_ids may hold at most {MAX_STOP_TOKEN_IDS} ids, got {len(self.stop_token_ids)}"
            )
        for t in self.stop_token_ids:
            _check_int("stop_token_ids", t)
        for name in ("presence_penalty", "frequency_penalty"):
            _check_number(name, getattr(self, name))
            if not -2 <= getattr(self, name) <= 2:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        _check_number("repetition_penalty", self.repetition_penalty)
        if not self.repetition_penalty > 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        _check_int("n", self.n)
        if self.n < 1:
            raise ValueError(f"n must be at least 1, got {self.n}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None:
                _check_int(name, value)
                if not 0 <= value <= MAX_LOGPROBS:
                    raise ValueError(f"{name} must be in [0, {MAX_LOGPROBS}], got {value}")
        if self.logprobs_mode not in ("raw", "processed"):
            raise ValueError(f"logprobs_mode must be 'raw' or 'processed', got {self.logprobs_mode!r}")
        _check_int("min_tokens", self.min_tokens)
        if self.min_tokens < 0 or (self.max_tokens is not None and self.min_tokens > self.max_tokens):
            raise ValueError(
                f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}"
            )
        self.logit_bias = dict(self.logit_bias or {})
        for token, bias in self.logit_bias.items():
            _check_int("logit_bias", token)
            _check_number("logit_bias", bias)
            if not -100 <= bias <= 100:
                raise ValueError(f"logit_bias values must be in [-100, 100], got {bias} for token {token}")

        if self.pooling is not None:
            if self.pooling not in POOLING_KINDS:
                raise ValueError(f"pooling must be one of {', '.join(POOLING_KINDS)}, got {self.pooling!r}")
            if self.n != 1 or self.max_tokens != 1 or self.structured_output is not None:
                raise ValueError("pooling asks for an embedding: n and max_tokens 1, no structured_output")

    @property
    def needs_every_prompt_row(self) -> bool:
        """Every prompt position must be computed (prompt logprobs, mean pooling): no prefix cache hits,
        whose blocks keep K/V but neither logits nor hidden states."""
        return self.prompt_logprobs is not None or self.pooling == "mean"

    @property
    def penalized(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    @property
    def constrains_logits(self) -> bool:
        """Logits are edited before sampling (bias or min_tokens), beyond penalties and temperature."""
        return bool(self.logit_bias) or self.min_tokens > 0

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1


def _check_int(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {value!r}")


def _check_number(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number, got {value!r}")
    try:
        finite = math.isfinite(value)
    except OverflowError:  # an int too large for a float
        finite = False
    if not finite:
        raise ValueError(f"{name} must be a finite number, got {str(value)[:20]}")
