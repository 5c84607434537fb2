"""Weight-only quantized linear layers: the GGUF's own blocks kept packed, or float weights quantized on load.

Every weight is 4-bit codes in groups of 32 along the input dimension, computed
as w = (code - 8) * scale + zero per group, which is exactly what
torch._weight_int4pack_mm_for_cpu multiplies by (a faster kernel than
torch._weight_int8pack_mm, which has one scale per row only).

The GGUF block formats map onto the 4-bit form without loss:
  Q4_0  w = d * (q - 8)     -> code q, scale d, zero 0
  Q4_1  w = d * q + m       -> code q, scale d, zero m + 8d
  Q8_0  w = d * q (8 bits)  -> two 4-bit halves of u = q + 128 stacked as rows:
        w = 16d * (hi - 8) + d * (lo - 8) + 8d, so y = x W_hi^T + x W_lo^T.
The other types (runtime.quant.gguf_blocks) map onto the C kernels' layouts instead, and run there alone
(native_only, NATIVE_ONLY_TYPES: one copy of the blocks, for every row count):
  Q4_K  w = (d sc) q - dmin m  -> the 4-bit layout, scale d sc, offset -dmin m (both rounded to float16); with
        the vector loops (AVX2, AVX-512) 4-bit tiles with its own super-block scales instead (NativeMatmul.q4_k,
        exact)
  Q5_0 / Q5_1 / Q5_K           -> the 8-bit layout, codes 0..31, offset -16d / m / -dmin m; with the vector
        loops 5-bit tiles instead (the low 4 bits as 4-bit tiles, a plane of fifth bits): Q5_0 and Q5_1 with
        their float16 d and m (NativeMatmul.q5), Q5_K with Q4_K's scales (NativeMatmul.q5_k); exact
  Q6_K  w = d sc (q - 32)      -> a 6-bit layout of its own (NativeMatmul.q6_k): codes, sc and d as in the
        file, exact; re-quantized to Q8_0 only where that layout cannot be made (N % 32 != 0) or in a fused
        projection with other 8-bit kinds (GGUFBlocks.stack, kernel_blocks states the bound)
With float32 activations the packed matmul computes the dequantized weights'
function (to float rounding); torch's kernels are fast only with bfloat16
activations, where the scales are rounded to bfloat16 too.

The packed kernel wins where a step is bound by reading weights (a few rows:
decode); with many rows (prefill chunks, large decode batches) a dense bfloat16
matmul may compute faster on CPUs with fast bfloat16. So a GGUF's packed projections may also keep their
blocks dequantized to a dense copy, used from `dense_rows` rows up, where one is asked for
(ModelSettings.dense_copy_bytes) or the C kernels' vector loops (whose many-row loops take prefill rows)
are not built; the model measures that crossover once at load (runtime.quant.routing.measure_dense_rows)
and drops the copies where dense never wins. The copy costs the dense weights' memory again.

For one row (a single stream's decode) a C kernel with 8-bit activations
(runtime.kernels.quantized_matmul) multiplies the same blocks with integer dot products;
it keeps its own copy of the blocks and is used up to `native_rows` rows,
again only where the model measured it faster at load.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from runtime.kernels import quantized_matmul as native_matmul
from runtime.kernels.quantized_matmul import NativeMatmul
from runtime.kernels.stacked_matmul import StackedMatmul
from runtime.quant.gguf_blocks import AFFINE8, GROUP, GGUFBlocks

ALL_ROWS = 1 << 62
"""native_rows of a weight whose one-row kernel takes every row count."""


class Int4Linear:
    """y = x W^T with W as 4-bit codes, a scale and a zero per group of 32 inputs (torch's CPU int4 kernel).
    `halves`: W is the sum of two stacked row blocks (the Q8_0 split)."""

    def __init__(
        self,
        codes: torch.Tensor,
        scale: torch.Tensor,
        zero: torch.Tensor,
        dtype: torch.dtype,
        halves: bool = False,
    ):
        rows, k = codes.shape
        self.dense: torch.Tensor | None = None
        """The same weights dequantized [out, in], used for inputs of `dense_rows` rows or more."""
        self.dense_rows: int | None = None
        self.native: NativeMatmul | None = None
        """The same blocks for the C kernel with 8-bit activations, used for inputs of up to `native_rows`
        rows."""
        self.native_rows: int | None = None
        self.gemm_rows: int | None = None
        """From this many rows up, the C kernel's many-row loops (native.gemm) where they measured faster."""
        self.out_features = rows // 2 if halves else rows
        self.in_features = k
        self.halves = halves
        self.dtype = dtype
        self.packed: torch.Tensor | None = torch._convert_weight_to_int4pack_for_cpu(
            codes.to(torch.int32).contiguous(), 2
        )
        # [K / group, rows, 2]: scale and zero of each group for each output row
        self.scales_and_zeros = torch.stack([scale.t(), zero.t()], dim=-1).to(dtype).contiguous()
        self.nbytes = (
            self.packed.numel() * self.packed.element_size()
            + self.scales_and_zeros.numel() * self.scales_and_zeros.element_size()
        )

    @classmethod
    def native_only(cls, native: NativeMatmul, dtype: torch.dtype) -> Int4Linear:
        """A weight the C kernels alone multiply, at every row count (no copy for torch's int4 kernel, no
        dense copy), in the one layout `native` holds: the many-row loops' tiles where made (gemm_rows 1),
        else the one-row kernel's (native_rows: all); runtime.quant.routing.measure_row_paths says the same."""
        w = cls.__new__(cls)
        w.dense, w.dense_rows, w.packed, w.scales_and_zeros = None, None, None, None
        w.native, w.dtype, w.halves = native, dtype, False
        w.out_features, w.in_features = native.out_features, native.in_features
        w.native_rows, w.gemm_rows = (ALL_ROWS, None) if native.tiles is None else (None, 1)
        w.nbytes = native.nbytes + native.tiled_nbytes
        return w

    def native_path(self, rows: int) -> str | None:
        """The C kernel that takes this many rows: 'one-row' (up to native_rows), 'many-row' (from gemm_rows),
        or None (the dense copy or torch's packed kernel). csrc/decode_layers.c routes by the same rule. A
        weight the C kernels alone hold (native_only) always gets the layout it has."""
        one_row = many_row = True
        if self.packed is None:  # native_only: only the layouts it has
            one_row, many_row = self.native.one_row, self.native.tiles is not None
        if self.native_rows is not None and rows <= self.native_rows and one_row:
            return "one-row"
        if self.gemm_rows is not None and rows >= self.gemm_rows and many_row:
            return "many-row"
        if self.packed is None:
            return "many-row" if many_row else "one-row"
        return None

    def silu_mul_into(self, x: torch.Tensor, out: torch.Tensor) -> bool:
        """For a fused [gate; up] weight: out [rows, out / 2] = SiLU(gate) x up of x [rows, in], in the many-row
        kernel's epilogue, where x's rows take that kernel (csrc/decode_layers.c does the same); False where
        they do not, and the caller multiplies and runs the layer op (the same values either way)."""
        if (
            self.native_path(x.shape[0]) != "many-row"
            or self.out_features % 64
            or isinstance(self.native, StackedMatmul)
        ):
            return False
        self.native.gemm(x, silu=True, out=out)
        return True

    def __call__(self, x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """x [..., in] -> [..., out] in out_dtype (default: x's). The C kernel takes float32 or bfloat16 x as
        it is; the dense copy and torch's packed kernel take x in the weights' dtype."""
        lead = x.shape[:-1]
        x = x.reshape(-1, self.in_features)
        rows = x.shape[0]
        path = self.native_path(rows)
        if path == "one-row":
            return self.native(x, out_dtype=out_dtype).view(*lead, self.out_features)
        if path == "many-row":
            return self.native.gemm(x, out_dtype=out_dtype).view(*lead, self.out_features)
        out_dtype = out_dtype or x.dtype
        x = x.to(self.scales_and_zeros.dtype)
        if self.dense_rows is not None and rows >= self.dense_rows:
            return F.linear(x, self.dense).to(out_dtype).view(*lead, self.out_features)
        y = torch._weight_int4pack_mm_for_cpu(x, self.packed, GROUP, self.scales_and_zeros)
        if self.halves:
            y = y[:, : self.out_features] + y[:, self.out_features :]
        return y.to(out_dtype).view(*lead, self.out_features)


class BlockEmbedding:
    """An embedding table kept in blocks; `table[ids]` dequantizes just those rows. From its GGUFBlocks
    (exact), or from the C kernels' copy of them (NativeMatmul: the same bytes a tied LM head multiplies by,
    so the table is held once; exact for Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0, the K-quants' scales rounded to
    float16 as the kernels round them)."""

    def __init__(self, blocks: GGUFBlocks | NativeMatmul, dtype: torch.dtype):
        self.dtype = dtype
        self.blocks = blocks

    def __getitem__(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1)
        if isinstance(self.blocks, NativeMatmul):
            rows = self.blocks.dequantize_rows(flat)
        else:
            rows = torch.from_numpy(self.blocks.take_rows(flat.numpy()).dequantize())
        return rows.view(*ids.shape, -1).to(self.dtype)


def linear(x: torch.Tensor, w: torch.Tensor | Int4Linear) -> torch.Tensor:
    """x W^T for a dense weight tensor or a packed one."""
    return F.linear(x, w) if isinstance(w, torch.Tensor) else w(x)


def weight_nbytes(w: torch.Tensor | Int4Linear) -> int:
    """Bytes a one-row multiplication reads (on the path Int4Linear routes one row to)."""
    if isinstance(w, torch.Tensor):
        return w.numel() * w.element_size()
    if w.native_rows:
        return w.native.nbytes
    if w.gemm_rows == 1:
        return w.native.tiled_nbytes
    return w.nbytes


NATIVE_ONLY_TYPES = ("Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K", AFFINE8)
"""Types pack_gguf gives the C kernels alone (Int4Linear.native_only) where they are built: no copy for
torch's int4 kernel and no dense one, so the packed model holds about the file's bytes (the bound in
tests/bench/gguf_load_memory.py). Q4_0 / Q4_1 / Q8_0 go the same way where the kernels' vector loops are
built and the tiles can be made, unless a dense copy is asked for; elsewhere they keep every path,
measured at load."""
TILED_ONLY_TYPES = ("Q4_0", "Q4_1", "Q8_0")


def pack_native(
    blocks: GGUFBlocks, dtype: torch.dtype, tiles: bool = True, consume: bool = False
) -> Int4Linear:
    """The blocks for the C kernels alone (Int4Linear.native_only), in one layout: the many-row kernel's
    where `tiles` and it can be made, else the one-row kernel's; Q6_K in its 6-bit tiles where N % 32 == 0
    (the only layout it has there), else re-quantized (kernel_blocks).
    `consume`: the blocks' codes may be overwritten (a Q8_0 table's move to unsigned codes, and its tiles,
    in place)."""
    pairs = blocks.shape[0] % (2 * native_matmul.TILE_COLUMNS) == 0  # whole column pairs: the tiles' shape
    if blocks.kind == "Q6_K" and pairs:
        return Int4Linear.native_only(NativeMatmul.q6_k(*blocks.q6_k_fields()), dtype)
    if (
        blocks.kind in ("Q4_K", "Q5_K")
        and tiles
        and pairs
        and blocks.super_minimum is not None
        and native_matmul.q4_k_tiles()
    ):
        make = NativeMatmul.q4_k if blocks.kind == "Q4_K" else NativeMatmul.q5_k
        return Int4Linear.native_only(make(*blocks.q4_k_fields()), dtype)
    if blocks.kind in ("Q5_0", "Q5_1") and tiles and pairs and native_matmul.vector_loops():
        codes, scale, offset, _ = blocks.affine(factor=True)
        return Int4Linear.native_only(NativeMatmul.q5(codes, scale, offset), dtype)
    affine = blocks.kernel_blocks().affine(in_place=consume, factor=True)
    native = NativeMatmul(*affine, tiles=tiles, one_row=not tiles, consume=consume)
    return Int4Linear.native_only(native, dtype)


def pack_stacked(parts: list, dtype: torch.dtype, device: torch.device) -> Int4Linear | None:
    """A fused projection whose parts are GGUF blocks of different kinds (a K-quant mix's q, k in Q4_K and v
    in Q6_K), each part in the many-row kernel's tiles of its own kind (StackedMatmul): no part widened, none
    re-quantized. None where the parts share a kind or the tiles cannot be made (the caller stacks them into
    one form, or de-quantizes)."""
    if not (
        len(parts) > 1
        and all(isinstance(p, GGUFBlocks) for p in parts)
        and len({p.kind for p in parts}) > 1
        and native_matmul.usable(parts[0].shape[1], dtype, device)
        and native_matmul.vector_loops()
        and all(
            p.shape[0] % (2 * native_matmul.TILE_COLUMNS) == 0
            and p.shape[1] % GROUP == 0
            and p.fits_float16()
            for p in parts
        )
    ):
        return None
    return Int4Linear.native_only(StackedMatmul([pack_native(p, dtype).native for p in parts]), dtype)


def pack_gguf(blocks: GGUFBlocks, dtype: torch.dtype, dense: bool = False) -> Int4Linear:
    """The GGUF's blocks as they are, for the C kernels alone (NATIVE_ONLY_TYPES, pack_native) where they are
    built, else in the int4 kernel's layout and the C kernels' (Q6_K re-quantized to Q8_0 there,
    GGUFBlocks.kernel_blocks); `dense`: also a dequantized copy (exact, Q6_K included), with every path."""
    if native_matmul.usable(blocks.shape[1], dtype, torch.device("cpu")) and (
        blocks.kind in NATIVE_ONLY_TYPES
        or (
            blocks.kind in TILED_ONLY_TYPES
            and not dense
            and blocks.shape[0] % (2 * native_matmul.TILE_COLUMNS) == 0
            and native_matmul.vector_loops()
        )
    ):
        return pack_native(blocks, dtype)
    kernel = blocks.kernel_blocks()
    codes, scale, zero = kernel.int4_fields()
    packed = Int4Linear(
        torch.from_numpy(codes),
        torch.from_numpy(scale),
        torch.from_numpy(zero),
        dtype,
        halves=codes.shape[0] != blocks.shape[0],
    )
    if dense:
        packed.dense = torch.from_numpy(blocks.dequantize()).to(dtype)
    if native_matmul.usable(packed.in_features, dtype, torch.device("cpu")):
        packed.native = NativeMatmul(*kernel.affine())
    return packed


def quantize_int4(w: torch.Tensor, dtype: torch.dtype) -> Int4Linear:
    """Asymmetric 4-bit per group of 32: the group's min..max onto codes 0..15."""
    n, k = w.shape
    g = w.float().reshape(n, k // GROUP, GROUP)
    lo, hi = g.amin(-1), g.amax(-1)
    scale = ((hi - lo) / 15).clamp_min(1e-8)
    codes = ((g - lo[..., None]) / scale[..., None]).round().clamp(0, 15).reshape(n, k)
    packed = Int4Linear(codes, scale, lo + 8 * scale, dtype)
    if native_matmul.usable(k, dtype, torch.device("cpu")):
        packed.native = NativeMatmul(codes.to(torch.uint8).numpy(), scale.numpy(), lo.numpy(), 4)
    return packed


def quantize_int8(w: torch.Tensor, dtype: torch.dtype) -> Int4Linear:
    """Symmetric int8 per group of 32 (Q8_0's layout), run as two stacked 4-bit halves."""
    n, k = w.shape
    g = w.float().reshape(n, k // GROUP, GROUP)
    scale = (g.abs().amax(-1) / 127).clamp_min(1e-8)
    codes = (g / scale[..., None]).round().clamp(-127, 127).to(torch.int8).reshape(n, k)
    return pack_gguf(GGUFBlocks("Q8_0", codes.numpy(), scale.numpy()), dtype)
