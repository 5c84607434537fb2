"""GGUF blocks multiplied by a small C kernel (csrc/quantized_matmul.c) with 8-bit activations.

torch's int4 kernel computes in floating point: every 4-bit weight is widened to
a float and multiplied by a float. For a few rows (decode) the kernel here
quantizes each row of activations to 8 bits per block of 32 (as llama.cpp
does) and runs the inner products on integers (AVX-512 VNNI or AVX2 vector
loops, by the level the library was built for), with the block scales applied
once per block; float32 activations as well as bfloat16, so the packed path
needs no bfloat16 hardware. 8-bit activations are not
exact: the model measures on load whether this is faster than torch's kernel
on this CPU (LlamaModel), and the tests bound the difference and check the
greedy tokens.

The weights are repacked once at load (the layout is in the C file's header):
the codes stay 4-bit (Q4_0, Q4_1, 4-bit re-quantized) or 8-bit (Q8_0, int8),
with a float16 scale and offset per block, w = scale * code + offset; with the
vector loops Q5_0 / Q5_1 and the K-quants have tiles of their own (q5, q4_k,
q5_k, q6_k below).
"""

from __future__ import annotations

import numpy as np
import torch

from runtime.kernels.library import load

GROUP = 32
KQ4_BITS = 14
"""The kernels' `bits` for 4-bit tiles with Q4_K's super-block scales (NativeMatmul.q4_k)."""
KQ5_BITS = 15
"""The kernels' `bits` for Q5_K's codes: KQ4's tiles of their low 4 bits and a plane of their fifth bits
(NativeMatmul.q5_k)."""
FIVE_BITS = 5
"""The kernels' `bits` for Q5_0's and Q5_1's codes: the 4-bit tiles of their low 4 bits and a plane of their
fifth bits (as KQ5's), with a float16 scale (and Q5_1's offset) per block (NativeMatmul.q5)."""
SYMMETRIC_OFFSET = {4: -8.0, FIVE_BITS: -16.0, 8: -128.0}
"""bits -> the offset c (w = d * code + c d) of the symmetric types' tiles (Q4_0's codes, Q5_0's, Q8_0's + 128):
their tiles hold no offsets, the kernels form c d (csrc/quantized_matmul.c, symmetric_offset)."""
TILE_COLUMNS = 16
"""Output columns per vector of the many-row kernel's layout; it takes N % (2 * TILE_COLUMNS) == 0."""


