"""The K-quant and 5-bit GGUF types (Q4_K, Q5_K, Q6_K, Q5_0, Q5_1) parsed and multiplied packed.

Oracles: gguf-py's de-quantization (the parser must equal it bit for bit); numpy over those weights with
the activations quantized to 8 bits per block of 32 as the C kernel's contract says (the kernels, one-row and
many-row, at every instruction-set level, within the bound their float16 scales allow; Q6_K in its own 6-bit
tiles, tests/runtime/test_q6k_kernels.py); llama.cpp's own dot products (ggml_vec_dot_*, loaded from
xllamacpp's library with ctypes) on activations both sides quantize without loss."""

from __future__ import annotations

import ctypes
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import quants

from runtime.kernels.quantized_matmul import NativeMatmul
from runtime.quant.gguf_blocks import BLOCK_BYTES, BLOCK_ELEMENTS, GGUFBlocks
from runtime.quant.linear import BlockEmbedding, Int4Linear, pack_gguf, pack_native
from runtime.quant.resolve import make_linear
from tests.runtime.native_levels import kernel_level  # noqa: F401 (a fixture)

NEW_TYPES = ("Q4_K", "Q5_K", "Q6_K", "Q5_0", "Q5_1")
F16_FIELDS = {
    "Q4_0": [0],
    "Q4_1": [0, 2],
    "Q8_0": [0],
    "Q5_0": [0],
    "Q5_1": [0, 2],
    "Q4_K": [0, 2],
    "Q5_K": [0, 2],
    "Q6_K": [208],
}
"""Byte offsets of each block's float16 fields (d, and m or dmin)."""
F16_STEP = 2.0**-11
"""float16's relative rounding: the kernels hold the K-quants' d sc and dmin m in float16."""


def random_raw(kind: str, n: int, k: int, seed: int = 0) -> np.ndarray:
    """Random blocks: every code and 6-bit scale byte random, the float16 fields small normals."""
    rng = np.random.default_rng(seed)
    nb = n * k // BLOCK_ELEMENTS[kind]
    raw = rng.integers(0, 256, (nb, BLOCK_BYTES[kind]), dtype=np.uint8)
    for at in F16_FIELDS[kind]:
        raw[:, at : at + 2] = (
            (rng.standard_normal(nb) * 0.01).astype(np.float16).view(np.uint8).reshape(nb, 2)
        )
    return raw.reshape(n, -1)


@pytest.mark.parametrize("kind", list(BLOCK_BYTES))
def test_parse_equals_gguf_py_bit_for_bit(kind):
    n, k = 5, 768
    raw = random_raw(kind, n, k)
    ref = quants.dequantize(raw, gguf.GGMLQuantizationType[kind]).reshape(n, k)
    ours = GGUFBlocks.parse(kind, raw, (n, k)).dequantize()
    assert ours.dtype == np.float32 and np.array_equal(ours.view(np.uint32), ref.view(np.uint32))


def test_q6_k_requantization_within_its_bound():
    blocks = GGUFBlocks.parse("Q6_K", random_raw("Q6_K", 8, 512), (8, 512))
    exact, q8 = blocks.dequantize(), blocks.kernel_blocks()
    assert q8.kind == "Q8_0" and np.array_equal(q8.scale, q8.scale.astype(np.float16).astype(np.float32))
    err = np.abs(q8.dequantize() - exact).reshape(8, -1, 32).max(-1)
    assert (err <= q8.scale / 2 * (1 + 1e-6)).all()
    # the stated bound: 16/127 (about 1/8) of the largest Q6_K step (d |sc|) in the block of 32
    step = np.abs(blocks.scale).reshape(8, -1, 2).max(-1)
    assert (err <= step * 16 / 127 * (1 + 2e-3)).all()


