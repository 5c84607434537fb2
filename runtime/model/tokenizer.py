"""Text <-> token ids, built with the `tokenizers` library from a GGUF vocabulary or a tokenizer.json."""

from __future__ import annotations

import re
import threading
import uuid
from functools import lru_cache

from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders

from runtime.model.bpe_pretokenizers import bpe_pretokenizer
from runtime.model.chat_template import NoChatTemplateError, render_chat, with_tools
from runtime.model.checkpoint_types import TokenizerSource
from runtime.model.gguf_tokenizer import END_OF_GENERATION_TEXTS, SUPPORTED_MODELS, build_gguf_tokenizer


class Tokenizer:
    def __init__(self, source: TokenizerSource):
        if source.tokenizer_json:
            self._tok = HFTokenizer.from_file(source.tokenizer_json)
        else:
            self._tok = build_gguf_tokenizer(source)
        self.chat_template = source.chat_template
        self.bos_token_id = source.bos_token_id
        self.eos_token_id = source.eos_token_id
        self.add_bos_token = source.add_bos_token
        self.add_eos_token = source.add_eos_token
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.eos_token = self._tok.id_to_token(self.eos_token_id) if self.eos_token_id is not None else ""
        self.bos_token = self._tok.id_to_token(self.bos_token_id) if self.bos_token_id is not None else ""
        added = self._tok.get_added_tokens_decoder()
        self.special_tokens = [t.content for t in added.values() if t.special]
        self._special_ids = {t.content: i for i, t in added.items() if t.special}
        self._strip = {
            t.content: (t.lstrip, t.rstrip) for t in added.values() if t.special and (t.lstrip or t.rstrip)
        }
        self._special_re: re.Pattern | None = None  # built on first use: thousands of tokens take a moment
        self.eog_token_ids = sorted(
            {i for i, t in added.items() if t.special and t.content in END_OF_GENERATION_TEXTS}
            | ({self.eos_token_id} if self.eos_token_id is not None else set())
        )
        """Tokens that end a generation (EOS and end-of-turn tokens such as Gemma's <end_of_turn>), as
        llama.cpp's end-of-generation list finds them by their text."""
        self._byte_level = isinstance(self._tok.decoder, decoders.ByteLevel)
        self._text_tok: HFTokenizer | None = None  # see _literal_tokenizer
        self._lock = threading.Lock()

    def __getstate__(self) -> dict:
        """Pickled for the server: the derived copies are rebuilt there when needed (a large vocabulary
        takes seconds to load, and most servers never need the literal copy)."""
        return {k: v for k, v in self.__dict__.items() if k not in ("_special_re", "_text_tok", "_lock")}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state, _special_re=None, _text_tok=None, _lock=threading.Lock())

    def _literal_tokenizer(self) -> HFTokenizer:
        """The same tokenizer, but special-token text in its input stays text (for what users typed).
        Built on first use: only a chat whose content spells a special token needs it. The flag is set on
        a copy, never toggled on the shared one, as other threads encode with it at the same time (and the
        tokenizers library does not keep the flag through pickling)."""
        with self._lock:
            if self._text_tok is None:
                literal = HFTokenizer.from_str(self._tok.to_str())
                literal.encode_special_tokens = True
                self._text_tok = literal
            return self._text_tok

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Special tokens written in the text (e.g. <|im_start|>) become their ids, as in transformers and
        llama.cpp; add_special_tokens puts BOS (and EOS) around them where the model asks for it."""
        ids = _encode(self._tok, text)
        if add_special_tokens and self.add_bos_token and self.bos_token_id is not None:
            ids = [self.bos_token_id] + ids
        if add_special_tokens and self.add_eos_token and self.eos_token_id is not None:
            ids = ids + [self.eos_token_id]
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
        if self._byte_level:  # byte-level BPE (GPT-2 style): one char per byte
            decoder = _byte_decoder()
            if all(c in decoder for c in piece):
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
        variable or, when it has none, a system message (chat_template.with_tools).
        Raises NoChatTemplateError (a ValueError) when the model has no chat template (a base model)."""
        if not self.chat_template:
            raise NoChatTemplateError()
        messages, extra = with_tools(self.chat_template, messages, tools)
        text = self._render(messages, add_generation_prompt, extra)
        if not tokenize:
            return text
        forged = self._first_forged(messages)
        if forged is None:  # the common case: one pass over the text, exactly as transformers tokenizes it
            return _encode(self._tok, text)
        return self._encode_with_literal_contents(messages, add_generation_prompt, text, forged, extra)

    def _render(self, messages: list[dict], add_generation_prompt: bool, extra: dict) -> str:
        return render_chat(
            self.chat_template,
            messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token,
            eos_token=self.eos_token,
            **extra,
        )

    def _special_pattern(self) -> re.Pattern:
        if self._special_re is None:
            self._special_re = _trie_pattern(self.special_tokens)
        return self._special_re

    def _first_forged(self, messages: list[dict]) -> int | None:
        """Index of the first message whose content spells a special token (one linear scan each)."""
        if not self.special_tokens:
            return None
        pattern = self._special_pattern()
        return next((i for i, m in enumerate(messages) if pattern.search(m["content"])), None)

    def _encode_with_literal_contents(
        self, messages: list[dict], add_generation_prompt: bool, text: str, first_forged: int, extra: dict
    ) -> list[int]:
        """Render again with a unique marker in place of each content. The template's own text is cut at
        its special tokens; between two of them, template text and contents are encoded together as
        plain text, exactly as the one-pass encode cuts a text at special tokens, so the ids equal
        those of the same chat without the typed special-token text wherever it does not occur.
        Linear in the size of the chat: one regex pass over the marked text, one batch encode."""
        nonce = uuid.uuid4().hex
        marker = re.compile(f"\x00{nonce}:([0-9]+)\x00")
        marked = self._render(
            [dict(m, content=f"\x00{nonce}:{i}\x00") for i, m in enumerate(messages)],
            add_generation_prompt,
            extra,
        )
        pieces: list[tuple[str, bool]] = []  # (text, is user content)
        pos = 0
        for hit in marker.finditer(marked):
            index = int(hit.group(1))
            if index >= len(messages):
                break
            pieces += [(marked[pos : hit.start()], False), (messages[index]["content"], True)]
            pos = hit.end()
        pieces.append((marked[pos:], False))
        if "".join(p for p, _ in pieces) != text:  # the template changes contents: they cannot be told apart
            token = self._special_pattern().search(messages[first_forged]["content"]).group()
            raise ValueError(
                f"messages: messages[{first_forged}].content contains special-token text ({token!r}) "
                f"that this model's chat template does not insert verbatim; remove it"
            )
        special = self._special_pattern()
        runs: list[list[str]] = [[]]  # plain-text runs, each ended by one of the template's special tokens
        ends: list[int] = []
        strip_next = False
        for piece, literal in pieces:
            cuts = [] if literal else list(special.finditer(piece))
            pos = 0
            for hit in cuts + [None]:
                chunk = piece[pos : hit.start() if hit else len(piece)]
                if strip_next and chunk:
                    chunk = chunk.lstrip()
                    strip_next = not chunk
                runs[-1].append(chunk)
                if hit is None:
                    break
                lstrip, rstrip = self._strip.get(hit.group(), (False, False))
                if lstrip:
                    runs[-1] = ["".join(runs[-1]).rstrip()]
                ends.append(self._special_ids[hit.group()])
                runs.append([])
                strip_next = rstrip
                pos = hit.end()
        texts = ["".join(r) for r in runs]
        encoded = self._literal_tokenizer().encode_batch([t for t in texts if t], add_special_tokens=False)
        parts = iter(encoded)
        ids: list[int] = []
        for i, t in enumerate(texts):
            if t:
                ids += next(parts).ids
            if i < len(ends):
                ids.append(ends[i])
        return ids


