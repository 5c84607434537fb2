"""Speculator: after each step, the tokens each decoding request proposes to verify in its next one.

It keeps a proposer's state per request (runtime/spec_decode/ngram.py, suffix.py), sets
Request.spec_token_ids on the running requests that will decode next, and learns from what was
accepted:

* backoff, per request: a request whose proposals are mostly rejected pays for rows that give
  nothing, so after a verification that leaves its running acceptance rate (an exponential average)
  below min_acceptance_rate it proposes nothing for a cool-down of steps that doubles each time
  (up to MAX_COOLDOWN) and is reset by a verification that goes well;
* batch size: while at least disable_by_batch_size requests run, nobody proposes. A large batch's
  decode step is bound by compute rather than by reading the weights, so verifying k more rows per
  request costs about k more decode steps' compute, while a lone stream gets them nearly free.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from runtime.spec_decode.config import SpeculativeConfig
from runtime.spec_decode.ngram import NgramIndex
from runtime.spec_decode.suffix import MAX_CONTEXT, MIN_CONTEXT, SuffixStore
from scheduler import Request

DEFAULT_DISABLE_BY_BATCH_SIZE = 2
"""Running requests from which nobody proposes, unless the config says otherwise. Measured on a 2-core
CPU (`python -m tests.bench speculative`, tests/bench/RESULTS.md): a step verifying proposals leaves the
C decode loop for the multi-row path and costs 2-3.5x a one-row decode step, so with proposals forced on,
8 streams of the copy workload ran at 0.61x and 32 at 0.24x; only a lone stream gained."""
MAX_COOLDOWN = 32
"""The longest a backed-off request goes without proposing, in steps."""
EWMA = 0.5
"""Weight of the latest verification in a request's running acceptance rate."""


@dataclass
class _State:
    index: NgramIndex
    rate: float = 1.0
    """Running acceptance rate of its proposals (accepted / proposed)."""
    cooldown: int = 0
    """Steps left without proposing."""
    backoff: int = 0
    """The last cool-down given (0: none yet)."""


class Speculator:
    def __init__(self, config: SpeculativeConfig, draft=None):
        """draft: the DraftModel (runtime/spec_decode/draft_model.py) of method draft_model."""
        self.config = config
        self.draft = draft
        self.k = config.num_speculative_tokens
        self.disable_by_batch_size = config.disable_by_batch_size or DEFAULT_DISABLE_BY_BATCH_SIZE
        self._states: dict[str, _State] = {}
        self.suffix = (
            SuffixStore(config.suffix_decoding_max_tree_depth, config.suffix_decoding_max_cached_requests)
            if config.method == "suffix"
            else None
        )

    def propose(
        self, running: list[Request], legal: Callable[[Request, list[int]], list[int]] | None = None
    ) -> None:
        """Set spec_token_ids on the running requests that decode next. legal(request, tokens): the
        longest prefix of tokens the request may generate (its grammar), for those with a grammar."""
        if len(running) >= self.disable_by_batch_size:
            return
        drafting = []
        for request in running:
            if request.num_computed_tokens != request.num_tokens - 1:
                continue  # still prefilling, or not yet booked
            state = self._states.get(request.request_id)
            if state is None:
                state = self._states[request.request_id] = _State(self._new_index())
            state.index.sync(request.all_token_ids)
            if state.cooldown:
                state.cooldown -= 1
                continue
            if self.draft is not None:
                drafting.append(request)
                continue
            self._set(request, self._propose(request, state), legal)
        if drafting:
            for request_id, drafts in self.draft.propose(drafting, self.k).items():
                request = next(r for r in drafting if r.request_id == request_id)
                self._set(request, drafts, legal)

    @staticmethod
    def _set(request: Request, drafts: list[int], legal) -> None:
        if drafts and legal is not None and request.sampling_params.structured_output is not None:
            drafts = legal(request, drafts)
        request.spec_token_ids = drafts

    def _new_index(self) -> NgramIndex:
        c = self.config
        if self.suffix is not None:
            return NgramIndex(
                MIN_CONTEXT, max(MIN_CONTEXT, min(c.suffix_decoding_max_tree_depth, MAX_CONTEXT))
            )
        return NgramIndex(c.prompt_lookup_min, c.prompt_lookup_max)

    def _propose(self, request: Request, state: _State) -> list[int]:
        if self.suffix is None:
            return state.index.propose(self.k)
        return self.suffix.propose(request, state.index, self.k, self.config.suffix_decoding_min_token_prob)

    def observe(self, request_id: str, num_drafts: int, num_accepted: int) -> None:
        """Book one verification of a request's proposals."""
        state = self._states.get(request_id)
        if state is None or not num_drafts:
            return
        state.rate = (1 - EWMA) * state.rate + EWMA * (num_accepted / num_drafts)
        if state.rate < self.config.min_acceptance_rate:
            state.backoff = min(max(2 * state.backoff, 1), MAX_COOLDOWN)
            state.cooldown = state.backoff
        elif num_accepted:
            state.backoff = 0

    def finish(self, request: Request) -> None:
        """Forget a finished request; the suffix method keeps its tokens for its tenant's later ones."""
        self._states.pop(request.request_id, None)
        if self.draft is not None:
            self.draft.forget(request.request_id)
        if self.suffix is not None and request.finish_reason != "abort":
            self.suffix.add(request)
