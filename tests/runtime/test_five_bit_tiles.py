"""Q5_0 and Q5_1 in 5-bit tiles (NativeMatmul.q5, bits FIVE_BITS in csrc/quantized_matmul.c): the 4-bit tiles
of their codes' low bits and a plane of their fifth bits, with the file's float16 d (and Q5_1's m) per block:
5.5 and 6 bits a weight, as in the file, where the 8-bit tiles took 9. Weights: real Q5_0 and Q5_1 bytes from
llama.cpp's quantize_q5_0 / quantize_q5_1; oracles: gguf-py's de-quantization, and the vector loops against
the portable ones, bit for bit, at every level this CPU runs."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf import quants

from runtime.kernels.quantized_matmul import FIVE_BITS, NativeMatmul
from runtime.quant.gguf_blocks import GGUFBlocks
from runtime.quant.linear import pack_gguf
from tests.runtime.native_levels import kernel_level  # noqa: F401 (a fixture)
from tests.runtime.test_kquant_kernels import ggml, llama_quantize  # noqa: F401 (ggml: a fixture)
from tests.runtime.test_kquant_tiles import assert_lookups_are, assert_tiles_product

N, K = 96, 640  # K a whole number of blocks of 32 but not of 256, as Gemma 3 270M's width


@pytest.fixture(scope="module", params=["Q5_0", "Q5_1"])
def real_blocks(ggml, request):  # noqa: F811
    kind = request.param
    w = np.random.default_rng(11).standard_normal((N, K)).astype(np.float32) * 0.05
    w[:, :32] += 0.2  # a block whose values are all positive: Q5_1's minimum far from -16 d
    raw = llama_quantize(ggml, kind, w)
    exact = quants.dequantize(raw, getattr(gguf.GGMLQuantizationType, kind)).reshape(N, K)
    return GGUFBlocks.parse(kind, raw, (N, K)), exact


def five_bit(blocks: GGUFBlocks) -> NativeMatmul:
    codes, scale, offset, _ = blocks.affine(factor=True)
    return NativeMatmul.q5(codes, scale, offset)


def test_tiles_hold_the_files_bits_a_weight(real_blocks):
    blocks, _ = real_blocks
    w = five_bit(blocks)
    assert w.bits == FIVE_BITS and not w.one_row
    per_weight = 5.5 if blocks.kind == "Q5_0" else 6.0
    assert w.tiled_nbytes * 8 == per_weight * N * K
    assert pack_gguf(blocks, torch.float32).native.bits == FIVE_BITS  # the model's packing takes them


def test_rows_read_back_are_ggml_dequantization(real_blocks):
    blocks, exact = real_blocks
    assert_lookups_are(five_bit(blocks), exact)


@pytest.mark.parametrize("rows", [1, 3, 5, 70])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_tiles_compute_the_product_and_every_level_the_same_bits(real_blocks, rows, dtype, kernel_level):  # noqa: F811
    blocks, exact = real_blocks
    x = torch.randn(rows, K, generator=torch.Generator().manual_seed(rows)).to(dtype)
    assert_tiles_product(five_bit(blocks), blocks, exact, x)


@pytest.mark.parametrize("rows", [1, 6])
def test_fused_gate_up_epilogue_is_silu_of_the_plain_product(real_blocks, rows, kernel_level):  # noqa: F811
    """A fused [gate; up] in 5-bit tiles (N columns each): SiLU(gate) x up in the kernel's epilogue equals the
    layer ops' silu_mul of its plain output."""
    from runtime.kernels.layer_ops import silu_mul

    blocks, _ = real_blocks
    w = five_bit(GGUFBlocks.stack([blocks, blocks.take_rows(np.arange(N)[::-1].copy())]))
    x = torch.randn(rows, K, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    expected = torch.empty(rows, N, dtype=torch.bfloat16)
    silu_mul(w.gemm(x), expected)
    assert torch.equal(w.gemm(x, silu=True), expected)
