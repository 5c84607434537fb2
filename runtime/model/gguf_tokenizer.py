"""A GGUF file's vocabulary: read and checked from its header, then built as a `tokenizers` Tokenizer that
encodes as llama.cpp does on the same file.

Three kinds are supported (`tokenizer.ggml.model`):

* "gpt2": byte-level BPE with merges; the split rule comes from `tokenizer.ggml.pre`
  (runtime/model/bpe_pretokenizers.py).
* "llama": SentencePiece pieces with scores (Llama 2, Mistral, Gemma 2/3, Phi-3). Spaces become U+2581
  (optionally one is put in front of the text), then the adjacent pair whose concatenation is the
  highest-scoring piece merges first, until none is a piece; a character that is no piece becomes its
  UTF-8 bytes as <0xXX> tokens. That is BPE with the merges ranked by the score of the piece they
  make, which is how it is built here.
* "gemma4": the same pieces, merged by the file's own ranked merges, line by line.

Control and unknown tokens are special (typed text becomes them only where the caller allows it);
user-defined tokens are always cut out of the text first, as llama.cpp does.
"""

from __future__ import annotations

from pathlib import Path

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from runtime.model.bpe_pretokenizers import BPEPreTokenizer, bpe_pretokenizer
from runtime.model.checkpoint_types import TokenizerSource
from runtime.model.gguf_metadata import read_gguf_metadata

TOKEN_NORMAL, TOKEN_UNKNOWN, TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNUSED, TOKEN_BYTE = 1, 2, 3, 4, 5, 6
SUPPORTED_MODELS = {
    "gpt2": "byte-level BPE",
    "llama": "SentencePiece",
    "gemma4": "BPE over SentencePiece pieces",
}
GEMMA4_LINES = BPEPreTokenizer((r"[^\n]+|[\n]+",), add_bos=True)
"""Gemma 4 merges each line and each run of newlines apart; llama.cpp always puts BOS first."""
SPACE = "\u2581"
"""SentencePiece's visible space."""
END_OF_GENERATION_TEXTS = frozenset(
    {
        "<|eot_id|>",
        "<|eom_id|>",
        "<|im_end|>",
        "<|end|>",
        "<end_of_turn>",
        "<|endoftext|>",
        "</s>",
        "<|end_of_text|>",
        "<EOT>",
        "_<EOT>",
        "<end_of_utterance>",
        "<\uff5cend\u2581of\u2581sentence\uff5c>",
    }
)
"""Token texts that end a turn or a text: llama.cpp treats a token spelled so as a control token even
where the file types it otherwise (Phi-3's </s> is user-defined there), so typed text never becomes it."""


def read_gguf_tokenizer(path: str | Path) -> TokenizerSource:
    """The vocabulary of a GGUF file, checked: raises ValueError naming the key and value that are not
    supported. Reads only the file's header (no tensor), so a loader calls it before any weight."""
    return tokenizer_source(read_gguf_metadata(path), str(path))


def tokenizer_source(meta: dict, where: str) -> TokenizerSource:
    """TokenizerSource from a GGUF header's keys (read_gguf_metadata's dict)."""
    model = meta.get("tokenizer.ggml.model")
    if model not in SUPPORTED_MODELS:
        supported = ", ".join(f"{k!r} ({v})" for k, v in SUPPORTED_MODELS.items())
        raise ValueError(
            f"model: the tokenizer of {where!r} (tokenizer.ggml.model={model!r}) is not supported; "
            f"supported: {supported}"
        )
    tokens = meta.get("tokenizer.ggml.tokens")
    if not tokens:
        raise ValueError(f"model: {where!r} has no vocabulary (tokenizer.ggml.tokens)")
    tokens = [t if t else f"[EMPTY_{i}]" for i, t in enumerate(tokens)]  # as llama.cpp names them
    types = list(meta.get("tokenizer.ggml.token_type") or [TOKEN_NORMAL] * len(tokens))
    for i, token in enumerate(tokens):
        if token in END_OF_GENERATION_TEXTS and types[i] in (TOKEN_NORMAL, TOKEN_USER_DEFINED):
            types[i] = TOKEN_CONTROL
    name = str(meta.get("general.name", "")).lower()
    rstrip = []
    if "phi-3" in name or "phi3" in name:  # Phi-3's tokenizer eats the whitespace after its special tokens
        rstrip = [
            i
            for i, t in enumerate(types)
            if t in (TOKEN_CONTROL, TOKEN_USER_DEFINED) and tokens[i] not in ("<unk>", "<s>", "<|endoftext|>")
        ]
    pre = meta.get("tokenizer.ggml.pre")
    if model in ("gpt2", "gemma4"):
        rule = bpe_pretokenizer(pre) if model == "gpt2" else GEMMA4_LINES
        merges = meta.get("tokenizer.ggml.merges")
        if merges is None:  # an empty list is a vocabulary of single symbols
            raise ValueError(f"model: {where!r} has a BPE vocabulary without tokenizer.ggml.merges")
        scores: list[float] = []
        add_bos_default, add_space_prefix_default = rule.add_bos, False
        bos_default = eos_default = None
    else:
        merges = []
        scores = list(meta.get("tokenizer.ggml.scores") or [])
        if len(scores) != len(tokens):
            raise ValueError(f"model: {where!r}: tokenizer.ggml.scores must give one score per token")
        known = set(tokens)
        missing = [f"<0x{b:02X}>" for b in range(256) if f"<0x{b:02X}>" not in known]
        if missing:
            raise ValueError(f"model: {where!r}: SentencePiece vocabulary lacks byte tokens {missing[:3]}")
        add_bos_default, add_space_prefix_default = True, True
        bos_default, eos_default = 1, 2
    return TokenizerSource(
        tokens=tokens,
        merges=list(merges),
        special_ids=[i for i, t in enumerate(types) if t in (TOKEN_CONTROL, TOKEN_USER_DEFINED)],
        chat_template=meta.get("tokenizer.chat_template"),
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id", bos_default),
        eos_token_id=meta.get("tokenizer.ggml.eos_token_id", eos_default),
        add_bos_token=model == "gemma4" or bool(meta.get("tokenizer.ggml.add_bos_token", add_bos_default)),
        model=model,
        pre=pre,
        scores=scores,
        token_types=types,
        add_eos_token=bool(meta.get("tokenizer.ggml.add_eos_token", False)),
        add_space_prefix=bool(meta.get("tokenizer.ggml.add_space_prefix", add_space_prefix_default)),
        rstrip_ids=rstrip,
    )


