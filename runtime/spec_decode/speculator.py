"""Speculator: after each step, the tokens each decoding request proposes to verify in its next one.

It keeps a proposer's state per request (runtime/spec_decode/ngram.py, suffix.py), sets
Request.spec_token_ids on the running requests that will decode next, and learns from what was
accepted:

* how many, per request: a verification of d proposals is d more decode rows, and on a CPU each row
  costs about ROW_COST of a one-row step (the weights are read once, but every row's arithmetic is
  paid). From its running acceptance rate a (the chance that a proposal is accepted after the ones
  before it were), d proposals give (1 - a^(d+1)) / (1 - a) tokens on average; the request proposes the
  d, up to num_speculative_tokens, that gives the step's sequences the most tokens per second, counting
  that the batch's other sequences (and their proposals) share the step: in a larger batch each row
  weighs more and fewer pay;
* backoff, per request: a request at whose rate no proposal pays (or below min_acceptance_rate, where
  the config sets one) proposes nothing for a cool-down of steps that doubles each time (up to
  MAX_COOLDOWN), then probes with one proposal at least; a verification that goes well resets it;
* batch size: while at least disable_by_batch_size requests run, nobody proposes (the measured
  crossover, above which even copy-heavy requests lose).
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
CPU (`python -m tests.bench speculative`, tests/bench/RESULTS.md, 2026-11-28 13:24 and 13:29): with the
proposals' rows on the decode path and proposals forced on (five every step, then counted per request as
below), the copy workload ran 1.17x and 0.84x at 2 streams, 1.07x and 1.00x at 4, 0.91x and 0.75x at 8;
the multi-turn one 0.95x and 0.69x already at 2. Only a lone stream gains reliably."""
ROW_COST = 0.22
"""A decode step's time grows by about this fraction of a one-row step for each more row, on the same
CPU (SmolLM2, one stream: 2 rows 1.12-1.30x, 4 rows 1.31-1.61x, 6 rows 1.80-2.09x the one-row step in
two runs; the larger figures taken)."""
MAX_COOLDOWN = 32
"""The longest a backed-off request goes without proposing, in steps."""
EWMA = 0.5
"""Weight of the latest verification in a request's running acceptance rate."""


def expected_tokens(rate: float, drafts: int) -> float:
    """Tokens a verification of `drafts` proposals gives on average: 1 + rate + ... + rate^drafts."""
    return sum(rate**i for i in range(drafts + 1))


def proposal_count(
    rate: float, other_rows: float, other_tokens: float, most: int, row_cost: float = ROW_COST
) -> int:
    """How many proposals pay best for a sequence whose proposals are accepted at `rate` (each given those
    before it), in a step whose other sequences have other_rows rows and get other_tokens tokens: the
    d <= most that most raises the step's tokens per unit of step time,
    (other_tokens + expected_tokens(rate, d)) / (1 + row_cost (other_rows + d)). 0: none pays."""
    best, best_rate = 0, (other_tokens + 1) / (1 + row_cost * other_rows)
    for d in range(1, most + 1):
        per_time = (other_tokens + expected_tokens(rate, d)) / (1 + row_cost * (other_rows + d))
        if per_time > best_rate:
            best, best_rate = d, per_time
    return best


@dataclass
class _State:
    index: NgramIndex
    accepted: float = 0.8
    trials: float = 1.0
    """Running (exponentially weighted) proposals accepted, and proposals judged: the accepted ones and
    the first rejected one, if any (those after it are not looked at). It starts at a rate of 0.8: an
    n-gram match is often right, but proposing the most at once costs too much in a batch."""
    cooldown: int = 0
    """Steps left without proposing."""
    backoff: int = 0
    """The last cool-down given (0: none yet)."""

    probe: bool = False
    """Its next proposal probes after a cool-down."""

    @property
    def rate(self) -> float:
        """The chance that a proposal is accepted when those before it were."""
        return self.accepted / self.trials


class Speculator:
    def __init__(self, config: SpeculativeConfig, draft=None):
        """draft: the DraftModel (runtime/spec_decode/draft_model.py) of method draft_model."""
        self.config = config
        self.draft = draft
        self.k = config.num_speculative_tokens
        self.row_cost = ROW_COST
        """One more decode row's cost as a fraction of a one-row step (0: every proposal pays)."""
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
        # the step's rows and expected tokens besides each request's own, its earlier proposals counted
        rows = tokens = len(running) - 1.0
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
            count = proposal_count(state.rate, rows, tokens, self.k, self.row_cost)
            if state.probe:  # the first after a cool-down: one proposal at least, to learn the rate anew
                count, state.probe = max(count, 1), False
            elif not count:  # none pays at its rate in this batch
                self._back_off(state)
                continue
            drafts = self._propose(request, state)[:count]
            self._set(request, drafts, legal)
            rows += len(request.spec_token_ids)
            tokens += expected_tokens(state.rate, len(request.spec_token_ids)) - 1
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
        judged = num_accepted + (num_accepted < num_drafts)
        state.accepted = (1 - EWMA) * state.accepted + EWMA * num_accepted
        state.trials = (1 - EWMA) * state.trials + EWMA * judged
        if state.rate < (self.config.min_acceptance_rate or 0.0):
            self._back_off(state)
        elif num_accepted:
            state.backoff = 0

    @staticmethod
    def _back_off(state: _State) -> None:
        """No proposals for the next cool-down (doubled, up to MAX_COOLDOWN), then a probe."""
        state.backoff = min(max(2 * state.backoff, 1), MAX_COOLDOWN)
        state.cooldown = state.backoff
        state.probe = True

    def finish(self, request: Request) -> None:
        """Forget a finished request; the suffix method keeps its tokens for its tenant's later ones."""
        self._states.pop(request.request_id, None)
        if self.draft is not None:
            self.draft.forget(request.request_id)
        if self.suffix is not None and request.finish_reason != "abort":
            self.suffix.add(request)
