"""GGUF blocks de-quantized to float32 straight from the file's bytes (runtime.quant.gguf_raw.dequantize_raw,
csrc/gguf_dequantize.c, the dense load paths) equal gguf-py's de-quantization bit for bit, for every block
kind, at every kernel level this CPU runs: whole matrices, a row order (llama's un-permuted q and k) and parts
stacked by rows; and a model loaded with --dtype float32 from the file holds the same weights as one whose
blocks were parsed in numpy."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf import quants

from runtime.quant.gguf_blocks import BLOCK_BYTES, GGUFBlocks
from runtime.quant.gguf_raw import GGUFRaw, dequantize_raw
from tests.runtime.native_levels import kernel_level  # noqa: F401 (a fixture)
from tests.runtime.test_kquant_kernels import random_raw

N, K = 48, 768


def reference(kind: str, raw: np.ndarray) -> np.ndarray:
    n = raw.shape[0]
    return quants.dequantize(raw, gguf.GGMLQuantizationType[kind]).reshape(n, -1).astype(np.float32)


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return (
        a.dtype == b.dtype == np.float32
        and a.shape == b.shape
        and np.array_equal(a.view(np.uint32), b.view(np.uint32))
    )


@pytest.mark.parametrize("kind", list(BLOCK_BYTES))
def test_float32_from_the_file_equals_gguf_py(kind, kernel_level):  # noqa: F811
    raw = random_raw(kind, N, K, seed=len(kind) + BLOCK_BYTES[kind])
    ours = dequantize_raw([GGUFRaw(kind, raw, (N, K))])
    assert same_bits(ours, reference(kind, raw))
    order = np.random.default_rng(2).permutation(N)
    ours = dequantize_raw([GGUFRaw(kind, raw, (N, K)).take_rows(order)])
    assert same_bits(ours, reference(kind, raw)[order])
    other = random_raw(kind, 16, K, seed=7)
    ours = dequantize_raw([GGUFRaw(kind, raw, (N, K)), GGUFRaw(kind, other, (16, K))])
    assert same_bits(ours, np.concatenate([reference(kind, raw), reference(kind, other)]))


def test_mixed_kinds_and_a_width_without_a_path(kernel_level):  # noqa: F811
    """q in Q4_K, v in Q6_K (a K-quant mix) stack by rows; a K-quant row narrower than a super-block has no
    path here (None: the caller parses instead)."""
    a, b = random_raw("Q4_K", 16, 512, seed=1), random_raw("Q6_K", 32, 512, seed=2)
    ours = dequantize_raw([GGUFRaw("Q4_K", a, (16, 512)), GGUFRaw("Q6_K", b, (32, 512))])
    assert same_bits(ours, np.concatenate([reference("Q4_K", a), reference("Q6_K", b)]))
    assert same_bits(ours[:16], GGUFBlocks.parse("Q4_K", a, (16, 512)).dequantize())
    narrow = random_raw("Q4_0", 4, 96, seed=3)
    assert dequantize_raw([GGUFRaw("Q4_K", np.zeros((4, 144), np.uint8), (4, 128))]) is None
    assert same_bits(dequantize_raw([GGUFRaw("Q4_0", narrow, (4, 96))]), reference("Q4_0", narrow))


@pytest.mark.slow  # loads the real model twice
def test_float32_model_from_the_file_equals_the_parsed_one(monkeypatch):
    from pathlib import Path

    from runtime.model import model as model_module
    from runtime.model.checkpoint import default_model_path
    from runtime.model.gguf_checkpoint import read_gguf

    def build():
        ckpt = read_gguf(Path(default_model_path()), "model", with_tokenizer=False)
        return model_module.LlamaModel(ckpt.config, ckpt.weights, torch.float32, torch.device("cpu"), "none")

    ours = build()
    monkeypatch.setattr(model_module, "dequantize_raw", lambda parts: None)  # every matrix parsed in numpy
    parsed = build()
    for a, b in [(ours.embed, parsed.embed), (ours.lm_head, parsed.lm_head)] + [
        (getattr(x, name), getattr(y, name))
        for x, y in zip(ours.layers, parsed.layers)
        for name in ("qkv", "o", "gate_up", "down")
    ]:
        assert torch.equal(a, b)