def check_tokenizer_source(source: TokenizerSource) -> None:
    """Raise ValueError naming what is not supported about a checkpoint's tokenizer, cheaply, so that a
    loader can refuse the checkpoint before reading any weight (GGUF files are checked as
    gguf_tokenizer.read_gguf_tokenizer reads them)."""
    if source.tokenizer_json:
        try:
            HFTokenizer.from_file(source.tokenizer_json)
        except Exception as exc:  # the tokenizers library names what it cannot read
            raise ValueError(f"model: cannot load the tokenizer {source.tokenizer_json!r}: {exc}") from exc
        return
    if source.model not in SUPPORTED_MODELS:
        raise ValueError(
            f"model: GGUF tokenizer {source.model!r} is not supported; supported: {list(SUPPORTED_MODELS)}"
        )
    if source.model == "gpt2":
        bpe_pretokenizer(source.pre)


def _encode(tok: HFTokenizer, text: str) -> list[int]:
    """Token ids of text, no special tokens added. Long texts go through encode_batch:
    encode() of a string built on the calling thread holds the GIL throughout, so tokenizing
    a big prompt on a worker thread still froze the event loop; encode_batch lets it go."""
    if len(text) < 16_384:
        return tok.encode(text, add_special_tokens=False).ids
    return tok.encode_batch([text], add_special_tokens=False)[0].ids


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


def _trie_pattern(words: list[str]) -> re.Pattern:
    """A regex matching any of `words`, longest first, built as a trie (one branch per next character),
    so a search costs the length of the longest word per position, not the number of words."""
    trie: dict = {}
    for word in words:
        node = trie
        for ch in word:
            node = node.setdefault(ch, {})
        node[""] = {}

    def pattern(node: dict) -> str:
        branches = [re.escape(ch) + pattern(child) for ch, child in sorted(node.items()) if ch]
        if not branches:
            return ""
        body = branches[0] if len(branches) == 1 else "(?:" + "|".join(branches) + ")"
        return f"(?:{body})?" if "" in node else body

    return re.compile(pattern(trie) if trie else "(?!)")
