"""The GGUF blocks laid from the file's bytes into the many-row kernel's tiles (runtime.quant.gguf_raw, csrc/
gguf_relayout.c) equal, byte for byte, the tiles pack_native makes from the parsed blocks (GGUFBlocks, whose
parse equals gguf-py's de-quantization: tests/runtime/test_kquant_kernels.py), at every kernel level this CPU
runs: each kind alone, with a row order (llama's un-permuted q and k), and parts stacked by rows."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from runtime.kernels import quantized_matmul as qm
from runtime.kernels.quantized_matmul import NativeMatmul
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


def nibble_codes(tiles: torch.Tensor, tile: torch.Tensor, column: torch.Tensor, fifth: bool) -> torch.Tensor:
    """The 4-bit tiles' codes of the columns [rows, blocks, 32] int32: vector v's low nibbles inputs 8v..8v+3
    of the block, its high nibbles 8v+4..8v+7; `fifth`: with the plane after them (its byte i's bit t: the
    fifth bit of input 4t + i)."""
    raw = tiles[tile, :, :4, column, :]
    codes = torch.stack([raw & 0x0F, raw >> 4], dim=-2).reshape(tile.shape[0], -1, qm.GROUP).to(torch.int32)
    if fifth:
        plane = tiles[tile, :, 4, column, :].to(torch.int32)  # [rows, blocks, i]
        t = torch.arange(8, dtype=torch.int32)[:, None]
        codes = codes | ((((plane[:, :, None, :] >> t) & 1).reshape(tile.shape[0], -1, qm.GROUP)) << 4)
    return codes


def torch_tile_rows(native: NativeMatmul, ids: torch.Tensor) -> torch.Tensor:
    """Rows `ids` of a weight held in tiles, read from the tile layout by torch ops: the C lookup's oracle."""
    tiles, scale, offset = native.tiles
    tile, column = ids // qm.TILE_COLUMNS, ids % qm.TILE_COLUMNS
    if native.bits in (qm.KQ4_BITS, qm.KQ5_BITS):  # w = (d sc) code - (dmin m), each product in float32
        codes = nibble_codes(tiles, tile, column, native.bits == qm.KQ5_BITS).float()
        scm = scale[tile, :, :, column].float()  # [rows, blocks, sc | m]
        dd = offset[tile, :, :, column].float().repeat_interleave(256 // qm.GROUP, dim=1)  # [rows, blocks, 2]
        step, low = dd[..., 0] * scm[..., 0], dd[..., 1] * scm[..., 1]
        return (codes * step.unsqueeze(-1) - low.unsqueeze(-1)).view(ids.shape[0], native.in_features)
    if native.bits == 6:  # q6_k's tiles: w = (d * sc) * (code - 32), d * sc formed in float32 as ggml does
        raw = tiles.view(*tiles.shape[:3], qm.TILE_COLUMNS, 4)[tile, :, :, column, :].to(torch.int32)
        abc = raw.view(ids.shape[0], -1, 2, 3, 4)  # [rows, blocks, sub-block, A B C, 4]
        top = abc >> 6
        last = top[:, :, :, 0] | (top[:, :, :, 1] << 2) | (top[:, :, :, 2] << 4)
        q = torch.cat([abc & 0x3F, last.unsqueeze(3)], dim=3).view(ids.shape[0], -1, 16) - 32
        d = scale[tile, :, column].float().repeat_interleave(16, dim=1)  # [rows, sub-blocks]
        step = d * offset[tile, :, column, :].reshape(ids.shape[0], -1).float()
        return (step.unsqueeze(-1) * q.float()).view(ids.shape[0], native.in_features)
    if native.bits in (4, qm.FIVE_BITS):
        codes = nibble_codes(tiles, tile, column, native.bits == qm.FIVE_BITS).float()
    else:  # 8-bit: vector v holds inputs 4v..4v+3 of the block
        codes = tiles[tile, :, :, column, :].reshape(ids.shape[0], -1, qm.GROUP).float()
    s = scale[tile, :, column].float()  # [rows, blocks]
    o = offset[tile, :, column].float() if offset.numel() else s * qm.SYMMETRIC_OFFSET[native.bits]
    return (codes * s.unsqueeze(-1) + o.unsqueeze(-1)).view(ids.shape[0], native.in_features)


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


@pytest.mark.parametrize("kinds", [("Q4_K", "Q4_K", "Q6_K"), ("Q5_0", "Q5_0", "Q8_0")])
def test_mixed_kinds_stack_per_kind(kinds, kernel_level):  # noqa: F811
    """q and k in Q4_K, v in Q6_K (a Q4_K_M layer), or q and k in Q5_0, v in Q8_0 (Gemma 3 270M's): one
    multiplication per run of one kind (q and k together), the same products as the parsed blocks'
    StackedMatmul of one per part."""
    parts = [GGUFRaw(k, random_raw(k, 32, K, seed=i), (32, K)) for i, k in enumerate(kinds)]
    if not relayable(parts, torch.float32):
        assert kernel_level == "generic"
        return
    w = pack_raw(parts, torch.float32)
    assert [p.out_features for p in w.native.parts] == [64, 32]
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
    for ids in (
        torch.tensor([37]),
        torch.tensor([0, 15, 16, 33, 63, 47, 0, 8, 9, 31, 62] * 2),
    ):  # 22 x K: over the threads
        rows = native.dequantize_rows(ids)
        assert torch.equal(rows, torch_tile_rows(native, ids))
        assert np.array_equal(rows.numpy(), exact[ids.numpy()])
    with pytest.raises(IndexError):
        native.dequantize_rows(torch.tensor([N]))
