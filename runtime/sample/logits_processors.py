"""Edits to a row's logits that a request asks for before sampling: logit_bias and min_tokens.

Applied in place, only to the rows of requests that set them; other rows are not touched.
"""

from __future__ import annotations

import torch

from scheduler import SamplingParams


@torch.inference_mode()
def apply_logits_processors(
    logits: torch.Tensor,
    params: list[SamplingParams],
    num_outputs: list[int],
    end_token_ids: list[tuple[int | None, ...]],
) -> None:
    """logits: float32 [rows, vocab], edited in place; per row its params, the tokens it has generated
    so far and the ids that end its generation (eos, then end-of-turn tokens; None: none)."""
    vocab = logits.shape[-1]
    for i, p in enumerate(params):
        if not p.constrains_logits:
            continue
        if p.logit_bias:
            ids = [t for t in p.logit_bias if 0 <= t < vocab]
            logits[i, ids] += torch.tensor(
                [p.logit_bias[t] for t in ids], dtype=logits.dtype, device=logits.device
            )
        if num_outputs[i] < p.min_tokens:
            banned = [t for t in [*end_token_ids[i], *p.stop_token_ids] if t is not None and 0 <= t < vocab]
            logits[i, banned] = float("-inf")
