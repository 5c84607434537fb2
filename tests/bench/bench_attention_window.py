"""Sliding-window attention in the C backend against the PyTorch windowed path it replaces, and the C kernels
without a window against the kernels of another build (`python -m tests.bench attention_window`).

Rows 1-3: Gemma 3 270M's attention shape (4 heads, 1 KV head, head_dim 256), window 512, float32 KV in
blocks of 16 shuffled over the pool: a decode step of 1 and of 32 sequences at context 1024, and a prefill
chunk of 512 rows after a 512-token cached prefix; `ratio` is PyTorch's time over C's. Rows 4-6: SmolLM2's
shape (9 heads, 3 KV heads, head_dim 64), no window, the same steps; the baseline is the library named by
PRESCIENT_BASELINE_KERNELS (a .so built from another tree with the signature before the window and softcap
arguments, e.g. main's native_build/prescient-kernels-<level>.so), both kernels called directly through
ctypes; `ratio` is its time over this tree's. A and B alternate within each round, each first in every
other round; medians of ROUNDS; at one thread, then at the machine's threads."""

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
    for r in range(rounds):  # each goes first in every other round
        for fn, times in ((a, ta), (b, tb)) if r % 2 else ((b, tb), (a, ta)):
            times.append(_time(fn))
    return statistics.median(ta), statistics.median(tb)


def _decode(lib, limits, q, k, v, tables, lens, scale):
    """The f32 decode kernel of `lib` called directly; limits: () for a build before the window and softcap
    arguments, else (window, softcap)."""
    out = torch.empty_like(q)
    b, h, d = q.shape
    ptrs = [t.data_ptr() for t in (q, k, v, tables, lens, out)]
    shape = [b, h, k.shape[2], d, k.shape[1], tables.shape[1]]
    lib.paged_decode_attention_f32(*ptrs, *shape, scale, *limits, torch.get_num_threads())
    return out


def _prefill(lib, limits, q, k, v, tables, spans, scale, out):
    """The f32 prefill kernel of `lib` called directly (limits as _decode's)."""
    ptrs = [t.data_ptr() for t in (q, k, v, tables)]
    rest = [tables.shape[1], spans.data_ptr(), spans.shape[0], out.data_ptr(), 0]
    shape = [q.shape[1], k.shape[2], q.shape[2], k.shape[1]]
    lib.paged_prefill_attention_f32(*ptrs, *rest, *shape, scale, *limits, torch.get_num_threads())


def _run(threads: int) -> tuple[list[dict], list[str]]:
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
        rows.append(
            {
                "case": f"hd256 window 512 {name}",
                "threads": threads,
                "C ms": tc * 1e3,
                "baseline ms": tt * 1e3,
                "baseline": "PyTorch windowed",
                "ratio": tt / tc,
            }
        )
    baseline = os.environ.get("PRESCIENT_BASELINE_KERNELS")
    notes = [f"CPU {cpu}, level {native_kernels.chosen_level()}"]
    if baseline:
        old, new = ctypes.CDLL(baseline), native_kernels.load()
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
                args = (q, k, v, meta.prefill_tables, meta.prefill_spans, scale, torch.empty_like(q))
                new_fn, old_fn = partial(_prefill, new, (0, 0.0), *args), partial(_prefill, old, (), *args)
            else:
                args = (q, k, v, meta.decode_block_tables, meta.decode_context_lens, scale)
                new_fn, old_fn = partial(_decode, new, (0, 0.0), *args), partial(_decode, old, (), *args)
            tc, to = _compare(new_fn, old_fn)
            rows.append(
                {
                    "case": f"hd64 no window {name}",
                    "threads": threads,
                    "C ms": tc * 1e3,
                    "baseline ms": to * 1e3,
                    "baseline": os.path.basename(baseline),
                    "ratio": to / tc,
                }
            )
    else:
        notes.append("no PRESCIENT_BASELINE_KERNELS: the head_dim 64 rows against another build are left out")
    return rows, notes


def run() -> dict:
    """Each row at one thread and at the machine's threads: on a loaded machine torch's thread pool waits
    for its second thread far longer than the work takes, which the one-thread rows leave out."""
    threads = torch.get_num_threads()
    rows = []
    try:
        for n in sorted({1, threads}):
            torch.set_num_threads(n)
            more, notes = _run(n)
            rows += more
    finally:
        torch.set_num_threads(threads)
    return {
        "title": "Sliding-window attention: C vs PyTorch; C vs another build",
        "rows": rows,
        "notes": notes,
    }