def kernel_bound(blocks: GGUFBlocks, x: np.ndarray) -> np.ndarray:
    """|kernel - x W^T| allowed per output [M, N]: the 8-bit activations (half a step dx per input, dx the
    block's max|x| / 127), the float16 scales and offsets (2^-11 of each; none for Q6_K, whose 6-bit tiles
    hold d and sc as the file does), and float sums (1e-5 of sum |w x|)."""
    n, k = blocks.shape
    w = np.abs(blocks.dequantize()).astype(np.float64)
    ax = np.abs(x).astype(np.float64)
    dx = ax.reshape(x.shape[0], -1, 32).max(-1) / 127
    bound = w @ np.repeat(dx / 2, 32, axis=1).T + 1e-5 * (ax @ w.T).T
    if blocks.kind != "Q6_K":
        codes, scale, offset, _ = blocks.affine()
        per_weight = np.abs(np.repeat(scale, 32, 1)) * codes + np.abs(np.repeat(offset, 32, 1))
        bound = bound + F16_STEP * (per_weight @ ax.T)
    return bound.T


def native_for(blocks: GGUFBlocks, **kwargs) -> NativeMatmul:
    """The C kernels' layout pack_gguf gives these blocks: Q6_K's 6-bit tiles, Q5_0's and Q5_1's where
    pack_native makes their 5-bit tiles (unless tiles=False), else the affine one."""
    if blocks.kind == "Q6_K":
        return NativeMatmul.q6_k(*blocks.q6_k_fields())
    if blocks.kind in ("Q5_0", "Q5_1") and kwargs.get("tiles", True):
        return pack_native(blocks, torch.float32).native
    return NativeMatmul(*blocks.affine(), **kwargs)


@pytest.mark.parametrize("kind", NEW_TYPES)
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
def test_kernels_equal_the_dequantized_reference_within_the_bound(kind, x_dtype, kernel_level):  # noqa: F811
    n, k, m = 64, 512, 5
    blocks = GGUFBlocks.parse(kind, random_raw(kind, n, k, seed=1), (n, k))
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(2)).to(x_dtype)
    xf = x.float().numpy()
    reference = xf.astype(np.float64) @ blocks.dequantize().astype(np.float64).T
    bound = kernel_bound(blocks, xf)
    native = native_for(blocks)
    outputs = {
        "one-row": native(x, out_dtype=torch.float32),
        "one-row 1": native(x[:1], out_dtype=torch.float32),
    }
    if native.tiles is not None:
        outputs["many-row"] = native.gemm(x, out_dtype=torch.float32)
    assert kernel_level == "generic" or "many-row" in outputs
    for path, y in outputs.items():
        err = np.abs(y.numpy() - reference[: y.shape[0]])
        assert (err <= bound[: y.shape[0]]).all(), (path, float((err / bound[: y.shape[0]]).max()))
    # through the packed layer the model uses, at one row and many
    layer = pack_gguf(blocks, x_dtype)
    for rows in (1, m):
        y = layer(x[:rows], out_dtype=torch.float32).numpy()
        assert (np.abs(y - reference[:rows]) <= bound[:rows]).all()


