"""One position's log-probability record, as outputs carry it (no tensors: the server's front end reads it)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class TokenLogprob:
    """One position: the token that is there, its log-probability, its rank, and the top alternatives."""

    token_id: int
    logprob: float
    rank: int
    """1 + how many tokens were more likely."""
    top: list[tuple[int, float]] = field(default_factory=list)
    """(token id, logprob) of the most likely tokens, most likely first."""
