"""Tiling spent 8-bit codes in their own memory (NativeMatmul consume=True, the tied LM head's load path)
gives the same tiles, scales and products as tiling into a new array."""

import numpy as np
import torch

from runtime.kernels import quantized_matmul as qm
from runtime.kernels.library import load


def test_tiles_made_in_place_equal_tiles_made_in_a_copy():
    rng = np.random.default_rng(0)
    n, k = 192, 1 << 16  # tiled 4 MB at a time: three parts of 64 rows
    codes = rng.integers(0, 256, (n, k), dtype=np.uint8)
    scale = rng.uniform(0.01, 0.1, (n, k // 32)).astype(np.float16)
    offset = (-128 * scale).astype(np.float16)
    copied = qm.NativeMatmul(codes.copy(), scale, offset, 8, one_row=False)
    spent = codes.copy()
    in_place = qm.NativeMatmul(spent, scale, offset, 8, one_row=False, consume=True)
    assert (copied.tiles is None) == (in_place.tiles is None)
    assert copied.tiles is not None or not load().quantized_matmul_vectorized()
    if copied.tiles is not None:
        assert in_place.tiles[0].data_ptr() == torch.from_numpy(spent).data_ptr()  # no second copy
        for a, b in zip(copied.tiles, in_place.tiles):
            assert torch.equal(a, b)
        x = torch.randn(3, k)
        assert torch.equal(copied(x), in_place(x))
        ids = torch.tensor([0, 17, 95])
        assert torch.equal(copied.dequantize_rows(ids), in_place.dequantize_rows(ids))
