"""Is this request one the engine can run? Every check on a request, in one place, run once where it enters.

Engine.add_request (offline) and both engine clients (on the caller's side,
before anything is queued) call RequestChecks.admit; what it accepts is
queued as it is and never checked again. A refusal is an InvalidRequestError
naming the field (scheduler/admission.py has the rule on lengths and the KV
pool). The checks read only what never changes, so they are safe from any
thread, and the object pickles: the engine core sends it to its client.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from runtime.model.tokenizer import Tokenizer
from runtime.sample.structured_output import check_structured_output
from scheduler import AdmissionRule, InvalidRequestError, SamplingParams


@dataclass(frozen=True)
class RequestChecks:
    tokenizer: Tokenizer
    vocab_size: int
    rule: AdmissionRule
    """Does prompt + max_tokens fit the context and the KV pool."""
    model_card: dict = field(default_factory=dict)
    """What GET /v1/models says of the model (ModelConfig.card: architecture, quantization, context)."""

    def admit(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        *,
        weight: float = 1.0,
        clamp_max_tokens: bool = False,
    ) -> tuple[list[int], SamplingParams]:
        """The prompt's token ids and the params to run with (max_tokens None: as many as fit;
        clamp_max_tokens: a default max_tokens is lowered to what fits), or InvalidRequestError."""
        if not weight > 0:
            raise InvalidRequestError("weight", f"must be positive, got {weight!r}")
        ids = self.prompt_ids(prompt)
        check_structured_output(params.structured_output)
        max_tokens = self.rule.admit(len(ids), params.max_tokens, clamp=clamp_max_tokens)
        if max_tokens != params.max_tokens:  # min_tokens never above what may be generated
            params = replace(params, max_tokens=max_tokens, min_tokens=min(params.min_tokens, max_tokens))
        return ids, params

    def prompt_ids(self, prompt: str | list[int]) -> list[int]:
        """A text prompt tokenized, or a list of token ids checked against the vocabulary."""
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt)
        if not isinstance(prompt, (list, tuple)):
            raise InvalidRequestError(
                "prompt", f"must be a string or a list of token ids, got {type(prompt).__name__}"
            )
        ids = list(prompt)
        vocab = self.vocab_size
        for i, t in enumerate(ids):
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab:
                raise InvalidRequestError("prompt", f"token {i} is {t!r}, not a token id in [0, {vocab})")
        return ids
