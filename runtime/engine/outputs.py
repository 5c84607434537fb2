"""What the engine hands back: a delta per step for each sequence that changed, assembled by whoever reads it.

An OutputDelta carries only what one step (or, for a reader slower than the
engine, several steps coalesced) added to one sequence: its new token ids,
their times and logprobs, and the text released with them. Handing deltas over
costs the same at token 10 and at token 10,000. A consumer that wants the whole
output appends each delta to a RequestOutput; a streaming one sends the delta
as it is. The thread engine and the engine-process client hand over the same
type.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace

from runtime.sample.token_logprob import TokenLogprob


@dataclass(kw_only=True)
class SequenceStatus:
    """Where a sequence stands: each delta carries the latest, a RequestOutput keeps it."""

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
    num_preemptions: int = 0
    embedding: list[float] | None = None
    """An embedding request's pooled, L2-normalised hidden state (SamplingParams.pooling), on its final
    delta; hidden size floats."""
    error: str | None = None
    """Set when the request failed inside the engine: what failed, without details. A delta carrying it is
    final (finish_reason 'abort'); the engine itself keeps serving."""


_LATEST_STATUS = tuple(f.name for f in fields(SequenceStatus) if f.name != "arrival_time")
"""What a RequestOutput takes from each delta as it is; arrival_time only when the delta has one."""


@dataclass
class OutputDelta(SequenceStatus):
    """What one sequence gained since the last delta its reader took."""

    request_id: str
    """The id the caller gave (that of the request, for every one of its n sequences)."""
    index: int = 0
    """Which of the request's n sequences this is."""
    new_token_ids: list[int] = field(default_factory=list)
    new_text: str = ""
    """Text released with them: a stop string and what follows it are never released, and text that
    could still grow into a stop string (or half a UTF-8 character) waits for the next delta."""
    new_token_times: list[float] = field(default_factory=list)
    """time.monotonic() when each new token was produced."""
    new_logprobs: list[TokenLogprob] | None = None
    """One per new token when SamplingParams.logprobs is set."""
    prompt_logprobs: list[TokenLogprob | None] | None = None
    """Every prompt position's, once, on the sequence's first delta (when SamplingParams.prompt_logprobs
    is set); the first is None (nothing precedes it)."""


def coalesce(deltas: list[OutputDelta]) -> list[OutputDelta]:
    """Several steps' deltas as one per sequence, in order of first appearance: the new items
    concatenated, the rest (finished, times, counts) from the latest. O(items), whatever came before."""
    if len(deltas) < 2:
        return deltas
    groups: dict[int, list[OutputDelta]] = {}
    for delta in deltas:
        groups.setdefault(delta.index, []).append(delta)
    return [group[0] if len(group) == 1 else _merge(group) for group in groups.values()]


def _merge(group: list[OutputDelta]) -> OutputDelta:
    last = group[-1]
    return replace(
        last,
        new_token_ids=[t for d in group for t in d.new_token_ids],
        new_text="".join(d.new_text for d in group),
        new_token_times=[t for d in group for t in d.new_token_times],
        new_logprobs=None if last.new_logprobs is None else [s for d in group for s in d.new_logprobs or ()],
        prompt_logprobs=next((d.prompt_logprobs for d in group if d.prompt_logprobs is not None), None),
    )


@dataclass
class RequestOutput(SequenceStatus):
    """One sequence's whole output, assembled from its deltas (append)."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    """All tokens generated so far (a stop token id or eos is included)."""
    text_parts: list[str] = field(default_factory=list)
    """The released text in the pieces it came in; `text` joins them (once, when read)."""
    token_times: list[float] = field(default_factory=list)
    """time.monotonic() when each generated token was produced; same length as token_ids."""
    index: int = 0
    logprobs: list[TokenLogprob] | None = None
    """One per generated token when SamplingParams.logprobs is set."""
    prompt_logprobs: list[TokenLogprob | None] | None = None
    """One per prompt token when SamplingParams.prompt_logprobs is set; the first is None."""

    @property
    def text(self) -> str:
        """All generated text released so far (a stop string and what follows it are removed)."""
        parts = self.text_parts
        if len(parts) > 1:
            parts[:] = ["".join(parts)]
        return parts[0] if parts else ""

    def append(self, delta: OutputDelta) -> RequestOutput:
        """Add a delta of this sequence; O(its new items). Returns self."""
        self.token_ids += delta.new_token_ids
        if delta.new_text:
            self.text_parts.append(delta.new_text)
        self.token_times += delta.new_token_times
        if delta.new_logprobs is not None:
            if self.logprobs is None:
                self.logprobs = []
            self.logprobs += delta.new_logprobs
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs = delta.prompt_logprobs
        for name in _LATEST_STATUS:
            setattr(self, name, getattr(delta, name))
        if delta.arrival_time is not None:
            self.arrival_time = delta.arrival_time
        return self
