"""Decode attention on CUDA in one fused Triton kernel, read from the paged KV pool in place.

PyTorch's decode path (attention.py) gathers every sequence's blocks into a
padded contiguous copy, then runs two batched matmuls and a softmax: five
launches and the whole padded context copied once per layer. Here one program
per (sequence, KV head) walks that sequence's block table a tile of tokens at a
time, scores the tile against all query heads sharing the KV head (GQA), and
keeps a running max and sum (online softmax), so K and V are read once, from
where they lie, and only the output is written. The loop runs to the
sequence's own length, read from device memory: a launch has the same shape
whatever the lengths, so a decode step with it can be captured in a CUDA graph
and replayed (cuda_graphs.py).

Triton comes with PyTorch's CUDA builds; without it (the CPU wheel), usable()
is False and attention.py keeps the PyTorch path. The kernel also runs on CPU
tensors under Triton's interpreter (TRITON_INTERPRET=1, float32), which is how
the tests check it where there is no GPU.
"""

from __future__ import annotations

import os

import torch


def _load_triton():
    """Triton only where its kernels can run: with CUDA, or under its CPU interpreter (TRITON_INTERPRET=1,
    the tests). A CPU-only server never imports it (loading it costs start-up time, and its bindings print
    leak warnings at exit)."""
    if not (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"):
        return None, None
    try:
        import triton
        import triton.language as tl
    except ImportError:  # the CPU wheel of torch does not bring Triton
        return None, None
    return triton, tl


triton, tl = _load_triton()


def usable(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    heads, kv_heads, d = q.shape[1], k_cache.shape[2], k_cache.shape[3]
    return (
        triton is not None
        and q.device.type == "cuda"
        and k_cache.dtype in (torch.float32, torch.bfloat16, torch.float16)
        and d & (d - 1) == 0  # tl.arange takes powers of two
        and 16 <= d <= 256
        and heads % kv_heads == 0
    )


SPLIT = 256
"""Tokens of one sequence a program attends to: longer contexts are split across programs (flash-decoding),
so one long sequence still spreads over the GPU; a second kernel merges the splits."""
TILE = 128
"""Tokens a program scores per loop iteration (32 for head dims over 128). Split 256 / tile 128 / 4 warps is
the best all-round combination of split 128-512, tile 32-128 and 2-8 warps timed on an H100
(`python -m tests.bench cuda`'s attention row)."""
WARPS = 4


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    table_rows: torch.Tensor | None = None,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """q [B, heads, D]; caches [blocks, block_size, kv_heads, D]; block_tables [B, >= ceil(len / block_size)]
    (integer); context_lens [B] (>= 1). Returns [B, heads, D] in q's dtype (or writes `out`); float32 math.
    table_rows [B]: query i reads block_tables[table_rows[i]] (the rows of a prefill chunk share their
    sequence's table, each with its own causal length); None: row i. window: a row of length L sees its
    positions > L - 1 - window only; softcap: scores s become softcap * tanh(s / softcap) (None: neither).

    The number of splits follows the tables' width (every length fits in it), not the lengths themselves,
    so a launch does not depend on the lengths: splits past a sequence's end return at once."""
    b, heads, d = q.shape
    block_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = heads // kv_heads
    if out is None:
        out = torch.empty_like(q)
    if b == 0:
        return out
    assert k_cache.stride() == v_cache.stride() and k_cache.stride(3) == 1 and q.stride(2) == 1
    splits = triton.cdiv(block_tables.shape[1] * block_size, SPLIT)
    tile = TILE if d <= 128 else min(TILE, 32)
    m = torch.empty(b, heads, splits, dtype=torch.float32, device=q.device)
    total = torch.empty_like(m)
    acc = torch.empty(b, heads, splits, d, dtype=torch.float32, device=q.device)
    _decode_split[(b, kv_heads, splits)](
        q,
        k_cache,
        v_cache,
        block_tables,
        context_lens,
        context_lens if table_rows is None else table_rows,
        m,
        total,
        acc,
        scale,
        window or 0,
        softcap or 1.0,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        block_tables.stride(0),
        splits,
        GROUP=group,
        GROUP_P=max(triton.next_power_of_2(group), 16),  # tl.dot's smallest M
        D=d,
        BLOCK=block_size,
        TILE=tile,
        SPLIT=SPLIT,
        IEEE=q.dtype == torch.float32,
        HAS_ROWS=table_rows is not None,
        SOFTCAP=softcap is not None,
        num_warps=WARPS,
    )
    _merge_splits[(b, heads)](
        m,
        total,
        acc,
        context_lens,
        window or 0,
        out,
        out.stride(0),
        out.stride(1),
        heads,
        splits,
        S_P=triton.next_power_of_2(splits),
        D=d,
        SPLIT=SPLIT,
        num_warps=4,
    )
    return out


if triton is not None:

    @triton.jit
    def _decode_split(
        q_ptr,
        k_ptr,
        v_ptr,
        tables_ptr,
        lens_ptr,
        rows_ptr,
        m_ptr,
        total_ptr,
        acc_ptr,
        scale,
        window,
        softcap,
        stride_qb,
        stride_qh,
        stride_kb,
        stride_ks,
        stride_kh,
        stride_tb,
        splits,
        GROUP: tl.constexpr,
        GROUP_P: tl.constexpr,
        D: tl.constexpr,
        BLOCK: tl.constexpr,
        TILE: tl.constexpr,
        SPLIT: tl.constexpr,
        IEEE: tl.constexpr,
        HAS_ROWS: tl.constexpr,
        SOFTCAP: tl.constexpr,
    ):
        """One split of one sequence for the query heads of one KV head: running max, sum of exponentials and
        weighted values of its positions."""
        seq = tl.program_id(0)
        kv_head = tl.program_id(1)
        split = tl.program_id(2)
        length = tl.load(lens_ptr + seq)
        # the first position its window sees (tl.where: a Python conditional on a loaded value does not
        # compile for a GPU, though the interpreter takes it)
        lo = tl.where(window > 0, tl.maximum(length - window, 0), 0)
        first = split * SPLIT
        if first < length and first + SPLIT > lo:
            g = tl.arange(0, GROUP_P)
            d = tl.arange(0, D)
            t = tl.arange(0, TILE)
            heads = kv_head * GROUP + g
            real = g < GROUP  # GROUP_P pads the group up to what tl.dot takes
            q_rows = q_ptr + seq * stride_qb + heads[:, None] * stride_qh + d[None, :]
            q = tl.load(q_rows, mask=real[:, None], other=0.0)
            if HAS_ROWS:
                table = tables_ptr + tl.load(rows_ptr + seq).to(tl.int64) * stride_tb
            else:
                table = tables_ptr + seq.to(tl.int64) * stride_tb
            m = tl.full([GROUP_P], float("-inf"), tl.float32)
            total = tl.zeros([GROUP_P], tl.float32)
            acc = tl.zeros([GROUP_P, D], tl.float32)
            last = tl.minimum(first + SPLIT, length)
            for start in range(tl.maximum(first, lo), last, TILE):
                pos = start + t
                valid = pos < last
                block = tl.load(table + pos // BLOCK, mask=valid, other=0).to(tl.int64)
                rows = block * stride_kb + (pos % BLOCK) * stride_ks + kv_head * stride_kh
                k = tl.load(k_ptr + rows[:, None] + d[None, :], mask=valid[:, None], other=0.0)
                v = tl.load(v_ptr + rows[:, None] + d[None, :], mask=valid[:, None], other=0.0)
                if IEEE:
                    scores = tl.dot(q, tl.trans(k), input_precision="ieee")
                else:
                    scores = tl.dot(q, tl.trans(k))
                scores = scores * scale
                if SOFTCAP:  # softcap * tanh(scores / softcap), tanh|y| = (1 - e) / (1 + e), e = exp(-2|y|)
                    y = scores / softcap
                    e = tl.exp(-2.0 * tl.abs(y))
                    t_abs = (1.0 - e) / (1.0 + e)
                    scores = tl.where(y < 0, -t_abs, t_abs) * softcap
                scores = tl.where(valid[None, :], scores, float("-inf"))  # [GROUP_P, TILE]
                m_new = tl.maximum(m, tl.max(scores, axis=1))
                p = tl.exp(scores - m_new[:, None])
                alpha = tl.exp(m - m_new)
                total = total * alpha + tl.sum(p, axis=1)
                if IEEE:
                    acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
                else:
                    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
                m = m_new
            row = (seq * GROUP * tl.num_programs(1) + heads) * splits + split
            tl.store(m_ptr + row, m, mask=real)
            tl.store(total_ptr + row, total, mask=real)
            tl.store(acc_ptr + row[:, None] * D + d[None, :], acc, mask=real[:, None])

    @triton.jit
    def _merge_splits(
        m_ptr,
        total_ptr,
        acc_ptr,
        lens_ptr,
        window,
        out_ptr,
        stride_ob,
        stride_oh,
        heads,
        splits,
        S_P: tl.constexpr,
        D: tl.constexpr,
        SPLIT: tl.constexpr,
    ):
        """One query head of one sequence: its splits' partial softmaxes rescaled to a common max, summed."""
        seq = tl.program_id(0)
        head = tl.program_id(1)
        length = tl.load(lens_ptr + seq)
        used = tl.cdiv(length, SPLIT)
        skipped = tl.where(window > 0, tl.maximum(length - window, 0) // SPLIT, 0)  # splits before the window
        s = tl.arange(0, S_P)
        d = tl.arange(0, D)
        valid = (s < used) & (s >= skipped)
        row = (seq * heads + head) * splits + s
        m = tl.load(m_ptr + row, mask=valid, other=float("-inf"))
        weight = tl.where(valid, tl.exp(m - tl.max(m, axis=0)), 0.0)
        total = tl.sum(tl.load(total_ptr + row, mask=valid, other=0.0) * weight, axis=0)
        acc = tl.load(acc_ptr + row[:, None] * D + d[None, :], mask=valid[:, None], other=0.0)
        out = tl.sum(acc * weight[:, None], axis=0) / total
        tl.store(out_ptr + seq * stride_ob + head * stride_oh + d, out.to(out_ptr.dtype.element_ty))
