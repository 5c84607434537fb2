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

SCRIPT = textwrap.dedent("""
    import torch
    from runtime.attention.metadata import ScheduledRows
    from runtime.attention.triton_backend import TritonBackend
    from tests.runtime.test_attention_backends import backend_case
    from tests.runtime import test_attention_backends as cases
    attention = TritonBackend()
    for (heads, kv_heads, d), (window, softcap) in [
        ((4, 2, 64), (13, None)),
        ((4, 1, 128), (None, 5.0)),
        ((8, 1, 256), (40, 5.0)),
    ]:
        k_cache, v_cache, rows, b, q, expected = backend_case(heads, kv_heads, d, torch.float32, seed=d)
        meta = attention.build(rows[:b], rows[b:], None, cases.BS, torch.device("cpu"))
        got = attention.forward(q, None, None, k_cache, v_cache, meta, d**-0.5, window, softcap)
        want = expected(window, softcap)
        assert (got - want).abs().max() < 1e-4, (d, window, softcap, (got - want).abs().max().item())
    # one sequence of 700 positions (three splits of 256) with a window of 100: the first two splits are
    # skipped by the kernel and by the merge
    g = torch.Generator().manual_seed(3)
    k_cache, v_cache, tables = cases.pool([700], 2, 64, torch.float32, g)
    q = torch.randn(1, 4, 64, generator=g)
    row = ScheduledRows(tables[0].tolist(), 699, 700)
    meta = attention.build([row], [], None, cases.BS, torch.device("cpu"))
    got = attention.forward(q, None, None, k_cache, v_cache, meta, 0.125, 100, None)
    keys, values = cases.seq(k_cache, tables[0], 700), cases.seq(v_cache, tables[0], 700)
    want = cases.reference(q, keys, values, torch.tensor([699]), 0.125, 100, None)
    assert (got - want).abs().max() < 1e-4, (got - want).abs().max().item()
    print("OK")
""")


@pytest.mark.slow  # Triton's interpreter in a process of its own
def test_triton_backend_applies_window_and_softcap_in_the_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1")
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0 and done.stdout.strip().endswith("OK"), done.stderr[-3000:]
