"""Paged attention (the C backend, the PyTorch backend; decodes and chunked prefill) against dense attention."""

from __future__ import annotations

import pytest
import torch

from runtime.attention.c_backend import CBackend
from runtime.attention.kv_cache import write_kv
from runtime.attention.metadata import PrefillChunk, ScheduledRows
from runtime.attention.torch_backend import TorchBackend, _decode
from runtime.kernels import paged_attention as native_attention
from tests.runtime.native_levels import kernel_level  # noqa: F401 (a fixture)

HEADS, KV_HEADS, D, BS, NUM_BLOCKS = 9, 3, 64, 16, 64


def dense(q, k, v, scale):
    """Causal attention of the last len(q) positions over k, v ([ctx, kv_heads, D]), the plain way."""
    n, ctx = q.shape[0], k.shape[0]
    k = k.repeat_interleave(HEADS // KV_HEADS, dim=1)
    v = v.repeat_interleave(HEADS // KV_HEADS, dim=1)
    scores = torch.einsum("nhd,chd->hnc", q, k) * scale
    pos = torch.arange(ctx - n, ctx).unsqueeze(1)
    scores = scores.masked_fill(torch.arange(ctx).unsqueeze(0) > pos, float("-inf"))
    return torch.einsum("hnc,chd->nhd", scores.softmax(-1), v)


def build(lengths, new_tokens, seed=0):
    """Sequences with random block tables; the last new_tokens[i] of each are this step's queries."""
    g = torch.Generator().manual_seed(seed)
    k_cache = torch.zeros(NUM_BLOCKS, BS, KV_HEADS, D)
    v_cache = torch.zeros_like(k_cache)
    free = torch.randperm(NUM_BLOCKS, generator=g).tolist()
    seqs = []
    for length in lengths:
        table = [free.pop() for _ in range((length + BS - 1) // BS)]
        k = torch.randn(length, KV_HEADS, D, generator=g)
        v = torch.randn(length, KV_HEADS, D, generator=g)
        slots = torch.tensor([table[p // BS] * BS + p % BS for p in range(length)])
        write_kv(k_cache, v_cache, k, v, slots)
        seqs.append((table, k, v))
    qs = [torch.randn(n, HEADS, D, generator=g) for n in new_tokens]
    return k_cache, v_cache, seqs, qs


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("lengths", [[1, 5, 16, 17, 40, 100], [37]])  # many sequences, and one split by head
def test_decode_matches_dense(native, dtype, lengths):
    if native:
        assert native_attention.load() is not None, (
            "the C kernel must build on this machine (gcc is required)"
        )
    backend = CBackend() if native else TorchBackend()
    k_cache, v_cache, seqs, qs = build(lengths, [1] * len(lengths))
    decodes = [ScheduledRows(t, n - 1, n) for (t, _, _), n in zip(seqs, lengths)]
    meta = backend.build(decodes, [], torch.zeros(0, dtype=torch.long), BS, torch.device("cpu"))
    q = torch.cat(qs).to(dtype)
    out = backend.forward(
        q, q[:, :KV_HEADS], q[:, :KV_HEADS], k_cache.to(dtype), v_cache.to(dtype), meta, D**-0.5
    )
    assert out.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 2e-2  # bfloat16 output: 8 bits of mantissa
    for i, (_, k, v) in enumerate(seqs):
        # the reference sees the same (rounded) inputs, in float32
        expected = dense(qs[i].to(dtype).float(), k.to(dtype).float(), v.to(dtype).float(), D**-0.5)
        torch.testing.assert_close(out[i : i + 1].float(), expected, atol=tol, rtol=tol)


@pytest.mark.parametrize("native", [True, False])  # the C kernel row by row; torch's flash kernel
def test_prefill_chunks_after_cached_prefix_match_dense(native):
    if native:
        assert native_attention.load() is not None, (
            "the C kernel must build on this machine (gcc is required)"
        )
    backend = CBackend() if native else TorchBackend()
    lengths, new = [30, 50, 7], [30, 12, 3]  # a whole prompt, and chunks after 38 and 4 cached tokens
    k_cache, v_cache, seqs, qs = build(lengths, new, seed=1)
    prefills = [ScheduledRows(t, length - n, length) for (t, _, _), n, length in zip(seqs, new, lengths)]
    meta = backend.build([], prefills, torch.zeros(0, dtype=torch.long), BS, torch.device("cpu"))
    q = torch.cat(qs)
    k_new = torch.cat([k[-n:] for (_, k, _), n in zip(seqs, new)])
    v_new = torch.cat([v[-n:] for (_, _, v), n in zip(seqs, new)])
    out = backend.forward(q, k_new, v_new, k_cache, v_cache, meta, D**-0.5)
    for (_, k, v), chunk, qi in zip(seqs, meta.prefills, qs):
        torch.testing.assert_close(
            out[chunk.start : chunk.end], dense(qi, k, v, D**-0.5), atol=1e-5, rtol=1e-5
        )


@pytest.mark.parametrize(
    "heads, kv_heads, d",
    [
        (9, 3, 64),
        (8, 1, 128),
        (4, 4, 64),
        (4, 2, 32),
        (12, 1, 64),
    ],  # the last two: the kernel's generic loops
)
@pytest.mark.parametrize("batch", [70, 3])  # a task per sequence (all its KV heads), a task per KV head
@pytest.mark.usefixtures("kernel_level")
def test_native_decode_matches_pytorch_decode_across_head_shapes(heads, kv_heads, d, batch):
    """The C kernel's grouped fast path (head_dim 64 or 128, up to 8 query heads a KV head) and its generic
    loops (other shapes) against the PyTorch decode path, bfloat16 KV, sequences of 1-300 tokens."""
    if native_attention.load() is None:
        pytest.skip("the native kernels cannot be built here")
    g = torch.Generator().manual_seed(3)
    lens = torch.randint(1, 300, (batch,), generator=g)
    width = (int(lens.max()) + BS - 1) // BS
    blocks = batch * width
    k_cache = torch.randn(blocks, BS, kv_heads, d, generator=g).bfloat16()
    v_cache = torch.randn(blocks, BS, kv_heads, d, generator=g).bfloat16()
    tables = torch.randperm(blocks, generator=g).view(batch, width)
    q = torch.randn(batch, heads, d, generator=g)
    bias = torch.zeros(batch, width * BS).masked_fill(
        torch.arange(width * BS) >= lens.unsqueeze(1), float("-inf")
    )
    expected = _decode(q.bfloat16(), k_cache, v_cache, tables, bias.view(batch, 1, 1, -1), d**-0.5)
    got = native_attention.decode_attention(q.bfloat16(), k_cache, v_cache, tables, lens, d**-0.5)
    torch.testing.assert_close(got.float(), expected.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize(
    "heads, kv_heads, d, n, ctx",
    [(9, 3, 64, 37, 37), (9, 3, 64, 12, 50), (4, 4, 64, 21, 40), (16, 1, 128, 5, 70), (8, 4, 64, 1, 9)],
)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.usefixtures("kernel_level")
def test_native_prefill_matches_dense_across_head_shapes(heads, kv_heads, d, n, ctx, dtype):
    """The C prefill kernel (query rows x heads across the vector lanes, the last rows' positions masked
    lane by lane) against dense causal attention, three sequences' chunks in one call as a step has them
    (after a few decode rows it must leave alone): whole prompts and chunks after a cached prefix, chunk
    lengths that do not fill the last task, bfloat16 KV; queries and output in bfloat16 or float32."""
    if native_attention.load() is None:
        pytest.skip("the native kernels cannot be built here")
    g = torch.Generator().manual_seed(4)
    chunks = [(n, ctx), (23, 23), (7, 47)]  # (rows, context_len) per sequence
    widths = [(c + BS - 1) // BS for _, c in chunks]
    k_cache = torch.randn(sum(widths) + 3, BS, kv_heads, d, generator=g).bfloat16()
    v_cache = torch.randn(sum(widths) + 3, BS, kv_heads, d, generator=g).bfloat16()
    order = torch.randperm(sum(widths) + 3, generator=g)
    tables = torch.zeros(len(chunks), max(widths), dtype=torch.int64)
    spans, first, decodes = [], 3, 3
    for c, ((rows, context), width) in enumerate(zip(chunks, widths)):
        tables[c, :width] = order[sum(widths[:c]) : sum(widths[: c + 1])]
        spans.append((first, rows, context))
        first += rows
    q = torch.randn(first, heads, d, generator=g).to(dtype)
    out = torch.full((first, heads, d), 7.0, dtype=dtype)
    assert native_attention.prefill_usable(q, k_cache)
    native_attention.prefill_attention(q, k_cache, v_cache, tables, torch.tensor(spans), d**-0.5, out)
    assert (out[:decodes] == 7.0).all()  # the decode rows are not the kernel's
    for c, (start, rows, context) in enumerate(spans):
        table = tables[c, : widths[c]]
        k = k_cache[table].flatten(0, 1)[:context].float().repeat_interleave(heads // kv_heads, dim=1)
        v = v_cache[table].flatten(0, 1)[:context].float().repeat_interleave(heads // kv_heads, dim=1)
        scores = torch.einsum("nhd,chd->hnc", q[start : start + rows].float(), k) * d**-0.5
        hidden = torch.arange(context).unsqueeze(0) > torch.arange(context - rows, context).unsqueeze(1)
        expected = torch.einsum("hnc,chd->nhd", scores.masked_fill(hidden, float("-inf")).softmax(-1), v)
        torch.testing.assert_close(out[start : start + rows].float(), expected, atol=2e-2, rtol=2e-2)


def test_metadata_made_outside_the_runner_takes_the_prefill_kernel(monkeypatch):
    """Metadata made by hand rather than by CBackend.build (no packed chunk tables): its chunks still go to
    the C prefill kernel, in one call, and give what a dense causal attention gives."""
    if native_attention.load() is None:
        pytest.skip("the native kernels cannot be built here")
    g = torch.Generator().manual_seed(5)
    heads, kv_heads, d, lens = 9, 3, 64, (29, 40)
    blocks = [(n + BS - 1) // BS for n in lens]
    k_cache = torch.randn(sum(blocks), BS, kv_heads, d, generator=g).bfloat16()
    v_cache = torch.randn(sum(blocks), BS, kv_heads, d, generator=g).bfloat16()
    chunks = [
        PrefillChunk(0, lens[0], lens[0], torch.arange(blocks[0])),
        PrefillChunk(lens[0], sum(lens), lens[1], torch.arange(blocks[0], sum(blocks))),
    ]
    q = torch.randn(sum(lens), heads, d, generator=g).bfloat16()
    calls = []
    kernel = native_attention.prefill_attention
    monkeypatch.setattr(native_attention, "prefill_attention", lambda *a: calls.append(1) or kernel(*a))
    backend = CBackend()
    meta = backend.metadata(slot_mapping=torch.arange(sum(lens)), prefills=chunks)
    got = backend.forward(q, None, None, k_cache, v_cache, meta, d**-0.5)
    assert len(calls) == 1
    for c in chunks:
        n = c.end - c.start
        k = k_cache[c.block_table].flatten(0, 1)[:n].float().repeat_interleave(heads // kv_heads, dim=1)
        v = v_cache[c.block_table].flatten(0, 1)[:n].float().repeat_interleave(heads // kv_heads, dim=1)
        scores = torch.einsum("nhd,chd->hnc", q[c.start : c.end].float(), k) * d**-0.5
        hidden = torch.arange(n).unsqueeze(0) > torch.arange(n).unsqueeze(1)
        expected = torch.einsum("hnc,chd->nhd", scores.masked_fill(hidden, float("-inf")).softmax(-1), v)
        torch.testing.assert_close(got[c.start : c.end].float(), expected, atol=2e-2, rtol=2e-2)