def build_gguf_tokenizer(source: TokenizerSource) -> HFTokenizer:
    build = {"llama": _sentencepiece, "gemma4": _sentencepiece_bpe}.get(source.model, _byte_level_bpe)
    tok = build(source)
    types = source.token_types or [TOKEN_NORMAL] * len(source.tokens)
    added = [i for i, t in enumerate(types) if t in (TOKEN_CONTROL, TOKEN_UNKNOWN, TOKEN_USER_DEFINED)]
    rstrip = set(source.rstrip_ids)

    def token(i: int) -> AddedToken:
        special = types[i] != TOKEN_USER_DEFINED
        return AddedToken(source.tokens[i], special=special, normalized=False, rstrip=i in rstrip)

    tok.add_special_tokens([token(i) for i in added if types[i] != TOKEN_USER_DEFINED])
    tok.add_tokens([token(i) for i in added if types[i] == TOKEN_USER_DEFINED])
    return tok


def _byte_level_bpe(source: TokenizerSource) -> HFTokenizer:
    rule = bpe_pretokenizer(source.pre)
    vocab = {token: i for i, token in enumerate(source.tokens)}
    merges = []
    for m in source.merges:
        cut = m.find(" ", 1)  # a merge is "left right"; the left part may itself start with a space
        merges.append((m[:cut], m[cut + 1 :]))
    tok = HFTokenizer(
        models.BPE(
            vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False, ignore_merges=rule.ignore_merges
        )
    )
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(p), behavior="isolated") for p in rule.patterns]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    tok.decoder = decoders.ByteLevel()
    return tok


def _sentencepiece_bpe(source: TokenizerSource) -> HFTokenizer:
    """Gemma 4: pieces with U+2581 for spaces, merged by the file's ranked merges (not by score), each
    line and each run of newlines apart; characters with no piece become <0xXX> byte tokens."""
    vocab = {token: i for i, token in enumerate(source.tokens)}
    merges = []
    for m in source.merges:
        cut = m.find(" ", 1)
        merges.append((m[:cut], m[cut + 1 :]))
    tok = HFTokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=True))
    tok.normalizer = normalizers.Replace(" ", SPACE)
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(GEMMA4_LINES.patterns[0]), behavior="isolated")
    tok.decoder = decoders.Sequence([decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()])
    return tok


def _sentencepiece(source: TokenizerSource) -> HFTokenizer:
    tokens, types = source.tokens, source.token_types or [TOKEN_NORMAL] * len(source.tokens)
    vocab = {token: i for i, token in enumerate(tokens)}
    unk = next((tokens[i] for i, t in enumerate(types) if t == TOKEN_UNKNOWN), None)
    tok = HFTokenizer(
        models.BPE(
            vocab=vocab, merges=_merges_by_score(source), unk_token=unk, fuse_unk=True, byte_fallback=True
        )
    )
    steps = [normalizers.Prepend(SPACE)] if source.add_space_prefix else []
    tok.normalizer = normalizers.Sequence([*steps, normalizers.Replace(" ", SPACE)])
    tok.decoder = decoders.Sequence(
        [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
        + ([decoders.Strip(" ", 1, 0)] if source.add_space_prefix else [])
    )
    return tok


def _merges_by_score(source: TokenizerSource) -> list[tuple[str, str]]:
    """Every way to make a normal or user-defined piece from two pieces, best score first (ties: lower id)."""
    tokens, scores = source.tokens, source.scores
    types = source.token_types or [TOKEN_NORMAL] * len(tokens)
    known = set(tokens)
    ranked = []
    for i, piece in enumerate(tokens):
        if types[i] not in (TOKEN_NORMAL, TOKEN_USER_DEFINED) or len(piece) < 2:
            continue
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in known and right in known:
                ranked.append((-scores[i], i, cut, left, right))
    ranked.sort()
    return [(left, right) for *_, left, right in ranked]
