"""SchedulerOutput: one step's plan, and the narrow view of it the model runner reads.

The runner never touches a scheduler Request. It keeps its own state per
sequence (token ids, block table, sampling params) and updates it from the
plan alone:

    new_requests      a request the runner has not seen, or one resumed after a preemption
                      (the runner dropped it then): all its tokens so far and all its blocks
    cached_requests   a request the runner holds: only the blocks added since the last plan,
                      and the entries a copy on write replaced (their contents are in block_copies)
    num_scheduled_tokens[request_id]
                      tokens to compute this step, from num_computed_tokens on, proposed ones included
    spec_token_ids[request_id]
                      a decode's proposed tokens (speculative decoding): its last token and
                      these are computed in one step, and each proposal is accepted or rejected
                      by the logits of the row before it; n = 1 + len(proposals)
    preempted_request_ids, finished_request_ids
                      requests whose state the runner drops (finished: since the last plan,
                      aborted included); a finished one also loses its sampling generator

The tokens the runner samples it appends to its own copy; the scheduler books
the same tokens in update_from_output, so both agree without sharing a list.
`scheduled` and `preempted` (scheduler Requests) are the scheduler's own
bookkeeping for update_from_output, not for the runner.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from scheduler.request import Request
from scheduler.sampling_params import SamplingParams


@dataclass(frozen=True)
class NewRequestData:
    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    """Tokens generated before a preemption ([] for a request never run)."""
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    """Tokens whose K/V these blocks already hold (a prefix-cache hit)."""
    eos_token_id: int | None = None
    """Banned with stop_token_ids while fewer than min_tokens are generated."""
    forks: list[tuple[str, SamplingParams]] = field(default_factory=list)
    """(request id, params) of sibling sequences (n > 1) that sample their first token from this
    request's last prompt row, then start from its KV blocks by reference."""
    eog_token_ids: tuple[int, ...] = ()
    """The other end-of-generation tokens (Request.eog_token_ids): banned with eos_token_id."""


@dataclass(frozen=True)
class CachedRequestData:
    request_id: str
    new_block_ids: list[int]
    """Blocks appended to its block table since the last plan."""
    num_computed_tokens: int
    replaced_block_ids: list[tuple[int, int]] = field(default_factory=list)
    """(index, block): entries of its block table replaced since the last plan (copy on write)."""
    num_kept_blocks: int | None = None
    """Entries of its block table to keep before appending new_block_ids: fewer than it holds when
    the blocks of rejected proposals were freed since (None: all)."""


@dataclass
class SchedulerOutput:
    scheduled: list[tuple[Request, int]] = field(default_factory=list)
    """(request, tokens to compute) in batch order: request.all_token_ids[num_computed_tokens :
    num_computed_tokens + n]; num_computed_tokens is advanced only by update_from_output."""
    preempted: list[Request] = field(default_factory=list)
    num_batched_tokens: int = 0
    """Sum of n over scheduled: tokens computed this step."""

    # ---- what the model runner reads ----
    new_requests: list[NewRequestData] = field(default_factory=list)
    cached_requests: list[CachedRequestData] = field(default_factory=list)
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    preempted_request_ids: list[str] = field(default_factory=list)
    finished_request_ids: list[str] = field(default_factory=list)
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    """(source, destination) KV blocks to copy before this step runs (copy on write of a forked block)."""
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)
    """request id -> the proposed tokens scheduled after its last token (counted in its n)."""

    def __post_init__(self) -> None:
        if not self.num_batched_tokens:
            self.num_batched_tokens = sum(n for _, n in self.scheduled)
