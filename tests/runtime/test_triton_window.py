"""The Triton backend with a sliding window and a logit soft-cap, on CPU under Triton's interpreter
(TRITON_INTERPRET=1, set before Triton is imported, hence the subprocess): a step of decodes and prefill
chunks from the metadata it builds, against test_attention_window.py's dense reference, head_dim 64, 128
and 256 with GQA; windows that skip whole splits of a long context."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("triton", reason="needs Triton (the test extra installs it)")

SHAPES = [(4, 2, 64), (4, 1, 128), (8, 1, 256)]  # (heads, kv_heads, head_dim)


def check_triton_backend(device: str, dtype, cases, long_softcap=None, relative: bool = False) -> None:
    """The Triton backend on `device`, from the metadata it builds: for each ((heads, kv_heads, d), (window,
    softcap)) of `cases`, test_attention_backends' step (decodes inside and past the window, two prefill
    chunks) against the dense reference; then one sequence of 700 positions (three splits of 256) with a
    window of 100 and `long_softcap`, whose first two splits the kernel and the merge skip. Every output
    within 1e-4 (float32) or 2e-2 (else) of the reference; `relative`: plus that share of its size."""
    import torch

    from runtime.attention.metadata import ScheduledRows
    from runtime.attention.triton_backend import TritonBackend
    from tests.runtime import test_attention_window as dense
    from tests.runtime.test_attention_backends import backend_case

    attention, dev = TritonBackend(), torch.device(device)
    atol = 1e-4 if dtype == torch.float32 else 2e-2
    rtol = atol if relative else 0.0

    def check(got, want, what):
        assert got.dtype == dtype
        diff = (got.float().cpu() - want).abs()
        assert (diff < atol + rtol * want.abs()).all(), (what, diff.max().item())

    for (heads, kv_heads, d), (window, softcap) in cases:
        k_cache, v_cache, rows, b, q, expected = backend_case(heads, kv_heads, d, dtype, seed=d)
        meta = attention.build(rows[:b], rows[b:], None, dense.BS, dev)
        k, v = k_cache.to(dev), v_cache.to(dev)
        got = attention.forward(q.to(dev), None, None, k, v, meta, d**-0.5, window, softcap)
        check(got, expected(window, softcap), (d, window, softcap))
    g = torch.Generator().manual_seed(3)
    k_cache, v_cache, tables = dense.pool([700], 2, 64, dtype, g)
    q = torch.randn(1, 4, 64, generator=g).to(dtype)
    meta = attention.build([ScheduledRows(tables[0].tolist(), 699, 700)], [], None, dense.BS, dev)
    k, v = k_cache.to(dev), v_cache.to(dev)
    got = attention.forward(q.to(dev), None, None, k, v, meta, 0.125, 100, long_softcap)
    keys, values = dense.seq(k_cache, tables[0], 700), dense.seq(v_cache, tables[0], 700)
    want = dense.reference(q.float(), keys, values, torch.tensor([699]), 0.125, 100, long_softcap)
    check(got, want, (700, 100, long_softcap))


SCRIPT = textwrap.dedent("""
    import torch
    from tests.runtime.test_triton_window import SHAPES, check_triton_backend
    check_triton_backend("cpu", torch.float32, zip(SHAPES, [(13, None), (None, 5.0), (40, 5.0)]))
    print("OK")
""")


@pytest.mark.slow  # Triton's interpreter in a process of its own
def test_triton_backend_applies_window_and_softcap_in_the_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1")
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0 and done.stdout.strip().endswith("OK"), done.stderr[-3000:]
