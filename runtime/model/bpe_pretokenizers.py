"""How a byte-level BPE vocabulary from a GGUF file splits text into words before merging, by the name in
its `tokenizer.ggml.pre` key (llama.cpp's convention: the converter names the pre-tokenizer it recognised
in the model's tokenizer.json).

Each rule is a list of split patterns applied in turn, each cutting every piece of the previous one into
its matches and the gaps between them, as the tokenizers library's Split(behavior="isolated") does. Only
names whose handling is checked against llama.cpp's vocabulary test vectors (tests/runtime/
test_llamacpp_vocab.py) are here, with the names llama.cpp treats identically; any other name is refused.
"""

from __future__ import annotations

from dataclasses import dataclass

_CONTRACTIONS = "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
LLAMA3 = (
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN2 = _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
QWEN35 = (
    _CONTRACTIONS
    + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_CJK = "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+"
_DEEPSEEK_CASED_LETTERS = (
    "A-Za-z\xb5\xc0-\xd6\xd8-\xf6\xf8-\u01ba\u01bc-\u01bf\u01c4-\u0293\u0295-\u02af\u0370-\u0373\u0376\u0377"
    "\u037b-\u037d\u037f\u0386\u0388-\u038a\u038c\u038e-\u03a1\u03a3-\u03f5\u03f7-\u0481\u048a-\u052f"
    "\u0531-\u0556\u10a0-\u10c5\u13a0-\u13f5\u13f8-\u13fd\u1c90-\u1cba\u1cbd-\u1cbf\u1d00-\u1d2b"
    "\u1d6b-\u1d77\u1d79-\u1d9a\u1e00-\u1f15\u1f18-\u1f1d\u1f20-\u1f45\u1f48-\u1f4d\u1f50-\u1f57\u1f59"
    "\u1f5b\u1f5d\u1f5f-\u1f7d\u1f80-\u1fb4\u1fb6-\u1fbc\u1fbe\u1fc2-\u1fc4\u1fc6-\u1fcc\u1fd0-\u1fd3"
    "\u1fd6-\u1fdb\u1fe0-\u1fec\u1ff2-\u1ff4\u1ff6-\u1ffc\u2102\u2107\u210a-\u2113\u2115\u2119-\u211d"
    "\u2124\u2126\u2128\u212a-\u212d\u212f-\u2134\u2139\u213c-\u213f\u2145-\u2149\u214e\u2183\u2184"
    "\u2c00-\u2c7b\u2c7e-\u2ce4\u2ceb-\u2cee\u2cf2\u2cf3\ua640-\ua66d\ua680-\ua69b\ua722-\ua76f"
    "\ua771-\ua787\ua78b-\ua78e\uab70-\uabbf\ufb00-\ufb06\ufb13-\ufb17\uff21-\uff3a\uff41-\uff5a"
    "\U00010400-\U0001044f\U000104b0-\U000104d3\U000104d8-\U000104fb\U00010c80-\U00010cb2"
    "\U00010cc0-\U00010cf2\U000118a0-\U000118df\U0001e900-\U0001e943"
)


@dataclass(frozen=True)
class BPEPreTokenizer:
    patterns: tuple[str, ...]
    """Split patterns, applied in order."""
    ignore_merges: bool = False
    """A word that is itself in the vocabulary is one token, whatever the merges would make of it (Llama 3)."""
    add_bos: bool = False
    """Whether a BOS token leads an encoded text when the file has no tokenizer.ggml.add_bos_token key."""


_LLAMA3 = BPEPreTokenizer((LLAMA3,), ignore_merges=True, add_bos=True)
_QWEN2 = BPEPreTokenizer((QWEN2,))
_STARCODER = BPEPreTokenizer((r"\p{N}", GPT2))
_GPT2 = BPEPreTokenizer((GPT2,))

BPE_PRETOKENIZERS: dict[str, BPEPreTokenizer] = {
    **dict.fromkeys(["llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "lfm2"], _LLAMA3),
    **dict.fromkeys(["qwen2", "deepseek-r1-qwen", "stablelm2"], _QWEN2),
    "qwen35": BPEPreTokenizer((QWEN35,)),
    **dict.fromkeys(
        ["starcoder", "refact", "command-r", "smollm", "codeshell", "exaone", "minerva-7b"], _STARCODER
    ),
    **dict.fromkeys(["gpt-2", "phi-2", "mpt", "olmo", "jais", "exaone4", "trillion"], _GPT2),
    "falcon": BPEPreTokenizer((r"[\p{P}\$\+<=>\^~\|`]+", GPT2, "[0-9][0-9][0-9]")),
    "deepseek-llm": BPEPreTokenizer(
        (
            "[\r\n]",
            rf"\s?[{_DEEPSEEK_CASED_LETTERS}]+",
            "\\s?[!-/:-~\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3000-\u3002]+",
            r"\s+$",
            _CJK,
            r"\p{N}+",
        )
    ),
    "deepseek-coder": BPEPreTokenizer(("[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", _CJK, r"\p{N}")),
    # llama.cpp's fallback for files converted before the key existed (it warns that quality degrades)
    "default": BPEPreTokenizer((r"[\p{P}\$\+<=>\^~\|]+", GPT2, r"\p{N}+", "[0-9][0-9][0-9]")),
}


def bpe_pretokenizer(pre: str | None) -> BPEPreTokenizer:
    """The rule for a `tokenizer.ggml.pre` value (None: the key is missing, llama.cpp's 'default').
    Raises ValueError naming an unsupported value and listing the supported ones."""
    rule = BPE_PRETOKENIZERS.get("default" if pre is None else pre)
    if rule is None:
        raise ValueError(
            f"model: the GGUF file's BPE pre-tokenizer tokenizer.ggml.pre={pre!r} is not supported; "
            f"supported: {', '.join(sorted(BPE_PRETOKENIZERS))}"
        )
    return rule
