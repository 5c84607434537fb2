"""Generated token ids -> the text that is safe to show so far, with stop strings applied.

Text is decoded from all generated ids each time (cheap for the lengths served
here) so it never drifts from a one-shot decode. Two things are held back
until more tokens arrive: a trailing incomplete UTF-8 character, and a tail
that could still grow into a stop string.
"""
from __future__ import annotations

from runtime.tokenizer import Tokenizer

RESCAN_CHARS = 8
"""Characters before the held-back tail that are searched again for a stop string: decoding more
tokens can change the end of the text (an incomplete UTF-8 character, up to 4 bytes of U+FFFD,
becomes one character), so a stop string may now end there."""


class Detokenizer:
    def __init__(self, tokenizer: Tokenizer, stop: list[str]):
        self.tokenizer = tokenizer
        self.stop = stop
        self._hold = max((len(s) for s in stop), default=1) - 1
        self.text = ""
        """Text released so far; only ever grows."""
        self.stop_reason: str | None = None

    def update(self, token_ids: list[int], finished: bool) -> bool:
        """Recompute the text after new tokens; returns True if a stop string was hit."""
        full = self.tokenizer.decode(token_ids)
        if self.stop:
            start = max(0, len(self.text) - self._hold - RESCAN_CHARS)
            hits = [(full.find(s, start), s) for s in self.stop]
            hits = [(i, s) for i, s in hits if i >= 0]
            if hits:
                index, self.stop_reason = min(hits)
                self.text = full[:index]
                return True
        if not finished:
            if full.endswith("\ufffd"):
                full = full.rstrip("\ufffd")
            if self._hold:
                full = full[:max(len(self.text), len(full) - self._hold)]
        if len(full) > len(self.text):
            self.text = full
        return False