@pytest.mark.parametrize("kind", NEW_TYPES + ("Q8_0",))
def test_block_embedding_rows(kind):
    n, k = 64, 256
    blocks = GGUFBlocks.parse(kind, random_raw(kind, n, k, seed=3), (n, k))
    ids = torch.tensor([0, 7, 39, 7])
    exact = blocks.dequantize()[ids.numpy()]
    assert np.array_equal(BlockEmbedding(blocks, torch.float32)[ids].numpy(), exact)
    native = BlockEmbedding(native_for(blocks, tiles=False), torch.float32)
    rows = native[ids].numpy()
    if kind in ("Q5_0", "Q5_1", "Q8_0", "Q6_K"):  # scales and offsets as in the file: exact
        assert np.array_equal(rows, exact)
    else:
        codes, scale, offset, _ = blocks.affine()
        slack = F16_STEP * (np.abs(np.repeat(scale, 32, 1)) * codes + np.abs(np.repeat(offset, 32, 1)))
        assert (np.abs(rows - exact) <= slack[ids.numpy()] * 1.0001).all()


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_K", "Q5_0", "Q8_0"])
def test_block_embedding_rows_from_the_tiles_alone(kind):
    """A tied LM head held only in the many-row kernel's tiles (one copy, every row count) looks its rows up
    from the tiles: the same values as from the one-row layout, rows from several tiles and columns."""
    n, k = 96, 256
    blocks = GGUFBlocks.parse(kind, random_raw(kind, n, k, seed=4), (n, k))
    affine = blocks.kernel_blocks().affine()
    tiled = NativeMatmul(*affine, one_row=False)
    assert not tiled.one_row and tiled.tiles is not None and tiled.codes.numel() == 0
    ids = torch.tensor([0, 15, 16, 33, 95, 47, 0])
    one_row = NativeMatmul(*affine, tiles=False)
    rows = tiled.dequantize_rows(ids)
    assert torch.equal(rows, one_row.dequantize_rows(ids))
    if kind != "Q4_K":  # float16 scales as in the file: the rows are ggml's de-quantization exactly
        assert np.array_equal(rows.numpy(), blocks.dequantize()[ids.numpy()])


# llama.cpp's dot products ---------------------------------------------------------------------------------

LLAMA_DOT = {  # our type -> (ggml dot, activation quantizer, activation block bytes, elements)
    "Q4_K": ("ggml_vec_dot_q4_K_q8_K", "quantize_row_q8_K", 292, 256),
    "Q5_K": ("ggml_vec_dot_q5_K_q8_K", "quantize_row_q8_K", 292, 256),
    "Q6_K": ("ggml_vec_dot_q6_K_q8_K", "quantize_row_q8_K", 292, 256),
    "Q5_0": ("ggml_vec_dot_q5_0_q8_0", "quantize_row_q8_0", 34, 32),
    "Q5_1": ("ggml_vec_dot_q5_1_q8_1", "quantize_row_q8_1", 36, 32),
}


@pytest.fixture(scope="module")
def ggml():
    import xllamacpp  # the `test` extra

    lib = ctypes.CDLL(str(next(Path(xllamacpp.__file__).parent.glob("xllamacpp*.so"))))
    lib.ggml_cpu_init()  # its float16 tables, which the dot products read
    return lib


