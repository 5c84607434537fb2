"""Q4_K and Q5_K in tiles of their own with their super-block scales (NativeMatmul.q4_k and q5_k, bits KQ4 and
KQ5 in csrc/quantized_matmul.c): 4.625 and 5.625 bits a weight instead of the 5 and 9 of a float16 scale and
offset per block, and exact (d sc and dmin m formed in float32, as ggml de-quantizes). Weights: real Q4_K and
Q5_K bytes from llama.cpp's quantize_q4_K / quantize_q5_K; oracles: gguf-py's de-quantization, and the vector
loops against the portable ones, bit for bit, at every level this CPU runs."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf import quants

from runtime.kernels.quantized_matmul import KQ4_BITS, KQ5_BITS, NativeMatmul, q4_k_tiles
from runtime.quant.gguf_blocks import GGUFBlocks
from runtime.quant.linear import BlockEmbedding, pack_native
from tests.runtime.native_levels import kernel_level  # noqa: F401 (a fixture)
from tests.runtime.test_kquant_kernels import ggml, kernel_bound, llama_quantize  # noqa: F401 (ggml: a fixture)

N, K = 96, 1024
KINDS = {"Q4_K": (NativeMatmul.q4_k, KQ4_BITS, 16), "Q5_K": (NativeMatmul.q5_k, KQ5_BITS, 32)}


@pytest.fixture(scope="module", params=list(KINDS))
def real_blocks(ggml, request):  # noqa: F811
    kind = request.param
    w = np.random.default_rng(5).standard_normal((N, K)).astype(np.float32) * 0.05
    raw = llama_quantize(ggml, kind, w)
    exact = quants.dequantize(raw, getattr(gguf.GGMLQuantizationType, kind)).reshape(N, K)
    return GGUFBlocks.parse(kind, raw, (N, K)), exact


def test_fields_are_the_files_and_rebuild_its_weights(real_blocks):
    blocks, exact = real_blocks
    codes, sc, m, d, dmin = blocks.q4_k_fields()
    assert sc.max() < 64 and m.max() < 64  # 6-bit, as the file packs them
    levels = KINDS[blocks.kind][2]
    assert codes.max() < levels and codes.max() >= levels // 2  # the fifth bit is used where there is one
    step = np.repeat(d.astype(np.float32), 8, axis=1) * sc.astype(np.float32)
    low = np.repeat(dmin.astype(np.float32), 8, axis=1) * m.astype(np.float32)
    w = codes.reshape(N, -1, 32).astype(np.float32) * step[..., None] - low[..., None]
    assert np.array_equal(w.reshape(N, K), exact)


def assert_lookups_are(w: NativeMatmul, exact: np.ndarray) -> None:
    """Rows looked up from the tiles (a tied embedding) are `exact`'s, bit for bit."""
    table = BlockEmbedding(w, torch.float32)
    ids = torch.tensor([[0, 17, 95], [50, 3, 64]])
    assert torch.equal(table[ids], torch.from_numpy(exact[ids.numpy()]))


def assert_tiles_product(w: NativeMatmul, blocks: GGUFBlocks, exact: np.ndarray, x: torch.Tensor) -> None:
    """The tiles' product with x is the portable loops' bit for bit, within kernel_bound of x exact^T, and a
    row alone gets the bits it gets among others."""
    got = w.gemm(x, out_dtype=torch.float32)
    assert torch.equal(got, w.gemm(x, out_dtype=torch.float32, portable=True))
    xf = x.float().numpy()
    assert (
        np.abs(got.numpy() - xf.astype(np.float64) @ exact.T.astype(np.float64)) <= kernel_bound(blocks, xf)
    ).all()
    if x.shape[0] > 1:
        assert torch.equal(w.gemm(x[1:2], out_dtype=torch.float32)[0], got[1])


def test_lookups_are_ggml_dequantization(real_blocks):
    blocks, exact = real_blocks
    assert_lookups_are(KINDS[blocks.kind][0](*blocks.q4_k_fields()), exact)


@pytest.mark.parametrize("rows", [1, 3, 5, 70])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_tiles_compute_the_product_and_every_level_the_same_bits(real_blocks, rows, dtype, kernel_level):  # noqa: F811
    blocks, exact = real_blocks
    assert_tiles_product(
        KINDS[blocks.kind][0](*blocks.q4_k_fields()), blocks, exact, torch.randn(rows, K).to(dtype)
    )


def test_the_level_with_these_tiles_packs_the_kind_in_them(real_blocks):
    blocks, _ = real_blocks
    bits = pack_native(blocks, torch.float32).native.bits
    assert bits == (KINDS[blocks.kind][1] if q4_k_tiles() else 4 if blocks.kind == "Q4_K" else 8)
