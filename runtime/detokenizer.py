"""Generated token ids -> the text that is safe to show so far, with stop strings applied.

Text is decoded incrementally: each step decodes only a short window of ids (the tokens since the last
complete character, plus the few before them for context) and appends the difference, so a request of n
tokens costs O(n) decoding in all, not O(n^2). Two things are held back until more tokens arrive: a
trailing incomplete UTF-8 character, and a tail that could still grow into a stop string.
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
        self._decoded = ""
        """Text of token_ids[:_read]: whole characters only until the request finishes."""
        self._prefix = 0  # token_ids[_prefix:_read]: already decoded, kept as context for the next window
        self._read = 0

    def _decode_new(self, token_ids: list[int], finished: bool) -> None:
        decode = self.tokenizer.decode
        known = decode(token_ids[self._prefix : self._read])
        window = decode(token_ids[self._prefix :])
        # A window ending in U+FFFD stops in the middle of a character: wait for its next bytes.
        if len(window) > len(known) and (finished or not window.endswith("\ufffd")):
            self._decoded += window[len(known) :]
            self._prefix, self._read = self._read, len(token_ids)

    def update(self, token_ids: list[int], finished: bool) -> bool:
        """Take in the new tokens; returns True if a stop string was hit."""
        self._decode_new(token_ids, finished)
        full = self._decoded
        if self.stop:
            start = max(0, len(self.text) - self._hold - RESCAN_CHARS)
            hits = [(full.find(s, start), s) for s in self.stop]
            hits = [(i, s) for i, s in hits if i >= 0]
            if hits:
                index, self.stop_reason = min(hits)
                self.text = full[:index]
                return True
        if not finished and self._hold:
            full = full[: max(len(self.text), len(full) - self._hold)]
        if len(full) > len(self.text):
            self.text = full
        return False
