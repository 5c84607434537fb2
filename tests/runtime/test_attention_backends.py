"""The attention backends (C, PyTorch) with a sliding window and a logit soft-cap on a step as the runner
lays it out, from the metadata each builds, against test_attention_window.py's dense reference; the C
backend at every instruction-set level. The Triton backend's kernel runs under Triton's interpreter in
test_triton_window.py."""

from __future__ import annotations

import pytest
import torch

from runtime.attention.c_backend import CBackend
from runtime.attention.metadata import ScheduledRows
from runtime.attention.torch_backend import TorchBackend
from tests.runtime.native_levels import kernel_level  # noqa: F401 (a fixture)
from tests.runtime.test_attention_window import BS, SHAPES, pool, reference, seq  # noqa: F401 (also theirs)

LIMITS = [(40, 5.0)]  # a window and a cap that bites (each alone: test_attention_window.py)


def backend_case(heads, kv_heads, d, dtype, seed):
    """A step as the runner lays it out: four decodes (inside and past the window), then two prefill chunks
    (a whole prompt longer than the window, a chunk after a cached prefix). Returns the pool, the scheduled
    rows, the queries [T, heads, D] and each row's expected output under (window, softcap)."""
    g = torch.Generator().manual_seed(seed)
    decodes, prefills = [1, 9, 40, 77], [(30, 30), (12, 50)]  # decode lengths; (rows, context_len)
    lengths = decodes + [c for _, c in prefills]
    k_cache, v_cache, tables = pool(lengths, kv_heads, d, dtype, g)
    rows = [ScheduledRows(tables[i].tolist(), n - 1, n) for i, n in enumerate(decodes)]
    rows += [ScheduledRows(tables[len(decodes) + i].tolist(), c - n, c) for i, (n, c) in enumerate(prefills)]
    q = torch.randn(sum(r.end - r.start for r in rows), heads, d, generator=g).to(dtype)

    def expected(window, softcap):
        out = []
        for i, r in enumerate(rows):
            keys, values = seq(k_cache, tables[i], r.end), seq(v_cache, tables[i], r.end)
            first = sum(x.end - x.start for x in rows[:i])
            qs = q[first : first + r.end - r.start].float()
            out.append(reference(qs, keys, values, torch.arange(r.start, r.end), d**-0.5, window, softcap))
        return torch.cat(out)

    return k_cache, v_cache, rows, len(decodes), q, expected


def check_backend(attention, heads, kv_heads, d, dtype, window, softcap, bf16_tol):
    """A backend, from the metadata it builds, on backend_case's step; queries and output in the cache's
    dtype, as the model runs them."""
    k_cache, v_cache, rows, b, q, expected = backend_case(heads, kv_heads, d, dtype, seed=d)
    meta = attention.build(rows[:b], rows[b:], None, BS, torch.device("cpu"))
    assert meta.backend is attention
    got = attention.forward(q, None, None, k_cache, v_cache, meta, d**-0.5, window, softcap)
    assert got.dtype == dtype
    tol = 1e-4 if dtype == torch.float32 else bf16_tol
    torch.testing.assert_close(got.float(), expected(window, softcap), atol=tol, rtol=tol)


@pytest.mark.parametrize("window, softcap", LIMITS)
@pytest.mark.parametrize("heads, kv_heads, d", SHAPES[:3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.usefixtures("kernel_level")
def test_c_backend_applies_window_and_softcap_to_a_step(heads, kv_heads, d, dtype, window, softcap):
    check_backend(CBackend(), heads, kv_heads, d, dtype, window, softcap, 2e-2)  # the output rounded


@pytest.mark.parametrize("window, softcap", LIMITS)
@pytest.mark.parametrize("heads, kv_heads, d", SHAPES[:3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_torch_backend_applies_window_and_softcap_to_a_step(heads, kv_heads, d, dtype, window, softcap):
    check_backend(TorchBackend(), heads, kv_heads, d, dtype, window, softcap, 5e-2)  # and its probabilities