class NativeMatmul:
    """y = x W^T for one weight matrix prepared for the C kernel; x [M, K] float32 or bfloat16, K % 64 == 0."""

    def __init__(
        self,
        codes: np.ndarray,
        scale: np.ndarray,
        offset: np.ndarray | float,
        bits: int,
        tiles: bool = True,
        one_row: bool = True,
        consume: bool = False,
    ):
        """codes [N, K] (0..15 for bits=4; 0..255 for bits=8, e.g. Q8_0's stored code + 128 or Q5_0's
        0..31); scale, offset [N, K / 32] with w = scale * code + offset per block (offset a number c: c *
        scale, a symmetric type's, with no array of them made where only the tiles are). `tiles`: also the
        many-row kernel's layout, where it can be made; `one_row` False: not the one-row kernel's where the
        tiled one is made (every call goes to the many-row loops; the blocks are held once). `consume`: the
        codes are this call's to overwrite (with_tiles' in_place)."""
        n, k = codes.shape
        self.tiles: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        """The same blocks laid out for the many-row kernel (quantized_gemm): made where the library has
        vector loops (AVX2 or AVX-512) and N % 32 == 0; the model drops them where they did not measure
        faster."""
        self.bits = bits
        if tiles and n % (2 * TILE_COLUMNS) == 0 and vector_loops():
            self.with_tiles(codes, scale, offset, in_place=consume and not one_row)
        self.one_row = one_row or self.tiles is None
        if not self.one_row:
            codes, scale, offset = (np.zeros((n, 0), np.uint8),) * 3
        elif not isinstance(offset, np.ndarray):
            offset = offset * np.asarray(scale, np.float32)
        if bits == 4 and self.one_row:
            # the two blocks of each pair share bytes: the first in the low nibbles, the second in the high
            pairs = codes.reshape(n, k // 64, 2, GROUP).astype(np.uint8)
            codes = (pairs[:, :, 0] | (pairs[:, :, 1] << 4)).reshape(n, k // 2)
        self.codes = torch.from_numpy(np.ascontiguousarray(codes, dtype=np.uint8))
        # float16, as the GGUF stores them (Q4_1's offset is its minimum; Q4_0's, Q5_0's and Q8_0's are -8d,
        # -16d and -128d, exact in float16 wherever d is); the K-quants' d * sc and dmin * m are rounded to
        # float16 here: each by at most 2^-11 of itself (2^-25 absolute below 2^-14, float16's subnormals)
        self.scale = torch.from_numpy(np.ascontiguousarray(scale, dtype=np.float16))
        self.offset = torch.from_numpy(np.ascontiguousarray(offset, dtype=np.float16))
        self.out_features, self.in_features = n, k
        self.nbytes = sum(t.numel() * t.element_size() for t in (self.codes, self.scale, self.offset))

    def with_tiles(
        self, codes: np.ndarray, scale: np.ndarray, offset: np.ndarray | float, in_place: bool = False
    ) -> NativeMatmul:
        """Add the layout of the many-row kernel (csrc/quantized_matmul.c, quantized_gemm) for the fields
        __init__ takes: per 16 output columns and block of 32 inputs, vectors of 4 codes per column. Costs
        the codes' bytes again, unless `in_place` and the codes are 8-bit, writable and contiguous: a group
        of 16 rows' tile takes exactly those rows' bytes, so each group is rewritten in its own memory (the
        codes are spent) and a large table is never held twice."""
        n, k = codes.shape
        g, nb = n // TILE_COLUMNS, k // GROUP
        tiles = _code_tiles(codes, 4 if self.bits == FIVE_BITS else self.bits, in_place)

        def per_tile(a: np.ndarray) -> torch.Tensor:
            out = np.empty((g, nb, TILE_COLUMNS), np.float16)
            out[...] = a.reshape(g, TILE_COLUMNS, nb).transpose(0, 2, 1)  # no float16 copy in between
            return torch.from_numpy(out)

        tscale = per_tile(scale)
        if isinstance(offset, np.ndarray):
            toffset = per_tile(offset)
        elif offset == SYMMETRIC_OFFSET.get(self.bits):  # none held: the kernels form c * d
            toffset = torch.empty(0, dtype=torch.float16)
        else:
            toffset = tscale * offset  # exact: c = -2^j
        self.tiles = (torch.from_numpy(tiles), tscale, toffset)
        return self

    @classmethod
    def q5_k(
        cls, codes: np.ndarray, sc: np.ndarray, m: np.ndarray, d: np.ndarray, dmin: np.ndarray
    ) -> NativeMatmul:
        """Q5_K's own fields (as q4_k's, codes 0..31) in the 4-bit tiles of their low 4 bits, each block
        followed by a 64-byte plane of their fifth bits (bits KQ5_BITS, csrc/quantized_matmul.c: byte 4j + i
        holds in bit t the fifth bit of the block's input 4t + i of column j), with Q4_K's super-block scales.
        5.625 bits a weight (the file: 5.5). N % 32 == 0, K % 256 == 0."""
        self = cls.q4_k(codes & 0x0F, sc, m, d, dmin)
        self.bits = KQ5_BITS
        return self._with_fifth_plane(codes)

    @classmethod
    def q5(cls, codes: np.ndarray, scale: np.ndarray, offset: np.ndarray | float) -> NativeMatmul:
        """Q5_0's or Q5_1's blocks (codes [N, K] 0..31, scale and offset [N, K / 32] as __init__ takes them;
        Q5_0's offset the number -16) in the 4-bit tiles of the codes' low 4 bits, each block followed by the
        plane of their fifth bits (as q5_k's), with a float16 scale, and Q5_1's offset, per block (bits
        FIVE_BITS), their one layout: 5.5 and 6 bits a weight, as in the file. N % 32 == 0."""
        n, k = codes.shape
        assert n % (2 * TILE_COLUMNS) == 0, n
        self = cls.__new__(cls)
        self.bits, self.one_row = FIVE_BITS, False
        self.codes, self.scale, self.offset = (torch.empty(n, 0, dtype=torch.uint8),) * 3
        self.out_features, self.in_features, self.nbytes = n, k, 0
        self.with_tiles(codes & 0x0F, scale, offset)
        return self._with_fifth_plane(codes)

    def _with_fifth_plane(self, codes: np.ndarray) -> NativeMatmul:
        """The 4-bit tiles of codes 0..31's low bits with the plane of their fifth bits after each block's 4
        nibble vectors (csrc/quantized_matmul.c: byte 4j + i holds in bit t the fifth bit of the block's input
        4t + i of column j)."""
        n, k = codes.shape
        g, nb = n // TILE_COLUMNS, k // GROUP
        fifth = ((codes >> 4) & 1).astype(np.uint8).reshape(g, TILE_COLUMNS, nb, 8, 4)  # [.., t, i]
        plane = np.bitwise_or.reduce(fifth << np.arange(8, dtype=np.uint8)[:, None], axis=3)  # [g, j, nb, i]
        tiles = np.concatenate([self.tiles[0].numpy(), plane.transpose(0, 2, 1, 3)[:, :, None]], axis=2)
        self.tiles = (torch.from_numpy(tiles), *self.tiles[1:])
        return self

    @classmethod
    def q4_k(
        cls, codes: np.ndarray, sc: np.ndarray, m: np.ndarray, d: np.ndarray, dmin: np.ndarray
    ) -> NativeMatmul:
        """Q4_K's own fields in the many-row kernel's 4-bit tiles with its super-block scales (bits KQ4_BITS,
        csrc/quantized_matmul.c), its one layout: codes [N, K] 0..15, sc and m [N, K / 32] (6-bit values),
        d and dmin [N, K / 256] (float16 values), w = d sc code - dmin m, as ggml de-quantizes it (d sc and
        dmin m formed exactly in float32). 4.625 bits a weight (the file: 4.5; the float16 scale and offset
        per block of 32 of the other 4-bit types: 5). N % 32 == 0, K % 256 == 0."""
        n, k = codes.shape
        assert n % (2 * TILE_COLUMNS) == 0 and k % 256 == 0, (n, k)
        self = cls.__new__(cls)
        self.bits, self.one_row = KQ4_BITS, False
        self.codes, self.scale, self.offset = (torch.empty(n, 0, dtype=torch.uint8),) * 3
        self.out_features, self.in_features, self.nbytes = n, k, 0
        g, nb = n // TILE_COLUMNS, k // GROUP
        tiles = _code_tiles(codes, 4, False)
        # [tiles, blocks, sc | m, column] and [tiles, super-blocks, d | dmin, column]
        scm = np.stack([np.asarray(a, np.uint8).reshape(g, TILE_COLUMNS, nb) for a in (sc, m)], axis=2)
        dd = np.stack(
            [np.asarray(a, np.float16).reshape(g, TILE_COLUMNS, k // 256) for a in (d, dmin)], axis=2
        )
        self.tiles = (
            torch.from_numpy(tiles),
            torch.from_numpy(np.ascontiguousarray(scm.transpose(0, 3, 2, 1))),
            torch.from_numpy(np.ascontiguousarray(dd.transpose(0, 3, 2, 1))),
        )
        return self

    @classmethod
    def from_tiles(cls, bits: int, tiles: tuple[torch.Tensor, ...], n: int, k: int) -> NativeMatmul:
        """A weight held only in the many-row kernel's tiles, made elsewhere (runtime.quant.gguf_raw): the
        (tiles, scale, offset) triple with_tiles, q4_k or q6_k would make for `bits`."""
        self = cls.__new__(cls)
        self.bits, self.one_row, self.tiles = bits, False, tuple(tiles)
        self.codes, self.scale, self.offset = (torch.empty(n, 0, dtype=torch.uint8),) * 3
        self.out_features, self.in_features, self.nbytes = n, k, 0
        return self

    @classmethod
    def q6_k(cls, codes: np.ndarray, sc: np.ndarray, d: np.ndarray) -> NativeMatmul:
        """Q6_K's own fields in the many-row kernel's 6-bit tiles (csrc/quantized_matmul.c, gemm_pair6), its
        one layout (every row count goes to gemm): codes [N, K] 0..63, sc [N, K / 16] int8, d [N, K / 256]
        (float16 values), w = d * sc * (code - 32), as ggml de-quantizes it. N % 32 == 0, K % 256 == 0.
        6.5625 bits a weight, as in the file."""
        n, k = codes.shape
        assert n % (2 * TILE_COLUMNS) == 0 and k % 256 == 0, (n, k)
        self = cls.__new__(cls)
        self.bits, self.one_row = 6, False
        self.codes, self.scale, self.offset = (torch.empty(n, 0, dtype=torch.uint8),) * 3
        self.out_features, self.in_features, self.nbytes = n, k, 0
        g, nb = n // TILE_COLUMNS, k // GROUP
        tiles = np.empty((g, nb, 6, 64), np.uint8)
        step = max(1, (1 << 24) // (TILE_COLUMNS * k))  # ~16 MB of codes at a time, as with_tiles
        for a in range(0, g, step):
            part = codes[a * TILE_COLUMNS : (a + step) * TILE_COLUMNS].astype(np.uint8, copy=False)
            # code vector v: inputs 4v..4v+3 of the block, [tiles, blocks, v, column, 4]
            c = part.reshape(-1, TILE_COLUMNS, nb, 8, 4).transpose(0, 2, 3, 1, 4).reshape(-1, nb, 8, 64)
            # sub-block s: vectors 3s..3s+2 hold code vectors 4s..4s+2 in their low 6 bits, 4s+3 in their top 2
            for s in range(2):
                last = c[:, :, 4 * s + 3]
                for i in range(3):
                    tiles[a : a + step, :, 3 * s + i] = c[:, :, 4 * s + i] | (((last >> (2 * i)) & 3) << 6)
        td = np.asarray(d, np.float16).reshape(g, TILE_COLUMNS, k // 256).transpose(0, 2, 1)
        tsc = np.asarray(sc, np.int8).reshape(g, TILE_COLUMNS, nb, 2).transpose(0, 2, 1, 3)
        self.tiles = tuple(torch.from_numpy(np.ascontiguousarray(t)) for t in (tiles, td, tsc))
        return self

    def dequantize_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` of W as float32 [len(ids), K], w = scale * code + offset (an embedding lookup), from
        the one-row layout or, where only the tiles are held, from those."""
        if not self.one_row:
            return self._dequantize_tiled_rows(ids)
        codes = self.codes[ids]
        if self.bits == 4:
            pairs = codes.view(-1, self.in_features // 64, 1, GROUP)
            codes = torch.cat([pairs & 0x0F, pairs >> 4], dim=2)
        codes = codes.reshape(ids.shape[0], -1, GROUP).float()
        w = codes * self.scale[ids].float().unsqueeze(-1) + self.offset[ids].float().unsqueeze(-1)
        return w.view(ids.shape[0], self.in_features)

    def _dequantize_tiled_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """The tiles' rows `ids`, read by the C library (quantized_tiles_rows; tiles exist only where it
        loads): each weight as the kernels read it."""
        tiles, scale, offset = self.tiles
        ids = ids.to(torch.int64).contiguous()
        if ids.numel() and not 0 <= int(ids.min()) <= int(ids.max()) < self.out_features:
            raise IndexError(f"row ids {ids.tolist()} outside the weight's {self.out_features} rows")
        out = torch.empty(ids.shape[0], self.in_features, dtype=torch.float32)
        load().quantized_tiles_rows(
            tiles.data_ptr(),
            scale.data_ptr(),
            offset.data_ptr(),
            self.in_features,
            self.bits,
            ids.data_ptr(),
            ids.shape[0],
            out.data_ptr(),
            torch.get_num_threads(),
        )
        return out

    @property
    def tiled_nbytes(self) -> int:
        """Bytes of the many-row kernel's copy (0 without one)."""
        return sum(t.numel() * t.element_size() for t in self.tiles or ())

    def gemm(
        self,
        x: torch.Tensor,
        out_dtype: torch.dtype | None = None,
        portable: bool = False,
        silu: bool = False,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The function __call__ computes, by the many-row kernel on the tiled copy (with_tiles first). With
        `silu` the weight is a fused [gate; up] (out_features % 64 == 0) and the result is
        SiLU(gate) x up [M, out_features / 2], rounded as runtime/layer ops' silu_mul of the plain result.
        `out`: where to write it (of the result's shape and dtype, its rows contiguous: a column slice of a
        wider output takes it, StackedMatmul)."""
        assert self.tiles is not None, "with_tiles() first"
        assert not silu or self.out_features % 64 == 0, "the fused epilogue takes gate and up pairs of 32"
        x = x.contiguous()
        m = x.shape[0]
        width = self.out_features // 2 if silu else self.out_features
        if out is None:
            out = torch.empty(m, width, dtype=out_dtype or x.dtype)
        assert out.shape == (m, width) and out.stride(1) == 1 and out.dtype in (torch.float32, torch.bfloat16)
        tiles, scale, offset = self.tiles
        load().quantized_gemm(
            x.data_ptr(),
            int(x.dtype == torch.bfloat16),
            m,
            self.in_features,
            tiles.data_ptr(),
            scale.data_ptr(),
            offset.data_ptr(),
            self.out_features,
            self.bits,
            out.data_ptr(),
            out.stride(0) if m > 1 else 0,
            int(out.dtype == torch.bfloat16),
            int(silu),
            int(portable),
            torch.get_num_threads(),
        )
        return out

    @classmethod
    def from_int4_fields(cls, codes: np.ndarray, scale: np.ndarray, zero: np.ndarray) -> NativeMatmul:
        """From the int4 kernel's fields, w = (code - 8) * scale + zero."""
        return cls(codes, scale, zero - 8 * scale, 4)

    @classmethod
    def from_q8(cls, codes: np.ndarray, scale: np.ndarray) -> NativeMatmul:
        """From Q8_0's signed codes, w = scale * code."""
        return cls((codes.astype(np.int16) + 128).astype(np.uint8), scale, -128 * scale, 8)

    def __call__(
        self, x: torch.Tensor, out_dtype: torch.dtype | None = None, portable: bool = False
    ) -> torch.Tensor:
        """x [M, K] -> [M, N] in out_dtype (default: x's); portable: the plain C loops, not the vector ones.
        Without the one-row layout (one_row False), the many-row loops."""
        if not self.one_row:
            return self.gemm(x, out_dtype=out_dtype, portable=portable)
        x = x.contiguous()
        m = x.shape[0]
        out = torch.empty(m, self.out_features, dtype=out_dtype or x.dtype)
        load().quantized_matmul(
            x.data_ptr(),
            int(x.dtype == torch.bfloat16),
            m,
            self.in_features,
            self.codes.data_ptr(),
            self.scale.data_ptr(),
            self.offset.data_ptr(),
            self.out_features,
            self.bits,
            out.data_ptr(),
            int(out.dtype == torch.bfloat16),
            int(portable),
            torch.get_num_threads(),
        )
        return out


def _code_tiles(codes: np.ndarray, bits: int, in_place: bool) -> np.ndarray:
    """codes [N, K] in the many-row kernel's layout: [N / 16, K / 32, vectors, 16 columns, 4] bytes, vector v
    of a block holding 4 codes per column (4-bit: low nibbles inputs 8v..8v+3, high nibbles 8v+4..8v+7;
    8-bit: inputs 4v..4v+3). `in_place`: 8-bit codes overwritten group by group in their own memory."""
    n, k = codes.shape
    g, nb = n // TILE_COLUMNS, k // GROUP
    shape = (g, nb, 4 if bits == 4 else 8, TILE_COLUMNS, 4)
    in_place = (
        in_place
        and bits == 8
        and codes.dtype == np.uint8
        and codes.flags.c_contiguous
        and codes.flags.writeable
    )
    tiles = codes.reshape(shape) if in_place else np.empty(shape, np.uint8)
    # tiles filled ~16 MB at a time (4 MB in place: the chunk's copy is the only temporary)
    step = max(1, (1 << (22 if in_place else 24)) // (TILE_COLUMNS * k))
    for a in range(0, g, step):
        part = codes[a * TILE_COLUMNS : (a + step) * TILE_COLUMNS]
        part = part.copy() if in_place else part.astype(np.uint8, copy=False)
        if bits == 4:
            c = part.reshape(-1, TILE_COLUMNS, nb, 4, 2, 4)
            tiles[a : a + step] = (c[:, :, :, :, 0] | (c[:, :, :, :, 1] << 4)).transpose(0, 2, 3, 1, 4)
        else:
            tiles[a : a + step] = part.reshape(-1, TILE_COLUMNS, nb, 8, 4).transpose(0, 2, 3, 1, 4)
    return tiles


def vector_loops() -> bool:
    """The library was built with the vector loops (AVX2 or AVX-512), which make the many-row layout."""
    lib = load()
    return lib is not None and bool(lib.quantized_matmul_vectorized())


def q4_k_tiles() -> bool:
    """The library's vector loops multiply Q4_K and Q5_K in their own tiles (NativeMatmul.q4_k, q5_k): the
    AVX2 and AVX-512 levels' (the portable level keeps Q4_K in the float16-scale 4-bit layout, Q5_K in the
    8-bit one)."""
    return vector_loops()


def usable(in_features: int, dtype: torch.dtype, device: torch.device) -> bool:
    return (
        device.type == "cpu"
        and dtype in (torch.float32, torch.bfloat16)
        and in_features % 64 == 0
        and load() is not None
    )
