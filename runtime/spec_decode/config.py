"""SpeculativeConfig: which proposer suggests tokens for the model to verify, and how many.

It reads vLLM's `--speculative-config` JSON shape, e.g.

    {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_min": 2, "prompt_lookup_max": 5}
    {"method": "suffix", "num_speculative_tokens": 8}
    {"method": "draft_model", "model": "/path/draft.gguf", "num_speculative_tokens": 4}

Every error names the field at fault.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields

METHODS = ("ngram", "suffix", "draft_model")


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str = "ngram"
    """ngram: prompt lookup over the request's own tokens; suffix: a suffix index over them and the same
    tenant's recent requests; draft_model: a smaller model with the same vocabulary."""
    num_speculative_tokens: int = 5
    """Most tokens proposed (and verified) per request per step."""
    prompt_lookup_min: int = 2
    """ngram: the shortest suffix of the tokens so far that must recur earlier to propose what followed it."""
    prompt_lookup_max: int = 5
    """ngram: the longest such suffix tried (longer matches are tried first)."""
    model: str | None = None
    """draft_model: the draft checkpoint (a .gguf file or a Hugging Face directory)."""
    suffix_decoding_max_tree_depth: int = 24
    """suffix: the longest context matched against the index (tokens)."""
    suffix_decoding_max_cached_requests: int = 64
    """suffix: recent finished requests kept per tenant (0: the request's own tokens only)."""
    suffix_decoding_min_token_prob: float = 0.1
    """suffix: a continuation seen in fewer than this fraction of the matches is not proposed."""
    disable_by_batch_size: int | None = None
    """Propose nothing while at least this many requests run (verification then costs more than it saves).
    None: the crossover measured on CPU (runtime/spec_decode/speculator.py)."""
    min_acceptance_rate: float | None = None
    """A request whose proposals are accepted less often than this (each given those before it, a running
    average) backs off: proposes nothing for a while. None: where no proposal pays at the batch size, by
    the step costs measured on CPU (runtime/spec_decode/speculator.py: 0.22 for a lone stream)."""

    def __post_init__(self) -> None:
        name = "speculative_config"
        if self.method not in METHODS:
            raise ValueError(f"{name}.method: {self.method!r} is not one of {', '.join(METHODS)}")
        for f in ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max"):
            value = getattr(self, f)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}.{f}: must be a positive integer, got {value!r}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(
                f"{name}.prompt_lookup_min: {self.prompt_lookup_min} exceeds prompt_lookup_max "
                f"{self.prompt_lookup_max}"
            )
        if self.num_speculative_tokens > 32:
            raise ValueError(f"{name}.num_speculative_tokens: at most 32, got {self.num_speculative_tokens}")
        if self.method == "draft_model" and not self.model:
            raise ValueError(f"{name}.model: method draft_model needs the draft checkpoint's path")
        if self.min_acceptance_rate is not None and not 0.0 <= self.min_acceptance_rate <= 1.0:
            raise ValueError(
                f"{name}.min_acceptance_rate: must lie in [0, 1], got {self.min_acceptance_rate}"
            )

    @classmethod
    def parse(cls, value: SpeculativeConfig | dict | str | None) -> SpeculativeConfig | None:
        """A config from its JSON text or dict (None, '' and {} mean no speculation)."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            if not value.strip():
                return None
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ValueError(f"speculative_config: not JSON ({exc.msg}); e.g. {EXAMPLE}") from None
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config: must be a JSON object, e.g. {EXAMPLE}")
        if not value:
            return None
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(
                f"speculative_config.{unknown[0]}: not a known field; known: {', '.join(sorted(known))}"
            )
        if "method" not in value:
            raise ValueError(f"speculative_config.method: required, one of {', '.join(METHODS)}")
        return cls(**value)


EXAMPLE = '{"method": "ngram", "num_speculative_tokens": 5}'
