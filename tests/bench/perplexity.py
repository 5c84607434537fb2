"""Perplexity of the model on a fixed text: how the quantized and reduced-precision paths compare in quality."""

from __future__ import annotations

import math

import torch

FIXED_TEXT = (
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg combined "
    "movable metal type, oil-based ink and a wooden press adapted from those used for wine. Before his "
    "invention, books were copied by hand, a slow and expensive process that kept them rare. Within a few "
    "decades, printing shops had spread to more than two hundred cities across Europe, and millions of "
    "volumes had been produced. Cheaper books helped literacy grow, allowed scientists to share their "
    "results quickly, and made it possible for new ideas to travel far beyond the place where they began. "
    "Historians still debate how much the press changed society, but few doubt that it was one of the most "
    "important inventions of its time."
)


def perplexity(engine, text: str = FIXED_TEXT) -> float:
    """exp(mean negative log-likelihood) of each token of `text` given the ones before it."""
    ids = engine.tokenizer.encode(text)
    logits = engine.prompt_logits(ids)[:-1]
    nll = torch.nn.functional.cross_entropy(logits.float(), torch.tensor(ids[1:]), reduction="mean")
    return math.exp(nll.item())


FORCING_BIAS = 100.0
"""Added to the next token's logit so that llama.cpp picks it (no logit of this model is 100 below the top)."""


def llama_cpp_perplexity(server, ids: list[int]) -> float:
    """The same measure from llama.cpp (an xllamacpp.Server with its prompt cache on) over the token ids
    `ids`. Its server gives no prompt logprobs, so each position is one completion of one token: the prompt
    ids[: i + 1] (the cache makes that one new token to evaluate) with the true next token forced by a logit
    bias; the logprob llama.cpp reports for a chosen token is from the model's distribution before the bias
    (checked against its top logprobs, which the bias does not change)."""
    nll = 0.0
    for i in range(len(ids) - 1):
        body = {
            "prompt": ids[: i + 1],
            "max_tokens": 1,
            "temperature": 0,
            "n_probs": 1,
            "logit_bias": [[ids[i + 1], FORCING_BIAS]],
            "cache_prompt": True,
        }
        chosen = server.handle_completions(body)["choices"][0]["logprobs"]["content"][0]
        top = chosen["top_logprobs"][0]["logprob"]
        if chosen["id"] != ids[i + 1] or chosen["logprob"] > top + 1e-4:
            raise RuntimeError(
                f"llama.cpp perplexity: at position {i} it chose token {chosen['id']} (logprob {chosen['logprob']:.3f},"
                f" top {top:.3f}) instead of the forced {ids[i + 1]}: the logit-bias forcing does not hold"
            )
        nll -= chosen["logprob"]
    return math.exp(nll / (len(ids) - 1))
