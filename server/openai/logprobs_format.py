"""Token logprobs in OpenAI's two shapes: completions' parallel arrays and chat's content list.

A token's text is its bytes decoded as UTF-8 (a token holding part of a character shows U+FFFD);
chat also gives the bytes themselves, so a client can join them.
"""

from __future__ import annotations

import math

from runtime.model.tokenizer import Tokenizer
from runtime.sample.token_logprob import TokenLogprob

LOWEST_LOGPROB = -9999.0
"""What a logprob of -inf (a token the step's processing banned) is reported as: JSON has no -Infinity
(nor NaN), so a client's parser would refuse the whole reply. vLLM reports the same value."""


def _finite(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else LOWEST_LOGPROB


def _text(tokenizer: Tokenizer, token_id: int) -> str:
    return tokenizer.token_bytes(token_id).decode("utf-8", errors="replace")


def completion_logprobs(
    tokenizer: Tokenizer, token_ids: list[int], scores: list[TokenLogprob | None], text_offset: int = 0
) -> dict:
    """{tokens, token_logprobs, top_logprobs, text_offset}; a None score (the first prompt token) gives
    null logprobs. top_logprobs holds the k alternatives and the chosen token, as vLLM's do."""
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for token_id, score in zip(token_ids, scores):
        text = _text(tokenizer, token_id)
        out["tokens"].append(text)
        out["text_offset"].append(text_offset)
        text_offset += len(text)
        if score is None:
            out["token_logprobs"].append(None)
            out["top_logprobs"].append(None)
            continue
        out["token_logprobs"].append(_finite(score.logprob))
        top = {_text(tokenizer, t): _finite(lp) for t, lp in score.top}
        top.setdefault(text, _finite(score.logprob))
        out["top_logprobs"].append(top)
    return out


def merge_completion_logprobs(first: dict | None, second: dict) -> dict:
    if first is None:
        return second
    return {key: first[key] + second[key] for key in first}


def chat_logprobs(tokenizer: Tokenizer, token_ids: list[int], scores: list[TokenLogprob]) -> dict:
    """{"content": [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]}."""

    def entry(token_id: int, logprob: float) -> dict:
        raw = tokenizer.token_bytes(token_id)
        return {
            "token": raw.decode("utf-8", errors="replace"),
            "logprob": _finite(logprob),
            "bytes": list(raw),
        }

    content = []
    for token_id, score in zip(token_ids, scores):
        item = entry(token_id, score.logprob)
        item["top_logprobs"] = [entry(t, lp) for t, lp in score.top]
        content.append(item)
    return {"content": content}
