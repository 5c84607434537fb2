"""A GGUF matrix larger than one parse chunk is parsed a chunk of rows at a time from the mapped file
(gguf_checkpoint._parse_released): every field of every block type must come through the chunks, checked
against gguf-py's own de-quantization of the same bytes and against one whole-matrix parse."""

from __future__ import annotations

import gguf
import numpy as np
import pytest

from runtime.model import gguf_checkpoint
from runtime.quant.gguf_blocks import BLOCK_BYTES, BLOCK_ELEMENTS, TYPES, GGUFBlocks

HALF_FIELDS = {"Q8_0": [0], "Q4_0": [0], "Q5_0": [0], "Q4_1": [0, 2], "Q5_1": [0, 2], "Q4_K": [0, 2]}
HALF_FIELDS |= {"Q5_K": [0, 2], "Q6_K": [208]}
"""Byte offsets of each block's float16 fields (d, and m or dmin), set to finite values."""


def random_blocks(kind: str, n: int, k: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    size = BLOCK_BYTES[kind]
    raw = rng.integers(0, 256, (n * k // BLOCK_ELEMENTS[kind], size), dtype=np.uint8)
    for at in HALF_FIELDS[kind]:
        halves = rng.uniform(-0.05, 0.05, raw.shape[0]).astype(np.float16)
        raw[:, at : at + 2] = halves.view(np.uint8).reshape(-1, 2)
    return raw.reshape(n, -1)


@pytest.mark.parametrize("kind", TYPES)
def test_a_matrix_parsed_in_chunks_keeps_every_field(tmp_path, monkeypatch, kind):
    n, k = 96, 512
    raw = random_blocks(kind, n, k, seed=len(kind) + BLOCK_BYTES[kind])
    path = tmp_path / "blocks.bin"
    raw.tofile(path)
    mapped = np.memmap(path, dtype=np.uint8, mode="r", shape=raw.shape)
    monkeypatch.setattr(gguf_checkpoint, "PARSE_CHUNK_BYTES", 7 * raw.shape[1])  # 14 chunks, the last short
    chunked = gguf_checkpoint._parse_released(kind, mapped, (n, k))
    whole = GGUFBlocks.parse(kind, raw, (n, k))
    for field in ("codes", "scale", "minimum", "super_scale"):
        a, b = getattr(chunked, field), getattr(whole, field)
        assert (a is None) == (b is None), f"{kind}: {field} lost in the chunked parse"
        if a is not None:
            np.testing.assert_array_equal(a, b, err_msg=f"{kind}: {field}")
    reference = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[kind]).reshape(n, k)
    np.testing.assert_array_equal(chunked.dequantize(), reference)
    if kind == "Q6_K":
        codes, sc, d = chunked.q6_k_fields()
        step = d.astype(np.float32).repeat(16, axis=1) * sc.astype(np.float32)
        np.testing.assert_array_equal(step, chunked.scale)
