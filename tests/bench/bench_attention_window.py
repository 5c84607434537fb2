"""Sliding-window attention in the C backend against the PyTorch windowed path it replaces, and the C kernels
without a window against the kernels of another build (`python -m tests.bench attention_window`).

Rows 1-3: Gemma 3 270M's attention shape (4 heads, 1 KV head, head_dim 256), window 512, float32 KV in
blocks of 16 shuffled over the pool: a decode step of 1 and of 32 sequences at context 1024, and a prefill
chunk of 512 rows after a 512-token cached prefix; `ratio` is PyTorch's time over C's. Rows 4-6: SmolLM2's
shape (9 heads, 3 KV heads, head_dim 64), no window, the same steps; the baseline is the library named by
PRESCIENT_BASELINE_KERNELS (a .so built from another tree with the signature before the window and softcap
arguments, e.g. main's native_build/prescient-kernels-<level>.so), `ratio` its time over this tree's. A
and B alternate within each round; medians of ROUNDS; the machine's threads (torch.get_num_threads())."""

from __future__ import annotations

import ctypes
import os
import platform
import statistics
import time
from functools import partial

import torch

from runtime.attention.c_backend import CBackend
from runtime.attention.metadata import ScheduledRows
from runtime.attention.torch_backend import TorchBackend
from runtime.kernels import library as native_kernels

ROUNDS = 11
BS = 16
CONTEXT = 1024
PREFILL = 512


def _step(heads, kv_heads, d, decodes, prefill, g):
    """A pool holding `decodes` sequences of CONTEXT tokens (or one prefill chunk of `prefill` rows ending at
    CONTEXT), their rows and queries."""
    seqs = max(decodes, 1)
    width = CONTEXT // BS
    k = torch.randn(seqs * width, BS, kv_heads, d, generator=g)
    v = torch.randn_like(k)
    tables = torch.randperm(seqs * width, generator=g).view(seqs, width).tolist()
    if prefill:
        rows, done = [ScheduledRows(tables[0], CONTEXT - prefill, CONTEXT)], 0
    else:
        rows, done = [ScheduledRows(t, CONTEXT - 1, CONTEXT) for t in tables], decodes
    q = torch.randn(sum(r.end - r.start for r in rows), heads, d, generator=g)
    return k, v, rows, done, q


def _time(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _compare(a, b, rounds=ROUNDS) -> tuple[float, float]:
    a(), b()  # warm
    ta, tb = [], []
    for _ in range(rounds):
        ta.append(_time(a))
        tb.append(_time(b))
    return statistics.median(ta), statistics.median(tb)


def _old_decode(lib, q, k, v, tables, lens, scale):
    out = torch.empty_like(q)
    b, h, d = q.shape
    lib.paged_decode_attention_f32(
        q.data_ptr(), k.data_ptr(), v.data_ptr(), tables.data_ptr(), lens.data_ptr(), out.data_ptr(),
        b, h, k.shape[2], d, k.shape[1], tables.shape[1], scale, torch.get_num_threads(),
    )  # fmt: skip
    return out


def _old_prefill(lib, q, k, v, tables, spans, scale, out):
    h, d = q.shape[1], q.shape[2]
    lib.paged_prefill_attention_f32(
        q.data_ptr(), k.data_ptr(), v.data_ptr(), tables.data_ptr(), tables.shape[1], spans.data_ptr(),
        spans.shape[0], out.data_ptr(), 0, h, k.shape[2], d, k.shape[1], scale,
        torch.get_num_threads(),
    )  # fmt: skip


def run() -> dict:
    g = torch.Generator().manual_seed(0)
    c, pt = CBackend(), TorchBackend()
    cpu = platform.processor() or platform.machine()
    rows = []
    cases = [
        ("decode x1", 1, 0),
        ("decode x32", 32, 0),
        (f"prefill {PREFILL} after {CONTEXT - PREFILL}", 0, PREFILL),
    ]
    for name, decodes, prefill in cases:
        k, v, sched, done, q = _step(4, 1, 256, decodes, prefill, g)
        mc = c.build(sched[:done], sched[done:], None, BS, torch.device("cpu"))
        mt = pt.build(sched[:done], sched[done:], None, BS, torch.device("cpu"))
        scale = 256**-0.5
        tc, tt = _compare(
            partial(c.forward, q, None, None, k, v, mc, scale, 512, None),
            partial(pt.forward, q, None, None, k, v, mt, scale, 512, None),
        )
        rows.append({"case": f"hd256 window 512 {name}", "C ms": tc * 1e3, "baseline ms": tt * 1e3,
                     "baseline": "PyTorch windowed", "ratio": tt / tc})  # fmt: skip
    baseline = os.environ.get("PRESCIENT_BASELINE_KERNELS")
    notes = [f"CPU {cpu}, {torch.get_num_threads()} threads, level {native_kernels.chosen_level()}"]
    if baseline:
        old = ctypes.CDLL(baseline)
        i64, ptr, f32, i32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float, ctypes.c_int
        old.paged_decode_attention_f32.argtypes = [ptr] * 6 + [i64] * 6 + [f32, i32]
        old.paged_prefill_attention_f32.argtypes = (
            [ptr] * 4 + [i64, ptr, i64, ptr, i32] + [i64] * 4 + [f32, i32]
        )
        for name, decodes, prefill in cases:
            k, v, sched, done, q = _step(9, 3, 64, decodes, prefill, g)
            meta = c.build(sched[:done], sched[done:], None, BS, torch.device("cpu"))
            scale = 64**-0.5
            if prefill:
                out = torch.empty_like(q)
                args = (q, k, v, meta.prefill_tables, meta.prefill_spans, scale, out)
                old_fn = partial(_old_prefill, old, *args)
            else:
                args = (q, k, v, meta.decode_block_tables, meta.decode_context_lens, scale)
                old_fn = partial(_old_decode, old, *args)
            tc, to = _compare(partial(c.forward, q, None, None, k, v, meta, scale), old_fn)
            rows.append({"case": f"hd64 no window {name}", "C ms": tc * 1e3, "baseline ms": to * 1e3,
                         "baseline": os.path.basename(baseline), "ratio": to / tc})  # fmt: skip
    else:
        notes.append("no PRESCIENT_BASELINE_KERNELS: the head_dim 64 rows against another build are left out")
    return {
        "title": "Sliding-window attention: C vs PyTorch; C vs another build",
        "rows": rows,
        "notes": notes,
    }
