"""Pick the next token of each sequence from its logits and its SamplingParams, for the whole batch at once.

Penalties (repetition, then frequency and presence) adjust the penalized rows
first, from token counts built with one scatter. Greedy rows take the argmax.
Other rows are scaled by their temperature; rows with top-k or top-p are cut
to their candidates (the largest logits, found with topk rather than a full
sort, widened only when a row's top-p mass lies beyond them) and every row
draws by inverse CDF with one uniform number: a request with a seed takes its
number from its own generator, so its tokens do not depend on what else is in
the batch; the rest share one draw from the global generator.
"""

from __future__ import annotations

import torch

from scheduler import SamplingParams

CANDIDATES = 256
"""First guess at how many of the largest logits hold every top-p row's nucleus."""


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
        _penalize(logits, penalized, params, histories)
    tokens = logits.argmax(dim=-1)
    rows = [i for i, p in enumerate(params) if not p.greedy]
    if rows:
        sub = logits[rows] if len(rows) < len(params) else logits
        uniform = _uniforms([generators[i] for i in rows], sub.device)
        temperature = torch.tensor([params[i].temperature for i in rows], dtype=sub.dtype, device=sub.device)
        sub = sub / temperature.unsqueeze(1)
        vocab = sub.shape[-1]
        top_k = [params[i].top_k if 0 < params[i].top_k < vocab else vocab for i in rows]
        top_p = [params[i].top_p for i in rows]
        cut = [j for j in range(len(rows)) if top_k[j] < vocab or top_p[j] < 1.0]
        free = [j for j in range(len(rows)) if j not in set(cut)] if cut else list(range(len(rows)))
        drawn = torch.empty(len(rows), dtype=torch.int64, device=sub.device)
        if free:
            part = sub[free] if len(free) < len(rows) else sub
            drawn[free] = _inverse_cdf(torch.softmax(part, dim=-1), uniform[free])
        if cut:
            drawn[cut] = _sample_cut(sub[cut], [top_k[j] for j in cut], [top_p[j] for j in cut], uniform[cut])
        tokens[rows] = drawn
    return tokens.tolist()


def _uniforms(generators: list[torch.Generator | None], device: torch.device) -> torch.Tensor:
    """One U[0, 1) number per row: seeded rows from their own generator, the rest in one draw."""
    u = torch.rand(len(generators), device=device)
    for j, g in enumerate(generators):
        if g is not None:
            u[j] = torch.rand(1, generator=g, device=device)[0]
    return u


def _inverse_cdf(probs: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """probs [R, V] (rows need not sum to 1); the first index whose running sum passes u x total."""
    cdf = probs.cumsum(dim=-1)
    target = (uniform * cdf[:, -1]).unsqueeze(1)
    return torch.searchsorted(cdf, target, right=True).squeeze(1).clamp_(max=probs.shape[-1] - 1)


def _sample_cut(
    logits: torch.Tensor, top_k: list[int], top_p: list[float], uniform: torch.Tensor
) -> torch.Tensor:
    """Rows with a top-k and/or top-p cut (top_k = vocab: none): draw among the largest logits only.
    top-p applies to the distribution left after top-k, as it did with a full sort."""
    vocab = logits.shape[-1]
    k = torch.tensor(top_k, device=logits.device).unsqueeze(1)
    p = torch.tensor(top_p, dtype=logits.dtype, device=logits.device).unsqueeze(1)
    limited = k < vocab  # rows whose top-k set lies inside the candidates, renormalised over it
    width = max([x for x in top_k if x < vocab], default=0)
    need_p = min(top_p) < 1.0
    if need_p and not bool(limited.all()):
        width = max(width, min(CANDIDATES, vocab))
        log_total = torch.logsumexp(logits, dim=-1, keepdim=True)  # rows without top-k: the whole vocabulary
    while True:
        values, order = logits.topk(width, dim=-1)  # largest first
        ranks = torch.arange(width, device=logits.device).unsqueeze(0)
        values = values.masked_fill(ranks >= k, float("-inf"))
        probs = torch.softmax(values, dim=-1)
        if not need_p or bool(limited.all()):
            break
        probs = torch.where(limited, probs, (values - log_total).exp())
        if width == vocab or bool((limited | (probs.sum(-1, keepdim=True) >= p)).all()):
            break
        width = min(vocab, width * 4)  # some nucleus reaches past the candidates
    if need_p:
        # drop a token when the mass before it already reaches top_p (the most likely always stays)
        before = probs.cumsum(dim=-1) - probs
        probs = probs.masked_fill(before >= p, 0.0)
    return order.gather(1, _inverse_cdf(probs, uniform).unsqueeze(1)).squeeze(1)


def _penalize(
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
