"""Q4_K in 4-bit tiles with its own super-block scales (NativeMatmul.q4_k, bits KQ4 in csrc/quantized_matmul.c):
4.625 bits a weight instead of the 5 of a float16 scale and offset per block, and exact (d sc and dmin m formed
in float32, as ggml de-quantizes). Weights: real Q4_K bytes from llama.cpp's quantize_q4_K; oracles: gguf-py's
de-quantization, and the vector loops against the portable ones, bit for bit, at every level this CPU runs."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf import quants

from runtime.kernels.quantized_matmul import KQ4_BITS, NativeMatmul, q4_k_tiles
from runtime.quant.gguf_blocks import GGUFBlocks
from runtime.quant.linear import BlockEmbedding, pack_native
from tests.runtime.native_levels import kernel_level  # noqa: F401 (a fixture)
from tests.runtime.test_kquant_kernels import ggml, kernel_bound, llama_quantize  # noqa: F401 (ggml: a fixture)

N, K = 96, 1024


@pytest.fixture(scope="module")
def real_q4_k(ggml):  # noqa: F811
    w = np.random.default_rng(5).standard_normal((N, K)).astype(np.float32) * 0.05
    raw = llama_quantize(ggml, "Q4_K", w)
    exact = quants.dequantize(raw, gguf.GGMLQuantizationType.Q4_K).reshape(N, K)
    return GGUFBlocks.parse("Q4_K", raw, (N, K)), exact


def test_fields_are_the_files_and_rebuild_its_weights(real_q4_k):
    blocks, exact = real_q4_k
    codes, sc, m, d, dmin = blocks.q4_k_fields()
    assert sc.max() < 64 and m.max() < 64  # 6-bit, as the file packs them
    step = np.repeat(d.astype(np.float32), 8, axis=1) * sc.astype(np.float32)
    low = np.repeat(dmin.astype(np.float32), 8, axis=1) * m.astype(np.float32)
    w = codes.reshape(N, -1, 32).astype(np.float32) * step[..., None] - low[..., None]
    assert np.array_equal(w.reshape(N, K), exact)


def test_lookups_are_ggml_dequantization(real_q4_k):
    blocks, exact = real_q4_k
    table = BlockEmbedding(NativeMatmul.q4_k(*blocks.q4_k_fields()), torch.float32)
    ids = torch.tensor([[0, 17, 95], [50, 3, 64]])
    assert torch.equal(table[ids], torch.from_numpy(exact[ids.numpy()]))


@pytest.mark.parametrize("rows", [1, 3, 5, 70])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_tiles_compute_the_product_and_every_level_the_same_bits(real_q4_k, rows, dtype, kernel_level):  # noqa: F811
    blocks, exact = real_q4_k
    w = NativeMatmul.q4_k(*blocks.q4_k_fields())
    x = torch.randn(rows, K).to(dtype)
    got = w.gemm(x, out_dtype=torch.float32)
    assert torch.equal(got, w.gemm(x, out_dtype=torch.float32, portable=True))
    xf = x.float().numpy()
    assert (np.abs(got.numpy() - xf @ exact.T) <= kernel_bound(blocks, xf)).all()
    if rows > 1:  # a row alone gets the bits it gets among others
        assert torch.equal(w.gemm(x[1:2], out_dtype=torch.float32)[0], got[1])


def test_the_level_with_these_tiles_packs_q4_k_in_them(real_q4_k):
    blocks, _ = real_q4_k
    assert pack_native(blocks, torch.float32).native.bits == (KQ4_BITS if q4_k_tiles() else 4)
