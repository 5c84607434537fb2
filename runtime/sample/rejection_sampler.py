"""Verify proposed tokens against the target model's logits, so that speculation changes no output.

A request with k proposed tokens d_0 .. d_{k-1} brings k + 1 rows of logits: row j is the model's
distribution p_j for the token after its tokens so far and d_0 .. d_{j-1}. Its rows' logits are
already processed (penalties, logit bias, min_tokens, grammar masks) as if the proposals before them
had been generated.

Greedy rows accept d_j while it is the argmax of row j; the first row whose argmax differs emits that
argmax instead, and when all k are accepted row k emits its argmax (the bonus token). That is exactly
the token stream greedy decoding gives without proposals.

Sampled rows use the standard rule of speculative sampling (Leviathan et al., Chen et al., 2023) with
a proposal distribution q that is a point mass on d_j (n-gram and suffix proposals, and a greedy draft
model): accept d_j with probability min(1, p_j(d_j) / q(d_j)) = p_j(d_j); on rejection draw from the
normalized max(0, p_j - q), which is p_j without d_j, renormalized. Each emitted token is then
distributed exactly as p_j, so the output is distributed as sampling without proposals.
p_j is the distribution the sampler draws from: temperature, then top-k, then top-p (the smallest set
of most likely tokens whose mass reaches top_p), as runtime/sample/sampler.py.
"""

from __future__ import annotations

import torch

from runtime.sample.sampler import _uniforms
from scheduler import SamplingParams


@torch.inference_mode()
def verify(
    logits: torch.Tensor,
    starts: list[int],
    drafts: list[list[int]],
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
) -> list[list[int]]:
    """logits: float32 [rows, vocab], processed; request i's k_i + 1 rows start at starts[i].
    Returns per request the tokens it emits: its accepted proposals, then one more token."""
    out: list[list[int]] = [[] for _ in starts]
    greedy = [i for i, p in enumerate(params) if p.greedy]
    if greedy:
        rows = [starts[i] + j for i in greedy for j in range(len(drafts[i]) + 1)]
        best = logits[rows].argmax(dim=-1).tolist()
        at = 0
        for i in greedy:
            d = drafts[i]
            picks = best[at : at + len(d) + 1]
            at += len(d) + 1
            a = 0
            while a < len(d) and picks[a] == d[a]:
                a += 1
            out[i] = d[:a] + [picks[a]]
    sampled = [i for i, p in enumerate(params) if not p.greedy]
    if sampled:
        _verify_sampled(logits, starts, drafts, params, generators, sampled, out)
    return out


def _verify_sampled(logits, starts, drafts, params, generators, group, out) -> None:
    sizes = [len(drafts[i]) + 1 for i in group]
    rows = [starts[i] + j for i in group for j in range(len(drafts[i]) + 1)]
    row_params = [params[i] for i, n in zip(group, sizes) for _ in range(n)]
    probs = target_probs(logits[rows], row_params)
    # p_j(d_j) of every proposal, and one uniform number per proposal, in one transfer each
    draft_rows = [r for r, (i, n) in enumerate(_row_owners(group, sizes)) if n < len(drafts[i])]
    draft_ids = [d for i in group for d in drafts[i]]
    p_draft = probs[draft_rows, draft_ids].tolist() if draft_rows else []
    uniforms = []
    for i in group:
        uniforms.append(_draws(generators[i], len(drafts[i]), logits.device))
    final_rows, removed = [], []
    at_row = at_draft = 0
    for g, i in enumerate(group):
        d = drafts[i]
        u = uniforms[g]
        a = 0
        while a < len(d) and u[a] < p_draft[at_draft + a]:
            a += 1
        out[i] = d[:a]
        final_rows.append(at_row + a)
        removed.append(d[a] if a < len(d) else -1)
        at_row += len(d) + 1
        at_draft += len(d)
    final = probs[final_rows]
    rejected = [r for r, t in enumerate(removed) if t >= 0]
    if rejected:  # the residual max(0, p - q) of a point mass q: p without the rejected token
        final[rejected, [removed[r] for r in rejected]] = 0.0
    picks = _inverse_cdf(final, _uniforms([generators[i] for i in group], logits.device, torch.float64))
    for g, i in enumerate(group):
        out[i].append(picks[g])


def _row_owners(group: list[int], sizes: list[int]):
    """(request, index of the row within the request's rows) for each row, in order."""
    for i, n in zip(group, sizes):
        for j in range(n):
            yield i, j


def _draws(generator: torch.Generator | None, n: int, device: torch.device) -> list[float]:
    if not n:
        return []
    return torch.rand(n, generator=generator, device=device, dtype=torch.float64).tolist()


def _inverse_cdf(probs: torch.Tensor, uniform: torch.Tensor) -> list[int]:
    cdf = probs.double().cumsum(dim=-1)
    target = (uniform.to(cdf.dtype) * cdf[:, -1]).unsqueeze(1)
    return torch.searchsorted(cdf, target, right=True).squeeze(1).clamp_(max=probs.shape[-1] - 1).tolist()


def target_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """float32 [rows, vocab]: the distribution each row's sampler draws from (temperature, top-k, top-p)."""
    vocab = logits.shape[-1]
    temperature = torch.tensor([p.temperature for p in params], dtype=logits.dtype, device=logits.device)
    scaled = logits / temperature.unsqueeze(1)
    top_k = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
    top_p = [p.top_p for p in params]
    if all(k == vocab for k in top_k) and all(p >= 1.0 for p in top_p):
        return torch.softmax(scaled, dim=-1)
    values, order = scaled.sort(dim=-1, descending=True)
    ranks = torch.arange(vocab, device=logits.device).unsqueeze(0)
    k = torch.tensor(top_k, device=logits.device).unsqueeze(1)
    sorted_probs = torch.softmax(values.masked_fill(ranks >= k, float("-inf")), dim=-1)
    p = torch.tensor(top_p, dtype=sorted_probs.dtype, device=logits.device).unsqueeze(1)
    before = sorted_probs.cumsum(dim=-1) - sorted_probs
    sorted_probs = sorted_probs.masked_fill(before >= p, 0.0)
    sorted_probs = sorted_probs / sorted_probs.sum(dim=-1, keepdim=True)
    return torch.zeros_like(sorted_probs).scatter_(1, order, sorted_probs)
