"""Pick the next token of each sequence from its logits and its SamplingParams, for the whole batch at once.

Penalties (repetition, then frequency and presence) adjust the penalized rows
first, from token counts built with one scatter. Greedy rows take the argmax.
Other rows are scaled by their temperature. Rows with top-k are cut to their k
largest logits (topk, never a full sort) and top-p, if any, applies within them.
Rows with top-p alone never sort or look for their largest logits at all: they
draw from the whole distribution and keep the draw when it lies in the nucleus
(the probability above the drawn token's is below top_p); otherwise every token
no more likely than the drawn one is outside the nucleus too, so those are cut
and the row draws again. Accepted draws follow the nucleus's renormalised
distribution exactly, and a draw is accepted with probability at least top_p,
so a batch needs about two rounds of a few passes over the vocabulary.
Every draw is an inverse CDF with one uniform number per row: a request with a
seed takes its numbers from its own generator, so its tokens do not depend on
what else is in the batch; the rest share one draw from the global generator.
Rows without top-k run the same nucleus rule in one C call where the kernels can
be had (native_sampling.py): a few passes per row with the row in cache, instead
of a pass over the whole batch per torch op. There each draw is an exponential
race keyed by the row's uniform rather than an inverse CDF, so logits that differ
by float noise (another batch, a recomputation after preemption) still draw the
same token; the PyTorch path here is the fallback where no C compiler is found.
"""

from __future__ import annotations

import torch

from runtime.kernels import nucleus_sampling as native_sampling
from scheduler import SamplingParams

MAX_ROUNDS = 64
"""Nucleus rejection rounds before a row takes its most likely remaining token (each round accepts with
probability >= top_p, so a row rejected 64 times is a float rounding corner, not chance)."""


@torch.inference_mode()
def sample(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
    histories: list[tuple[list[int], list[int]]] | None = None,
) -> list[int]:
    """logits: float32 [N, vocab]; histories: (prompt ids, output ids) per row, needed by penalties.
    Returns N token ids."""
    penalized = [i for i, p in enumerate(params) if p.penalized]
    if penalized:
        penalize(logits, penalized, params, histories)
    rows = [i for i, p in enumerate(params) if not p.greedy]
    if len(rows) == len(params):
        tokens = torch.empty(len(params), dtype=torch.int64, device=logits.device)
    elif native_sampling.usable(logits):
        tokens = native_sampling.greedy_sample(logits)
    else:
        tokens = logits.argmax(dim=-1)
    if rows:
        sub = logits[rows] if len(rows) < len(params) else logits
        gens = [generators[i] for i in rows]
        vocab = sub.shape[-1]
        top_k = [params[i].top_k if 0 < params[i].top_k < vocab else vocab for i in rows]
        top_p = [params[i].top_p for i in rows]
        temperature = [params[i].temperature for i in rows]
        cut = [j for j in range(len(rows)) if top_k[j] < vocab]
        uncut = [j for j in range(len(rows)) if top_k[j] == vocab]
        drawn = torch.empty(len(rows), dtype=torch.int64, device=sub.device)
        if uncut and native_sampling.usable(sub):
            part = sub[uncut] if len(uncut) < len(rows) else sub
            picked = native_sampling.nucleus_sample(
                part,
                [temperature[j] for j in uncut],
                [top_p[j] for j in uncut],
                _uniforms([gens[j] for j in uncut], sub.device, torch.float64),
            )
            groups = ((cut, _sample_cut),)
            _place(drawn, uncut, picked, len(rows))
        else:
            free = [j for j in uncut if top_p[j] >= 1.0]
            nucleus = [j for j in uncut if top_p[j] < 1.0]
            groups = ((free, _sample_free), (nucleus, _sample_nucleus), (cut, _sample_cut))
        for group, draw in groups:
            if not group:
                continue
            part = sub[group] if len(group) < len(rows) else sub
            scale = torch.tensor([temperature[j] for j in group], dtype=sub.dtype, device=sub.device)
            picked = draw(
                part / scale.unsqueeze(1),
                [top_k[j] for j in group],
                [top_p[j] for j in group],
                [gens[j] for j in group],
            )
            _place(drawn, group, picked, len(rows))
        tokens[rows] = drawn
    return tokens.tolist()


def _place(drawn: torch.Tensor, group: list[int], picked: torch.Tensor, rows: int) -> None:
    if len(group) < rows:
        drawn[group] = picked
    else:
        drawn.copy_(picked)


