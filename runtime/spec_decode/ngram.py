"""Prompt lookup (n-gram) proposals: when the last n tokens occurred before, propose what followed them.

Copying is common (quoting or rewriting a document, code edits, answers that repeat the question), and
there the tokens after an earlier occurrence of the current suffix are often the next ones. Each request
keeps an index from every n-gram (prompt_lookup_min <= n <= prompt_lookup_max) of its tokens to where
its latest occurrence ends, updated as tokens arrive, so a proposal costs a few dictionary lookups
whatever the request's length. Longer matches are tried first; the latest occurrence wins.
"""

from __future__ import annotations


class NgramIndex:
    def __init__(self, min_n: int, max_n: int):
        self.min_n = min_n
        self.max_n = max_n
        self.tokens: list[int] = []
        self._ends: dict[tuple[int, ...], int] = {}
        """n-gram -> the position just after its latest occurrence that some token follows."""

    def extend(self, tokens: list[int]) -> None:
        """Take in the tokens appended since the last call (all of a request's tokens, in order)."""
        mine = self.tokens
        ends = self._ends
        for token in tokens:
            p = len(mine)  # the new token's position: it follows the n-grams ending just before it
            for n in range(self.min_n, min(self.max_n, p) + 1):
                ends[tuple(mine[p - n : p])] = p
            mine.append(token)

    def sync(self, all_tokens: list[int]) -> None:
        """Catch up with a request's token list (prompt + output so far)."""
        if len(all_tokens) > len(self.tokens):
            self.extend(all_tokens[len(self.tokens) :])

    def propose(self, k: int) -> list[int]:
        """Up to k tokens that followed the latest earlier occurrence of the longest recurring suffix."""
        return self.propose_matched(k)[1]

    def propose_matched(self, k: int) -> tuple[int, list[int]]:
        """(length of the suffix matched, propose(k)); (0, []) when no suffix recurs."""
        mine = self.tokens
        for n in range(min(self.max_n, len(mine) - 1), self.min_n - 1, -1):
            p = self._ends.get(tuple(mine[-n:]))
            if p is not None:
                return n, mine[p : p + k]
        return 0, []
