"""Text <-> token ids, built with the `tokenizers` library from a GGUF vocabulary or a tokenizer.json."""

from __future__ import annotations

import re
import uuid
from functools import lru_cache

from tokenizers import AddedToken, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from runtime.chat_template import render_chat, with_tools
from runtime.checkpoint_types import TokenizerSource


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
        self.special_tokens = [t.content for t in self._tok.get_added_tokens_decoder().values() if t.special]
        # The same tokenizer, but special-token text in its input stays text (for what users typed).
        self._text_tok = HFTokenizer.from_str(self._tok.to_str())
        self._text_tok.encode_special_tokens = True

    def __setstate__(self, state: dict) -> None:
        """Unpickled (the engine core sends its tokenizer to the server): the tokenizers library does not
        keep encode_special_tokens, so without this user text would be read as special tokens again."""
        self.__dict__.update(state)
        self._text_tok.encode_special_tokens = True

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Special tokens written in the text (e.g. <|im_start|>) become their ids, as in transformers."""
        ids = _encode(self._tok, text)
        if add_special_tokens and self.add_bos_token and self.bos_token_id is not None:
            ids = [self.bos_token_id] + ids
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        """Long id lists go through decode_batch, which lets the GIL go (decode() keeps it: decoding
        400,000 ids on a worker thread froze the server's event loop for half a second)."""
        if len(ids) < 16_384:
            return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)
        return self._tok.decode_batch([list(ids)], skip_special_tokens=skip_special_tokens)[0]

    def tokenizer_json(self) -> str:
        """The whole tokenizer as tokenizer.json text (what grammar engines read)."""
        return self._tok.to_str()

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for (a token may hold part of a UTF-8 character)."""
        piece = self._tok.id_to_token(token_id)
        if piece is None:
            return b""
        decoder = _byte_decoder()
        if all(c in decoder for c in piece):  # byte-level BPE (GPT-2 style): one char per byte
            return bytes(decoder[c] for c in piece)
        byte = _SENTENCEPIECE_BYTE.fullmatch(piece)
        if byte:
            return bytes([int(byte.group(1), 16)])
        return piece.replace("\u2581", " ").encode()

    def apply_chat_template(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        tokenize: bool = False,
        tools: list[dict] | None = None,
    ) -> str | list[int]:
        """tokenize=True: the ids the model sees. Special tokens typed inside a message's content are
        tokenized as the text they are (so a user cannot forge a system turn); the template's own
        special tokens become their ids. tools: OpenAI function tools, through the template's `tools`
        variable or, when it has none, a system message (chat_template.with_tools)."""
        messages, extra = with_tools(self.chat_template, messages, tools)
        text = render_chat(
            self.chat_template,
            messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token,
            eos_token=self.eos_token,
            **extra,
        )
        if not tokenize:
            return text
        forged = [i for i, m in enumerate(messages) if any(s in m["content"] for s in self.special_tokens)]
        if not forged:  # the common case: one pass over the text, exactly as transformers tokenizes it
            return _encode(self._tok, text)
        return self._encode_with_literal_contents(messages, add_generation_prompt, text, forged[0], extra)

    def _encode_with_literal_contents(
        self, messages: list[dict], add_generation_prompt: bool, text: str, first_forged: int, extra: dict
    ) -> list[int]:
        """Render again with a unique marker in place of each content, encode the template's pieces with
        special tokens and each content as plain text."""
        nonce = uuid.uuid4().hex
        markers = [f"\x00{nonce}:{i}\x00" for i in range(len(messages))]
        marked = render_chat(
            self.chat_template,
            [dict(m, content=k) for m, k in zip(messages, markers)],
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token,
            eos_token=self.eos_token,
            **extra,
        )
        pieces: list[tuple[str, bool]] = []  # (text, is user content)
        rest = marked
        for marker, message in zip(markers, messages):
            before, found, rest_ = rest.partition(marker)
            if not found or marker in rest_:
                break
            pieces += [(before, False), (message["content"], True)]
            rest = rest_
        else:
            pieces.append((rest, False))
            if "".join(p for p, _ in pieces) == text:  # the template inserts contents verbatim: split
                ids: list[int] = []
                for piece, literal in pieces:
                    if piece:
                        ids += _encode(self._text_tok if literal else self._tok, piece)
                return ids
        token = next(s for s in self.special_tokens if s in messages[first_forged]["content"])
        raise ValueError(
            f"messages: messages[{first_forged}].content contains special-token text ({token!r}) "
            f"that this model's chat template does not insert verbatim; remove it"
        )


def _encode(tok: HFTokenizer, text: str) -> list[int]:
    """Token ids of text, no special tokens added. Long texts go through encode_batch: measured here,
    encode() of a string built on the calling thread kept the GIL for all of its seconds, so tokenizing
    a big prompt on a worker thread still froze the event loop; encode_batch lets it go."""
    if len(text) < 16_384:
        return tok.encode(text, add_special_tokens=False).ids
    return tok.encode_batch([text], add_special_tokens=False)[0].ids


def _byte_level_bpe(source: TokenizerSource) -> HFTokenizer:
    vocab = {token: i for i, token in enumerate(source.tokens)}
    merges = [tuple(m.split(" ", 1)) for m in source.merges]
    tok = HFTokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(
        [AddedToken(source.tokens[i], special=True, normalized=False) for i in source.special_ids]
    )
    return tok


_SENTENCEPIECE_BYTE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """Byte-level BPE's alphabet: printable bytes stand for themselves, the others are shifted past 255."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("\xa1"), ord("\xac") + 1),
        *range(ord("\xae"), ord("\xff") + 1),
    ]
    chars = {b: chr(b) for b in printable}
    shift = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + shift)
            shift += 1
    return {c: b for b, c in chars.items()}
