"""Does this request fit? The one rule, asked once where a request enters.

A request of p prompt tokens asking for up to m new tokens can run when

    p + m      <= max_model_len        the context the model (and the operator) allows
    p + m - 1  <= kv_capacity_tokens   the last sampled token is never fed back, so it holds no KV

and p >= 1, p < max_model_len (at least one token must be generated). A request
that breaks it could never finish, whatever else runs, so it is refused before
it is queued. A refusal is an InvalidRequestError whose `param` names the
field to change, which the server hands to the client as OpenAI's `param`.
"""

from __future__ import annotations

from dataclasses import dataclass


class InvalidRequestError(ValueError):
    """A request that cannot run as sent. `param` is the request field to change (OpenAI's `param`)."""

    def __init__(self, param: str, detail: str, code: str = "invalid_value"):
        super().__init__(f"{param}: {detail}")
        self.param = param
        self.detail = detail
        self.code = code
        """OpenAI's error code: "context_length_exceeded" when the request does not fit, else
        "invalid_value"."""


@dataclass(frozen=True)
class AdmissionRule:
    max_model_len: int
    """Longest token stream (prompt + output) a request may reach."""
    kv_capacity_tokens: int
    """Tokens the whole KV pool holds: what one request may occupy when it runs alone."""

    def room(self, num_prompt_tokens: int) -> int:
        """The largest max_tokens a prompt of this length may ask for (< 1: the prompt does not fit)."""
        return min(self.max_model_len - num_prompt_tokens, self.kv_capacity_tokens + 1 - num_prompt_tokens)

    def check(self, num_prompt_tokens: int, max_tokens: int) -> None:
        """Raise InvalidRequestError naming `prompt` or `max_tokens` unless the request fits."""
        p, m, limit, capacity = num_prompt_tokens, max_tokens, self.max_model_len, self.kv_capacity_tokens
        if p < 1:
            raise InvalidRequestError("prompt", "must not be empty")
        if p >= limit:
            raise InvalidRequestError(
                "prompt",
                f"{p} tokens does not fit this model's context of {limit} "
                "tokens (and at least one token must be generated)",
                "context_length_exceeded",
            )
        room = self.room(p)
        if p + m > limit:
            raise InvalidRequestError(
                "max_tokens",
                f"this model's maximum context length is {limit} tokens, "
                f"but {p} prompt tokens + max_tokens {m} = {p + m}; "
                f"{self._advice(room)}",
                "context_length_exceeded",
            )
        if p > capacity:
            raise InvalidRequestError(
                "prompt",
                f"{p} tokens do not fit the KV cache's capacity of "
                f"{capacity} tokens; raise kv_cache_bytes or send a shorter prompt",
                "context_length_exceeded",
            )
        if p + m - 1 > capacity:
            raise InvalidRequestError(
                "max_tokens",
                f"prompt ({p}) + max_tokens ({m}) needs {p + m - 1} "
                f"tokens of KV cache, more than its capacity of {capacity} tokens; "
                f"{self._advice(room)}",
                "context_length_exceeded",
            )

    def _advice(self, room: int) -> str:
        if room < 1:
            return (
                f"the prompt alone fills the KV cache ({self.kv_capacity_tokens} tokens); "
                "raise kv_cache_bytes"
            )
        bound = (
            " (the KV cache's capacity; raise kv_cache_bytes for more)"
            if self.kv_capacity_tokens + 1 < self.max_model_len
            else ""
        )
        return f"lower max_tokens to at most {room}{bound}"

    def admit(self, num_prompt_tokens: int, max_tokens: int | None, *, clamp: bool = False) -> int:
        """The max_tokens to run with, after check(): None asks for all the room there is; with clamp
        (max_tokens was a default, not the user's choice) it is lowered to the room instead of refused."""
        room = self.room(num_prompt_tokens)
        if max_tokens is None:
            max_tokens = max(room, 1)
        elif clamp:
            max_tokens = max(min(max_tokens, room), 1)
        self.check(num_prompt_tokens, max_tokens)
        return max_tokens
