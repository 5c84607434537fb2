"""One generation request as the scheduler sees it: token ids, progress, blocks.

The request owns its block table and its count of computed tokens; the block
manager and the policies only do bookkeeping over those integers.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from scheduler.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    WAITING_FOR_GRAMMAR = "waiting_for_grammar"  # queued, not yet schedulable: its grammar is compiling
    RUNNING = "running"
    PREEMPTED = "preempted"  # back in the waiting queue, its KV to be recomputed
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        return self in (
            RequestStatus.FINISHED_STOPPED,
            RequestStatus.FINISHED_LENGTH,
            RequestStatus.FINISHED_ABORTED,
        )


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams = field(default_factory=SamplingParams)
    eos_token_id: int | None = None
    tenant: str = "default"
    weight: float = 1.0
    """The tenant's share under the fair policy (from the API-key file)."""
    priority: int = 0
    """Lower runs first under the priority policy."""
    cache_salt: str | None = None
    """Prefix-cache namespace: cached blocks are shared only between requests with the same salt, so one
    tenant cannot probe another's prompts through cache hits. None: the tenant's name."""
    eog_token_ids: tuple[int, ...] = ()
    """Tokens besides eos_token_id that end the generation (end-of-turn tokens such as Gemma's
    <end_of_turn>, Llama 3's <|eot_id|>), unless ignore_eos."""
    arrival_time: float = field(default_factory=time.monotonic)

    output_token_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    """Tokens of all_token_ids whose K/V are in the cache."""
    num_cached_tokens: int = -1
    """Prompt tokens served by the prefix cache at first admission (-1: not yet admitted)."""
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)
    """Hash of each full block of all_token_ids, computed as blocks fill."""
    num_preemptions: int = 0
    index: int = 0
    """Which of its prompt's n sequences this is (SamplingParams.n)."""
    forks: list[Request] = field(default_factory=list)
    """Sequences 1..n-1 of this prompt, not yet running: when this request's prompt is computed they
    sample their first token from its logits and take its KV blocks by reference."""
    stop_reason: int | str | None = None
    """The stop token id or stop string that ended the request, if any."""
    spec_token_ids: list[int] = field(default_factory=list)
    """Tokens proposed to follow it (speculative decoding), verified with its next decode step; set by
    the runtime after each step, cleared when it is scheduled or preempted."""

    # Timestamps (time.monotonic seconds) for the latency metrics.
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None

    _token_ids: list[int] = field(default_factory=list, init=False, repr=False)
    """prompt + output in one list, kept up to date by append_output_token."""
    _prompt_of_token_ids: list[int] | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        if not self.prompt_token_ids:
            raise ValueError("prompt must contain at least one token")
        self.prompt_token_ids = list(self.prompt_token_ids)
        self._rebuild_token_ids()

    def _rebuild_token_ids(self) -> None:
        self._token_ids = self.prompt_token_ids + self.output_token_ids
        self._prompt_of_token_ids = self.prompt_token_ids

    def append_output_token(self, token: int) -> None:
        """Record one generated token (O(1); keeps all_token_ids current)."""
        self.output_token_ids.append(token)
        self._token_ids.append(token)

    @property
    def all_token_ids(self) -> list[int]:
        """Prompt then output token ids, without copying: read it, do not modify it.

        Outputs are appended with append_output_token; a prompt list assigned
        anew, or a direct append to output_token_ids, is noticed and the list
        rebuilt (editing the prompt list in place is not).
        """
        if self.prompt_token_ids is not self._prompt_of_token_ids or len(self._token_ids) != len(
            self.prompt_token_ids
        ) + len(self.output_token_ids):
            self._rebuild_token_ids()
        return self._token_ids

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    @property
    def finish_reason(self) -> str | None:
        return self.status.value if self.status.finished else None
