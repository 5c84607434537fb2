"""What the engine hands back for each request: a snapshot after every step that produced tokens."""

from __future__ import annotations

from dataclasses import dataclass, field

from runtime.logprobs import TokenLogprob


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    """All tokens generated so far (a stop token id or eos is included)."""
    text: str
    """All generated text safe to show so far; a stop string and what follows it are removed."""
    finished: bool = False
    finish_reason: str | None = None
    """'stop' (eos, stop token or stop string), 'length' (max_tokens or context) or 'abort'."""
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    """Prompt tokens served from the prefix cache."""
    arrival_time: float | None = None
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    token_times: list[float] = field(default_factory=list)
    """time.monotonic() when each generated token was produced; same length as token_ids."""
    num_preemptions: int = 0
    index: int = 0
    """Which of the request's n sequences this is."""
    logprobs: list[TokenLogprob] | None = None
    """One per generated token when SamplingParams.logprobs is set."""
    prompt_logprobs: list[TokenLogprob | None] | None = None
    """One per prompt token when SamplingParams.prompt_logprobs is set; the first is None (nothing
    precedes it). Complete once the prompt has been computed, i.e. from the first output on."""
    error: str | None = None
    """Set when the request failed inside the engine (its step raised): what failed, without details.
    The request is then finished with finish_reason 'abort'; the engine itself keeps serving."""
