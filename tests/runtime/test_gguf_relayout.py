"""The GGUF blocks laid from the file's bytes into the many-row kernel's tiles (runtime.quant.gguf_raw, csrc/
gguf_relayout.c) equal, byte for byte, the tiles pack_native makes from the parsed blocks (GGUFBlocks, whose
parse equals gguf-py's de-quantization: tests/runtime/test_kquant_kernels.py), at every kernel level this CPU
runs: each kind alone, with a row order (llama's un-permuted q and k), and parts stacked by rows."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from runtime.quant.gguf_blocks import GGUFBlocks
from runtime.quant.gguf_raw import KINDS, GGUFRaw, pack_raw, relayable, tiles_from_raw
from runtime.quant.linear import pack_native
from tests.runtime.native_levels import kernel_level  # noqa: F401 (a fixture)
from tests.runtime.test_kquant_kernels import random_raw

N, K = 64, 512


def parsed_tiles(kind: str, raw: np.ndarray, shape, order=None) -> tuple[torch.Tensor, ...]:
    blocks = GGUFBlocks.parse(kind, raw, shape)
    if order is not None:
        blocks = blocks.take_rows(order)
    return pack_native(blocks, torch.float32).native.tiles


def assert_same(ours: tuple, theirs: tuple) -> None:
    assert len(ours) == len(theirs)
    for a, b in zip(ours, theirs):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(a.view(torch.uint8), b.contiguous().view(torch.uint8))


@pytest.mark.parametrize("kind", list(KINDS))
def test_tiles_from_the_file_equal_the_parsed_blocks(kind, kernel_level):  # noqa: F811
    raw = random_raw(kind, N, K, seed=KINDS[kind])
    whole = GGUFRaw(kind, raw, (N, K))
    if not relayable([whole], torch.float32):  # this level lays this kind out otherwise (parsed, not here)
        assert kind != "Q6_K" and kernel_level == "generic"
        return
    assert_same(tiles_from_raw([whole]).tiles, parsed_tiles(kind, raw, (N, K)))
    order = np.random.default_rng(1).permutation(N)
    assert_same(tiles_from_raw([whole.take_rows(order)]).tiles, parsed_tiles(kind, raw, (N, K), order))
    # two parts stacked by rows, as gate and up: the stacked blocks' tiles
    other = random_raw(kind, 32, K, seed=9)
    stacked = GGUFBlocks.stack([GGUFBlocks.parse(kind, r, (r.shape[0], K)) for r in (raw, other)])
    ours = tiles_from_raw([whole, GGUFRaw(kind, other, (32, K))]).tiles
    assert_same(ours, pack_native(stacked, torch.float32).native.tiles)


def test_float16_edges_and_scales_that_do_not_fit(kernel_level):  # noqa: F811
    """Q5_K's d at float16's edges (subnormals, ties, the top of the range) laid as the parsed blocks lay them;
    a scale past float16's range gives None (the caller parses and de-quantizes instead)."""
    raw = random_raw("Q5_K", N, K, seed=3)
    blocks = raw.reshape(-1, 176)
    edges = np.array([2.0**-24, 3 * 2.0**-25, 2.0**-14 * 0.999, 1.0009765625, 30.0, 1000.0], np.float16)
    blocks[:, 0:2] = np.resize(edges, blocks.shape[0]).view(np.uint8).reshape(-1, 2)
    part = GGUFRaw("Q5_K", raw, (N, K))
    if relayable([part], torch.float32):
        fits = GGUFBlocks.parse("Q5_K", raw, (N, K)).fits_float16()
        made = tiles_from_raw([part])
        assert (made is None) == (not fits)
        blocks[:, 0:2] = np.resize(edges[:5], blocks.shape[0]).view(np.uint8).reshape(-1, 2)
        assert GGUFBlocks.parse("Q5_K", raw, (N, K)).fits_float16()
        assert_same(tiles_from_raw([part]).tiles, parsed_tiles("Q5_K", raw, (N, K)))
    q8 = random_raw("Q8_0", N, K, seed=4)
    q8.reshape(-1, 34)[5, 0:2] = np.array([600.0], np.float16).view(np.uint8)  # -128 d overflows float16
    assert tiles_from_raw([GGUFRaw("Q8_0", q8, (N, K))]) is None or not relayable(
        [GGUFRaw("Q8_0", q8, (N, K))], torch.float32
    )


def test_mixed_kinds_stack_per_kind(kernel_level):  # noqa: F811
    """q and k in Q4_K, v in Q6_K (a Q4_K_M layer): one multiplication per part, the same
    products as the parsed blocks' StackedMatmul."""
    parts = [
        GGUFRaw(k, random_raw(k, 32, K, seed=i), (32, K)) for i, k in enumerate(["Q4_K", "Q4_K", "Q6_K"])
    ]
    if not relayable(parts, torch.float32):
        return
    w = pack_raw(parts, torch.float32)
    from runtime.quant.linear import pack_stacked

    ref = pack_stacked(
        [GGUFBlocks.parse(p.kind, p.data, p.shape) for p in parts], torch.float32, torch.device("cpu")
    )
    x = torch.randn(3, K)
    assert torch.equal(w(x), ref(x))


@pytest.mark.parametrize("kind", list(KINDS))
def test_embedding_rows_from_the_tiles(kind, kernel_level):  # noqa: F811
    """A tied embedding's rows read back from the tiles by the C lookup (quantized_tiles_rows) are torch's
    reading of the same tiles and ggml's de-quantization of the file's blocks, bit for bit: one row (a decode
    step) and many rows from several tiles and columns (a prefill, split over the threads)."""
    raw = random_raw(kind, N, K, seed=20 + KINDS[kind])
    whole = GGUFRaw(kind, raw, (N, K))
    if not relayable([whole], torch.float32):
        assert kind != "Q6_K" and kernel_level == "generic"
        return
    native = tiles_from_raw([whole])
    exact = GGUFBlocks.parse(kind, raw, (N, K)).dequantize()
    for ids in (torch.tensor([37]), torch.tensor([0, 15, 16, 33, 63, 47, 0, 8, 9, 31, 62])):
        rows = native.dequantize_rows(ids)
        assert torch.equal(rows, native._dequantize_tiled_rows_torch(ids))
        assert np.array_equal(rows.numpy(), exact[ids.numpy()])
    with pytest.raises(IndexError):
        native.dequantize_rows(torch.tensor([N]))