def llama_quantize(lib, kind: str, w: np.ndarray) -> np.ndarray:
    """w [N, K] float32 -> the kind's bytes [N, K / elements * block bytes], by llama.cpp's quantize_<kind>."""
    n, k = w.shape
    out = np.zeros((n, k // BLOCK_ELEMENTS[kind] * BLOCK_BYTES[kind]), np.uint8)
    w = np.ascontiguousarray(w, np.float32)
    fn = getattr(lib, f"quantize_{kind.lower()}".replace("_k", "_K"))
    fn.restype = ctypes.c_size_t
    fn(
        ctypes.c_void_p(w.ctypes.data),
        ctypes.c_void_p(out.ctypes.data),
        ctypes.c_int64(n),
        ctypes.c_int64(k),
        ctypes.c_void_p(None),
    )
    return out


def llama_dot(lib, kind: str, raw_row: np.ndarray, x: np.ndarray) -> float:
    dot, quantize, size, per = LLAMA_DOT[kind]
    k = x.shape[0]
    xq = np.zeros(k // per * size, np.uint8)
    x = np.ascontiguousarray(x, dtype=np.float32)
    getattr(lib, quantize)(ctypes.c_void_p(x.ctypes.data), ctypes.c_void_p(xq.ctypes.data), ctypes.c_int64(k))
    out = ctypes.c_float()
    raw_row = np.ascontiguousarray(raw_row)
    getattr(lib, dot)(
        ctypes.c_int(k),
        ctypes.byref(out),
        ctypes.c_size_t(0),
        ctypes.c_void_p(raw_row.ctypes.data),
        ctypes.c_size_t(0),
        ctypes.c_void_p(xq.ctypes.data),
        ctypes.c_size_t(0),
        ctypes.c_int(1),
    )
    return out.value


@pytest.mark.parametrize("kind", NEW_TYPES)
def test_kernels_equal_llama_cpp_dot_products(kind, ggml, kernel_level):  # noqa: F811
    """Activations on both sides' 8-bit grids (integers -127..127 times 2^-6, each block of 32 reaching 127),
    so both quantize them without loss: the dot products then differ only by our float16 scales (K-quants
    but Q6_K), Q5_1's float16 activation sums in llama.cpp (q8_1), and float sums."""
    n, k = 32, 512
    rng = np.random.default_rng(4)
    raw = random_raw(kind, n, k, seed=5)
    xi = rng.integers(-127, 128, (1, k))
    xi[:, ::32] = 127
    x = (xi * 2.0**-6).astype(np.float32)
    blocks = GGUFBlocks.parse(kind, raw, (n, k))
    ours = native_for(blocks)(torch.from_numpy(x), out_dtype=torch.float32)[0]
    theirs = np.array([llama_dot(ggml, kind, raw[r], x[0]) for r in range(n)])
    w = blocks.dequantize().astype(np.float64)
    exact = w @ x[0].astype(np.float64)
    bound = kernel_bound(blocks, x)[0] + 1e-5 * (np.abs(w) @ np.abs(x[0]))
    if kind == "Q5_1":  # llama.cpp's q8_1 keeps d * sum(q) per block in float16
        m = np.abs(blocks.minimum) * np.abs(x[0].reshape(-1, 32).sum(-1))
        bound = bound + F16_STEP * m.sum(-1)
    if kind == "Q6_K":  # both sides hold the file's weights: llama.cpp's result is the exact one too
        assert (np.abs(theirs - exact) <= 1e-5 * (np.abs(w) @ np.abs(x[0])) + 1e-6).all()
    assert (np.abs(ours.numpy() - theirs) <= bound).all(), float(
        (np.abs(ours.numpy() - theirs) / bound).max()
    )


def test_scales_beyond_float16_are_dequantized_instead():
    raw = random_raw("Q4_K", 32, 256, seed=6)
    raw.reshape(-1, 144)[0, :2] = np.array([60000], np.float16).view(np.uint8)  # d sc up to 63 x 60000
    blocks = GGUFBlocks.parse("Q4_K", raw, (32, 256))
    assert not blocks.fits_float16()
    w = make_linear(blocks, "gguf", torch.float32, torch.device("cpu"))
    assert isinstance(w, torch.Tensor) and torch.equal(w, torch.from_numpy(blocks.dequantize()))
    assert isinstance(
        make_linear(
            GGUFBlocks.parse("Q4_K", random_raw("Q4_K", 32, 256), (32, 256)),
            "gguf",
            torch.float32,
            torch.device("cpu"),
        ),
        Int4Linear,
    )


def test_mixed_8_bit_kinds_stack_for_a_fused_projection():
    """A K-quant file's q, k (Q5_0) and v (Q8_0): one packed weight, exactly the parts' rows."""
    parts = [
        GGUFBlocks.parse(kind, random_raw(kind, 32, 256, seed=i), (32, 256))
        for i, kind in enumerate(("Q5_0", "Q5_0", "Q8_0", "Q5_1"))
    ]
    fused = GGUFBlocks.stack(parts)
    assert fused.kind == "AFFINE8"
    assert np.array_equal(fused.dequantize(), np.concatenate([p.dequantize() for p in parts]))
    assert (
        GGUFBlocks.stack([parts[0], GGUFBlocks.parse("Q4_K", random_raw("Q4_K", 32, 256), (32, 256))]) is None
    )
    layer = pack_gguf(fused, torch.float32)
    assert layer.packed is None  # the C kernels alone
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(7))
    reference = x.double().numpy() @ fused.dequantize().astype(np.float64).T
    bound = kernel_bound(fused, x.numpy())
    assert (np.abs(layer(x).numpy() - reference) <= bound).all()