def _uniforms(
    generators: list[torch.Generator | None], device: torch.device, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """One U[0, 1) number per row: seeded rows from their own generator, the rest in one draw."""
    u = torch.rand(len(generators), device=device, dtype=dtype)
    for j, g in enumerate(generators):
        if g is not None:
            u[j] = torch.rand(1, generator=g, device=device, dtype=dtype)[0]
    return u


def _inverse_cdf(probs: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """probs [R, V] (rows need not sum to 1); the first index whose running sum passes u x total."""
    cdf = probs.cumsum(dim=-1)
    target = (uniform * cdf[:, -1]).unsqueeze(1)
    return torch.searchsorted(cdf, target, right=True).squeeze(1).clamp_(max=probs.shape[-1] - 1)


def _sample_free(
    logits: torch.Tensor, top_k: list[int], top_p: list[float], generators: list[torch.Generator | None]
) -> torch.Tensor:
    """Rows with neither cut: one draw from the whole distribution."""
    return _inverse_cdf(torch.softmax(logits, dim=-1), _uniforms(generators, logits.device))


def _sample_nucleus(
    logits: torch.Tensor, top_k: list[int], top_p: list[float], generators: list[torch.Generator | None]
) -> torch.Tensor:
    """Rows with top-p alone, by rejection (module docstring): draw j; keep it when the mass of tokens more
    likely than j is below top_p, else zero every token no more likely than j and draw again."""
    probs = torch.softmax(logits, dim=-1)
    p = torch.tensor(top_p, dtype=probs.dtype, device=probs.device)
    tokens = torch.empty(len(top_p), dtype=torch.int64, device=probs.device)
    pending = list(range(len(top_p)))
    for _ in range(MAX_ROUNDS):
        part = probs[pending] if len(pending) < len(top_p) else probs
        draw = _inverse_cdf(part, _uniforms([generators[j] for j in pending], probs.device))
        chosen = part.gather(1, draw.unsqueeze(1))
        above = torch.where(part > chosen, part, 0.0).sum(-1)
        # tokens cut in earlier rounds are all less likely than j, so this is j's mass above in the full row
        accepted = (above < p[pending]).tolist()
        keep = [pending[i] for i, ok in enumerate(accepted) if ok]
        if keep:
            tokens[keep] = draw[[i for i, ok in enumerate(accepted) if ok]]
        rejected = [i for i, ok in enumerate(accepted) if not ok]
        if not rejected:
            return tokens
        rows = [pending[i] for i in rejected]
        probs[rows] = part[rejected].masked_fill(part[rejected] <= chosen[rejected], 0.0)
        pending = rows
    tokens[pending] = probs[pending].argmax(dim=-1)
    return tokens


def _sample_cut(
    logits: torch.Tensor, top_k: list[int], top_p: list[float], generators: list[torch.Generator | None]
) -> torch.Tensor:
    """Rows with a top-k cut: draw among their k largest logits; top-p applies to the distribution left
    after top-k (the order topk returns is the sorted order the nucleus is defined on)."""
    k = torch.tensor(top_k, device=logits.device).unsqueeze(1)
    p = torch.tensor(top_p, dtype=logits.dtype, device=logits.device).unsqueeze(1)
    values, order = logits.topk(max(top_k), dim=-1)  # largest first
    ranks = torch.arange(values.shape[-1], device=logits.device).unsqueeze(0)
    probs = torch.softmax(values.masked_fill(ranks >= k, float("-inf")), dim=-1)
    if min(top_p) < 1.0:
        # drop a token when the mass before it already reaches top_p (the most likely always stays)
        before = probs.cumsum(dim=-1) - probs
        probs = probs.masked_fill(before >= p, 0.0)
    uniform = _uniforms(generators, logits.device)
    return order.gather(1, _inverse_cdf(probs, uniform).unsqueeze(1)).squeeze(1)


def penalize(
    logits: torch.Tensor,
    rows: list[int],
    params: list[SamplingParams],
    histories: list[tuple[list[int], list[int]]],
) -> None:
    """In place, on the penalized rows; token counts for all of them come from one scatter."""
    device = logits.device
    vocab = logits.shape[-1]
    sub = logits[rows]
    outputs = [histories[i][1] for i in rows]
    row_of = torch.repeat_interleave(
        torch.arange(len(rows), device=device), torch.tensor([len(o) for o in outputs], device=device)
    )
    flat = torch.tensor([t for o in outputs for t in o], dtype=torch.int64, device=device)
    counts = torch.zeros(len(rows), vocab, dtype=sub.dtype, device=device)
    counts.index_put_((row_of, flat), torch.ones_like(flat, dtype=sub.dtype), accumulate=True)

    def column(values: list[float]) -> torch.Tensor:
        return torch.tensor(values, dtype=sub.dtype, device=device).unsqueeze(1)

    rep = column([params[i].repetition_penalty for i in rows])
    if (rep != 1).any():
        prompts = [histories[i][0] for i in rows]
        prow = torch.repeat_interleave(
            torch.arange(len(rows), device=device), torch.tensor([len(x) for x in prompts], device=device)
        )
        seen = counts > 0
        seen[prow, torch.tensor([t for x in prompts for t in x], dtype=torch.int64, device=device)] = True
        penalized = torch.where(sub > 0, sub / rep, sub * rep)
        sub = torch.where(seen, penalized, sub)
    freq = column([params[i].frequency_penalty for i in rows])
    pres = column([params[i].presence_penalty for i in rows])
    sub = sub - freq * counts - pres * (counts > 0).to(sub.dtype)
    logits[rows] = sub
