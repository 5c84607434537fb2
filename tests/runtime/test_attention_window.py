"""The C attention kernels' sliding window and logit soft-cap (and head_dim 256), decode and prefill, at every
instruction-set level, against a dense PyTorch reference written here from the rule: a query at position p
sees the keys at positions j with p - window < j <= p (transformers' sliding_window), each scaled score s
becomes cap * tanh(s / cap) before the softmax."""

from __future__ import annotations

import pytest
import torch

from runtime.kernels import paged_attention as native_attention
from tests.runtime.native_levels import kernel_level  # noqa: F401 (a fixture)

BS = 16
# (heads, kv_heads, head_dim): GQA groups of 2, 4 and 8; head_dim 64, 128, 256; the last one the generic loops
SHAPES = [(8, 4, 64), (8, 2, 128), (8, 1, 256), (4, 2, 32)]
# (window, softcap): a window shorter than the contexts, a cap that bites (scores of +-30 capped at 5),
# both; and neither, so the plain path is checked on the same shapes
LIMITS = [(None, None), (13, None), (None, 5.0), (40, 5.0)]


def reference(q, keys, values, positions, scale, window, softcap):
    """q [n, H, D] at `positions`, over keys/values [ctx, KVH, D] (float32); dense, one query at a time."""
    heads, kv_heads = q.shape[1], keys.shape[1]
    k = keys.repeat_interleave(heads // kv_heads, dim=1)
    v = values.repeat_interleave(heads // kv_heads, dim=1)
    scores = torch.einsum("nhd,chd->hnc", q, k) * scale
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    j, p = torch.arange(keys.shape[0]).view(1, -1), positions.view(-1, 1)
    hidden = j > p
    if window is not None:
        hidden |= j <= p - window
    return torch.einsum("hnc,chd->nhd", scores.masked_fill(hidden, float("-inf")).softmax(-1), v)


def pool(lengths, kv_heads, d, dtype, g):
    """Sequences of `lengths` in a shuffled block pool: (k_cache, v_cache, tables [S, width])."""
    width = max((n + BS - 1) // BS for n in lengths)
    blocks = len(lengths) * width
    k_cache = (torch.randn(blocks, BS, kv_heads, d, generator=g) * 3).to(dtype)  # scores up to ~+-30
    v_cache = torch.randn(blocks, BS, kv_heads, d, generator=g).to(dtype)
    tables = torch.randperm(blocks, generator=g).view(len(lengths), width)
    return k_cache, v_cache, tables


def seq(cache, table, n):
    return cache[table].flatten(0, 1)[:n].float()


@pytest.mark.parametrize("window, softcap", LIMITS)
@pytest.mark.parametrize("heads, kv_heads, d", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.usefixtures("kernel_level")
def test_decode_window_and_softcap_match_dense(heads, kv_heads, d, dtype, window, softcap):
    """Ten sequences of 1-90 tokens (some inside the window, some far past it, some ending mid-block), one
    query each; bfloat16 or float32 caches."""
    g = torch.Generator().manual_seed(d + heads)
    lengths = [1, 5, 13, 14, 16, 17, 40, 41, 77, 90]
    k_cache, v_cache, tables = pool(lengths, kv_heads, d, dtype, g)
    q = torch.randn(len(lengths), heads, d, generator=g)
    lens = torch.tensor(lengths)
    got = native_attention.decode_attention(q, k_cache, v_cache, tables, lens, d**-0.5, window, softcap)
    for b, n in enumerate(lengths):
        expected = reference(
            q[b : b + 1],
            seq(k_cache, tables[b], n),
            seq(v_cache, tables[b], n),
            torch.tensor([n - 1]),
            d**-0.5,
            window,
            softcap,
        )
        torch.testing.assert_close(got[b : b + 1], expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("window, softcap", LIMITS + [(3, None)])  # a window narrower than a task's rows
@pytest.mark.parametrize("heads, kv_heads, d", SHAPES[:3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.usefixtures("kernel_level")
def test_prefill_window_and_softcap_match_dense(heads, kv_heads, d, dtype, window, softcap):
    """Three chunks in one call as a step has them (after decode rows the kernel must leave alone): a whole
    prompt longer than the window, a chunk after a cached prefix, a short chunk far into its sequence."""
    g = torch.Generator().manual_seed(d + 7)
    chunks = [(61, 61), (23, 50), (5, 88)]  # (rows, context_len)
    k_cache, v_cache, tables = pool([c for _, c in chunks], kv_heads, d, dtype, g)
    spans, first = [], 2
    for rows, context in chunks:
        spans.append((first, rows, context))
        first += rows
    q = torch.randn(first, heads, d, generator=g)
    out = torch.full_like(q, 7.0)
    assert native_attention.prefill_usable(q, k_cache)
    native_attention.prefill_attention(
        q, k_cache, v_cache, tables, torch.tensor(spans), d**-0.5, out, window, softcap
    )
    assert (out[:2] == 7.0).all()
    for c, (start, rows, context) in enumerate(spans):
        expected = reference(
            q[start : start + rows],
            seq(k_cache, tables[c], context),
            seq(v_cache, tables[c], context),
            torch.arange(context - rows, context),
            d**-0.5,
            window,
            softcap,
        )
        torch.testing.assert_close(out[start : start + rows], expected, atol=1e-4, rtol=1e-4)
