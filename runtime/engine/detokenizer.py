"""Generated token ids -> the text that is safe to show, released piece by piece, with stop strings applied.

Text is decoded incrementally: each step decodes only a short window of ids (the tokens since the last
complete character, plus the few before them for context) and releases what is new, so a request of n
tokens costs O(n) decoding and O(n) text in all, not O(n^2). Two things are held back until more tokens
arrive: a trailing incomplete UTF-8 character, and a tail that could still grow into a stop string.
"""

from __future__ import annotations

from runtime.model.tokenizer import Tokenizer

RESCAN_CHARS = 8
"""Characters before the held-back tail that are searched again for a stop string: decoding more
tokens can change the end of the text (an incomplete UTF-8 character, up to 4 bytes of U+FFFD,
becomes one character), so a stop string may now end there."""


class Detokenizer:
    def __init__(self, tokenizer: Tokenizer, stop: list[str]):
        self.tokenizer = tokenizer
        self.stop = stop
        self._hold = max((len(s) for s in stop), default=1) - 1
        self._parts: list[str] = []
        """Text released so far, in the pieces update() returned."""
        self.stop_reason: str | None = None
        self._pending = ""
        """Decoded, not yet released: at most the held-back tail plus this step's new characters."""
        self._tail = ""
        """The last released characters that a stop string may still start in (_hold + RESCAN_CHARS)."""
        self._prefix = 0  # token_ids[_prefix:_read]: already decoded, kept as context for the next window
        self._read = 0

    @property
    def text(self) -> str:
        """Everything released so far (joined when read)."""
        if len(self._parts) > 1:
            self._parts[:] = ["".join(self._parts)]
        return self._parts[0] if self._parts else ""

    def _decode_new(self, token_ids: list[int], finished: bool) -> str:
        decode = self.tokenizer.decode
        known = decode(token_ids[self._prefix : self._read])
        window = decode(token_ids[self._prefix :])
        # A window ending in U+FFFD stops in the middle of a character: wait for its next bytes.
        if len(window) > len(known) and (finished or not window.endswith("\ufffd")):
            self._prefix, self._read = self._read, len(token_ids)
            return window[len(known) :]
        return ""

    def update(self, token_ids: list[int], finished: bool) -> str:
        """Take in the tokens generated so far (only those since the last call are decoded); returns the
        text this call releases. After a stop string is hit, stop_reason names it and nothing more comes."""
        if self.stop_reason is not None:
            return ""
        pending = self._pending + self._decode_new(token_ids, finished)
        if self.stop:
            window = self._tail + pending
            hits = [(window.find(s), s) for s in self.stop]
            hits = [(i, s) for i, s in hits if i >= 0]
            if hits:
                index, self.stop_reason = min(hits)
                self._pending = ""
                return self._release(pending[: max(index - len(self._tail), 0)])
        cut = len(pending) if finished else max(len(pending) - self._hold, 0)
        self._pending = pending[cut:]
        return self._release(pending[:cut])

    def _release(self, text: str) -> str:
        if text:
            self._parts.append(text)
            self._tail = (self._tail + text)[-(self._hold + RESCAN_CHARS) :]
        return text
