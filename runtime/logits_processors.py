"""Edits to a row's logits that a request asks for before sampling: logit_bias and min_tokens.

Applied in place, only to the rows of requests that set them; other rows are not touched.
"""
from __future__ import annotations

import torch

from scheduler import Request


@torch.inference_mode()
def apply_logits_processors(logits: torch.Tensor, requests: list[Request]) -> None:
    """logits: float32 [len(requests), vocab], edited in place."""
    vocab = logits.shape[-1]
    for i, req in enumerate(requests):
        p = req.sampling_params
        if not p.constrains_logits:
            continue
        if p.logit_bias:
            ids = [t for t in p.logit_bias if 0 <= t < vocab]
            logits[i, ids] += torch.tensor([p.logit_bias[t] for t in ids], dtype=logits.dtype,
                                           device=logits.device)
        if req.num_output_tokens < p.min_tokens:
            banned = [t for t in [req.eos_token_id, *p.stop_token_ids] if t is not None and 0 <= t < vocab]
            logits[i, banned] = float("-inf")
