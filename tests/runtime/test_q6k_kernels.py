"""Q6_K kept in its own 6-bit tiles (NativeMatmul.q6_k, csrc/quantized_matmul.c's gemm_pair6), at every
instruction-set level.

Weights: real Q6_K bytes, llama.cpp's own quantizer (quantize_q6_K from xllamacpp's library) run on random
float weights, de-quantized by gguf-py as the oracle. Activations on the 8-bit grid (integers -127..127 times
2^-6, each block of 32 reaching 127), which the kernel's 8-bit activations and llama.cpp's Q8_K both hold
without loss: the kernel then differs from the exact product only by float rounding, stated as
FLOAT_BOUND."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf import quants

from runtime.kernels import layer_ops as native_layer_ops
from runtime.kernels.quantized_matmul import NativeMatmul
from runtime.quant.gguf_blocks import GGUFBlocks
from runtime.quant.linear import BlockEmbedding, pack_gguf
from tests.runtime.native_levels import kernel_level  # noqa: F401 (a fixture)
from tests.runtime.test_kquant_kernels import F16_STEP, ggml, kernel_bound, llama_dot, llama_quantize  # noqa: F401 (ggml: a fixture)


def float_bound(w: np.ndarray, x: np.ndarray) -> np.ndarray:
    """FLOAT_BOUND: |kernel - x W^T| [M, N] on grid activations: per block of 32 the two sub-blocks' exact
    integer sums are scaled by d sc (exact) and added (2 roundings), then accumulated over the K / 32 blocks
    (one rounding each), each rounding at most 2^-24 of a partial sum bounded by sum |w x|."""
    k = w.shape[1]
    return (k // 32 + 2) * 2.0**-24 * (np.abs(x).astype(np.float64) @ np.abs(w).astype(np.float64).T)


def grid_activations(m: int, k: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    xi = rng.integers(-127, 128, (m, k))
    xi[:, ::32] = 127
    return (xi * 2.0**-6).astype(np.float32)


@pytest.fixture(scope="module")
def real_q6_k(ggml):  # noqa: F811
    n, k = 96, 1024
    w = np.random.default_rng(0).standard_normal((n, k)).astype(np.float32) * 0.05
    raw = llama_quantize(ggml, "Q6_K", w)
    blocks = GGUFBlocks.parse("Q6_K", raw, (n, k))
    exact = quants.dequantize(raw, gguf.GGMLQuantizationType.Q6_K).reshape(n, k)
    assert np.array_equal(blocks.dequantize(), exact)  # the parse is gguf-py's, bit for bit
    assert np.abs(exact - w).max() < 0.05  # a real quantization of w, not noise
    return raw, blocks, exact


@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
def test_the_6_bit_tiles_compute_the_dequantized_product(real_q6_k, x_dtype, kernel_level):  # noqa: F811
    """At 1 row (codes unpacked in registers), 5 and 70 rows (unpacked once into the scratch, several tiles
    and chunks of rows at AVX2's 4-row tiles): within FLOAT_BOUND of gguf-py's weights times x, and the
    portable loops' result bit for bit."""
    raw, blocks, exact = real_q6_k
    native = NativeMatmul.q6_k(*blocks.q6_k_fields())
    assert native.tiled_nbytes == raw.nbytes  # 6.5625 bits a weight, as in the file
    x = grid_activations(70, blocks.shape[1], seed=1)
    reference = x.astype(np.float64) @ exact.astype(np.float64).T
    bound = float_bound(exact, x)
    for rows in (1, 5, 70):
        xt = torch.from_numpy(x[:rows]).to(x_dtype)
        y = native(xt, out_dtype=torch.float32)
        err = np.abs(y.numpy() - reference[:rows])
        assert (err <= bound[:rows]).all(), (rows, float((err / bound[:rows]).max()))
        assert torch.equal(y, native.gemm(xt, out_dtype=torch.float32, portable=True)), rows


def test_random_activations_within_the_8_bit_activation_bound(real_q6_k, kernel_level):  # noqa: F811
    """Off the grid the activations' 8-bit quantization adds at most half a step dx per input
    (kernel_bound, with no slack for the weights: the tiles hold d, sc and the codes as the file does)."""
    _, blocks, exact = real_q6_k
    x = torch.randn(7, blocks.shape[1], generator=torch.Generator().manual_seed(3))
    y = NativeMatmul.q6_k(*blocks.q6_k_fields())(x).numpy()
    reference = x.double().numpy() @ exact.astype(np.float64).T
    assert (np.abs(y - reference) <= kernel_bound(blocks, x.numpy())).all()


def test_the_6_bit_tiles_equal_llama_cpp_dot_product(real_q6_k, ggml, kernel_level):  # noqa: F811
    """ggml_vec_dot_q6_K_q8_K on the same bytes and the same 8-bit activations: both exact integer sums,
    so they differ by the two sides' float rounding only."""
    raw, blocks, exact = real_q6_k
    x = grid_activations(1, blocks.shape[1], seed=2)
    ours = NativeMatmul.q6_k(*blocks.q6_k_fields())(torch.from_numpy(x), out_dtype=torch.float32)[0]
    theirs = np.array([llama_dot(ggml, "Q6_K", raw[r], x[0]) for r in range(blocks.shape[0])])
    bound = 2 * float_bound(exact, x)[0]
    assert (np.abs(ours.numpy() - theirs) <= bound).all(), float(
        (np.abs(ours.numpy() - theirs) / bound).max()
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_silu_epilogue_on_6_bit_tiles(real_q6_k, dtype, kernel_level):  # noqa: F811
    """A fused [gate; up] in Q6_K: the epilogue's SiLU(gate) x up is the plain product followed by the layer
    op, bit for bit, in the scratch path and the in-register one."""
    _, blocks, _ = real_q6_k
    fused = GGUFBlocks.stack([blocks.take_rows(np.arange(64)), blocks.take_rows(np.arange(32, 96))])
    assert fused.kind == "Q6_K"
    native = NativeMatmul.q6_k(*fused.q6_k_fields())
    for rows in (1, 9):
        x = torch.randn(rows, fused.shape[1], generator=torch.Generator().manual_seed(rows)).to(dtype)
        plain = native.gemm(x)
        expected = torch.empty(rows, 64, dtype=dtype)
        native_layer_ops.silu_mul(plain, expected)
        assert torch.equal(native.gemm(x, silu=True), expected), rows


def test_rows_looked_up_from_the_6_bit_tiles_are_ggml_dequantization(real_q6_k):
    _, blocks, exact = real_q6_k
    ids = torch.tensor([0, 15, 16, 33, 95, 47, 0])
    rows = BlockEmbedding(NativeMatmul.q6_k(*blocks.q6_k_fields()), torch.float32)[ids]
    assert np.array_equal(rows.numpy(), exact[ids.numpy()])


def test_packed_layer_keeps_q6_k_in_its_own_tiles(real_q6_k):
    """pack_gguf gives Q6_K the 6-bit tiles (the file's bytes); where they cannot be made (out features not a
    multiple of 32) it falls back to the Q8_0 re-quantization, within that one's bound."""
    raw, blocks, exact = real_q6_k
    layer = pack_gguf(blocks, torch.float32)
    assert layer.packed is None and layer.native.bits == 6 and layer.nbytes == raw.nbytes
    x = torch.randn(3, blocks.shape[1], generator=torch.Generator().manual_seed(4))
    reference = x.double().numpy() @ exact.astype(np.float64).T
    assert (np.abs(layer(x).numpy() - reference) <= kernel_bound(blocks, x.numpy())).all()
    odd = blocks.take_rows(np.arange(48))
    fallback = pack_gguf(odd, torch.float32)
    assert fallback.native.bits == 8
    requantized = np.repeat(odd.kernel_blocks().scale / 2, 32, 1) @ np.abs(x.numpy()).T  # half its step
    bound = kernel_bound(odd, x.numpy()) + F16_STEP * np.abs(reference[:, :48]) + requantized.T
    assert (np.abs(fallback(x).numpy() - reference[:, :48]) <= bound).all()
