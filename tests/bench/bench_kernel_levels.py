"""Each C kernel at every instruction-set level this CPU runs, A/B in one process: `python -m tests.bench
kernel_levels`. Rounds alternate between the levels (medians of ROUNDS), so the machine's noise falls on all
alike; `ratio` is a level's time over the best level's. The baseline is a -march=native build of the same
sources, built here (what the kernels were before the per-level builds), so the best prebuilt level's cost of
not being tuned for this exact CPU is measured too. Shapes are SmolLM2-135M's (9 heads, 3 KV heads, head_dim
64, hidden 576, intermediate 1536, vocabulary 49152) at a decode step of 32 sequences and a prefill of 512
rows, bfloat16, on one thread (the code each level's compiler made, without the machine's thread scheduling)."""

from __future__ import annotations

import contextlib
import ctypes
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch

from runtime.kernels import layer_ops as native_layer_ops
from runtime.kernels import library as native_kernels
from runtime.kernels import nucleus_sampling as native_sampling
from runtime.kernels import paged_attention as native_attention

ROUNDS = 15


def _cases() -> dict:
    g = torch.Generator().manual_seed(0)
    bf = torch.bfloat16
    seqs, ctx, bs, h, kvh, d = 32, 256, 16, 9, 3, 64
    width = ctx // bs
    k = torch.randn(seqs * width + 40, bs, kvh, d, generator=g).to(bf)
    v = torch.randn_like(k)
    tables = torch.randperm(seqs * width, generator=g).view(seqs, width)
    lens = torch.full((seqs,), ctx, dtype=torch.int64)
    q = torch.randn(seqs, h, d, generator=g)
    rows = 512
    qp = torch.randn(rows, h, d, generator=g).to(bf)
    outp = torch.empty_like(qp)
    ptables = torch.arange(rows // bs).view(1, -1) + seqs * width - rows // bs
    spans = torch.tensor([[0, rows, rows]])
    hid = torch.randn(seqs, 576, generator=g).to(bf)
    delta, weight, out = torch.randn_like(hid), torch.rand(576, generator=g).to(bf), torch.empty_like(hid)
    gate_up = torch.randn(seqs, 2 * 1536, generator=g).to(bf)
    act = torch.empty(seqs, 1536, dtype=bf)
    logits = torch.randn(seqs, 49152, generator=g) * 3
    uniforms = torch.rand(seqs, generator=g, dtype=torch.float64)
    return {
        "decode attention 32 x 256": lambda: native_attention.decode_attention(
            q, k, v, tables, lens, d**-0.5
        ),
        "prefill attention 512": lambda: native_attention.prefill_attention(
            qp, k, v, ptables, spans, d**-0.5, outp
        ),
        "add_rms_norm 32 x 576": lambda: native_layer_ops.add_rms_norm(hid.clone(), delta, weight, out, 1e-5),
        "silu_mul 32 x 1536": lambda: native_layer_ops.silu_mul(gate_up, act),
        "nucleus 32 x 49152": lambda: native_sampling.nucleus_sample(
            logits, [0.8] * seqs, [0.9] * seqs, uniforms
        ),
    }


@contextlib.contextmanager
def _pinned(lib: ctypes.CDLL):
    previous, native_kernels._pinned = native_kernels._pinned, lib
    try:
        yield
    finally:
        native_kernels._pinned = previous


def at_one_thread(fn):
    """fn() with torch (and so the kernels) at one thread, the thread count restored after."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return fn()
    finally:
        torch.set_num_threads(threads)


def run() -> dict:
    return at_one_thread(_run)


def _run() -> dict:
    libs = {level.name: native_kernels.load_level(level.name) for level in native_kernels.cpu_levels()}
    with tempfile.TemporaryDirectory() as tmp:
        native = Path(tmp) / "native.so"
        native_kernels.build_level(
            native_kernels.Level("native", ("-march=native",), frozenset()), native, timeout=600
        )
        libs["native (baseline)"] = native_kernels._open(native)
        cases = _cases()
        times: dict[tuple[str, str], list[float]] = {}
        for _ in range(ROUNDS):
            for name, lib in libs.items():
                with _pinned(lib):
                    for case, fn in cases.items():
                        fn()
                        started = time.perf_counter()
                        fn()
                        times.setdefault((case, name), []).append(time.perf_counter() - started)
    rows = []
    for case in cases:
        best = min(statistics.median(times[(case, n)]) for n in libs)
        for name in libs:
            ms = statistics.median(times[(case, name)]) * 1e3
            rows.append({"kernel": case, "level": name, "ms": ms, "ratio": ms / (best * 1e3)})
    cpu = next(
        (line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), ""
    )
    return {
        "title": f"C kernels per level ({cpu or platform.machine()}, one thread)",
        "rows": rows,
        "notes": [f"medians of {ROUNDS} alternating rounds; ratio: over the fastest of the row's kernel"],
    }
