"""Text <-> token ids, built with the `tokenizers` library from a GGUF vocabulary or a tokenizer.json."""
from __future__ import annotations

import re
from functools import lru_cache

from tokenizers import AddedToken, Tokenizer as HFTokenizer, decoders, models, pre_tokenizers

from runtime.chat_template import render_chat
from runtime.checkpoint import TokenizerSource


class Tokenizer:
    def __init__(self, source: TokenizerSource):
        if source.tokenizer_json:
            self._tok = HFTokenizer.from_file(source.tokenizer_json)
        else:
            self._tok = _byte_level_bpe(source)
        self.chat_template = source.chat_template
        self.bos_token_id = source.bos_token_id
        self.eos_token_id = source.eos_token_id
        self.add_bos_token = source.add_bos_token
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.eos_token = self._tok.id_to_token(self.eos_token_id) if self.eos_token_id is not None else ""
        self.bos_token = self._tok.id_to_token(self.bos_token_id) if self.bos_token_id is not None else ""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Special tokens written in the text (e.g. <|im_start|>) become their ids, as in transformers."""
        ids = self._tok.encode(text, add_special_tokens=False).ids
        if add_special_tokens and self.add_bos_token and self.bos_token_id is not None:
            ids = [self.bos_token_id] + ids
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for (a token may hold part of a UTF-8 character)."""
        piece = self._tok.id_to_token(token_id)
        if piece is None:
            return b""
        decoder = _byte_decoder()
        if all(c in decoder for c in piece):   # byte-level BPE (GPT-2 style): one char per byte
            return bytes(decoder[c] for c in piece)
        byte = _SENTENCEPIECE_BYTE.fullmatch(piece)
        if byte:
            return bytes([int(byte.group(1), 16)])
        return piece.replace("\u2581", " ").encode()

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tokenize: bool = False) -> str | list[int]:
        text = render_chat(self.chat_template, messages, add_generation_prompt=add_generation_prompt,
                           bos_token=self.bos_token, eos_token=self.eos_token)
        return self._tok.encode(text, add_special_tokens=False).ids if tokenize else text


def _byte_level_bpe(source: TokenizerSource) -> HFTokenizer:
    vocab = {token: i for i, token in enumerate(source.tokens)}
    merges = [tuple(m.split(" ", 1)) for m in source.merges]
    tok = HFTokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(source.tokens[i], special=True, normalized=False)
                            for i in source.special_ids])
    return tok


_SENTENCEPIECE_BYTE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """Byte-level BPE's alphabet: printable bytes stand for themselves, the others are shifted past 255."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1),
                 *range(ord("\xae"), ord("\xff") + 1)]
    chars = {b: chr(b) for b in printable}
    shift = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + shift)
            shift += 1
    return {c: b for b, c in chars.items()}
