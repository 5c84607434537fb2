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
