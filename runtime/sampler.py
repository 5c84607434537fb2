"""Pick the next token of each sequence from its logits and its SamplingParams.

Penalties (repetition, then frequency and presence) adjust a row's logits
first. Greedy rows take the argmax. Other rows are scaled by temperature, cut to
top-k and to top-p, and drawn from the rest; a request with a seed draws from
its own generator, so its tokens do not depend on what else is in the batch.
"""
from __future__ import annotations

import torch

from scheduler import SamplingParams


@torch.inference_mode()
def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None],
           histories: list[tuple[list[int], list[int]]] | None = None) -> list[int]:
    """logits: float32 [N, vocab]; histories: (prompt ids, output ids) per row, needed by penalties.
    Returns N token ids."""
    for i, p in enumerate(params):
        if p.penalized:
            _penalize(logits[i], p, *histories[i])
    tokens = logits.argmax(dim=-1)
    rows = [i for i, p in enumerate(params) if not p.greedy]
    if rows:
        sub = logits[rows]
        temperature = torch.tensor([params[i].temperature for i in rows], dtype=sub.dtype,
                                   device=sub.device).unsqueeze(1)
        # A tiny repetition penalty or temperature can push a logit past float32's range; an inf would
        # turn the softmax into NaN, so clamp to the largest finite value (the order is unchanged).
        sub = torch.nan_to_num(sub / temperature, nan=float("-inf"), posinf=torch.finfo(sub.dtype).max)
        sub = _top_k_top_p(sub, [params[i].top_k for i in rows], [params[i].top_p for i in rows])
        probs = torch.softmax(sub, dim=-1)
        for j, i in enumerate(rows):
            tokens[i] = torch.multinomial(probs[j], 1, generator=generators[i])[0]
    return tokens.tolist()


def _penalize(row: torch.Tensor, p: SamplingParams, prompt: list[int], output: list[int]) -> None:
    """In place, on one row of logits."""
    vocab = row.shape[0]
    counts = torch.bincount(torch.tensor(output, dtype=torch.int64, device=row.device), minlength=vocab)[:vocab]
    if p.repetition_penalty != 1:
        seen = counts > 0
        seen[torch.tensor(prompt, dtype=torch.int64, device=row.device)] = True
        hit = row[seen]
        row[seen] = torch.where(hit > 0, hit / p.repetition_penalty, hit * p.repetition_penalty)
    if p.frequency_penalty or p.presence_penalty:
        row -= p.frequency_penalty * counts.to(row.dtype) + p.presence_penalty * (counts > 0).to(row.dtype)


def _top_k_top_p(logits: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    vocab = logits.shape[-1]
    need_k = any(0 < k < vocab for k in top_k)
    need_p = any(p < 1.0 for p in top_p)
    if not (need_k or need_p):
        return logits
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    if need_k:
        k = torch.tensor([k if 0 < k < vocab else vocab for k in top_k], device=logits.device)
        ranks = torch.arange(vocab, device=logits.device).unsqueeze(0)
        sorted_logits = sorted_logits.masked_fill(ranks >= k.unsqueeze(1), float("-inf"))
    if need_p:
        p = torch.tensor(top_p, dtype=logits.dtype, device=logits.device).unsqueeze(1)
        probs = torch.softmax(sorted_logits, dim=-1)
        # drop a token when the mass before it already reaches top_p (the most likely always stays)
        before = probs.cumsum(dim=-1) - probs
        sorted_logits = sorted_logits.masked_fill(before >= p, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
