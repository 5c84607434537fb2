"""A fused projection whose parts are blocks of different kinds, each kept in its own layout.

K-quant files mix types inside what the model fuses: a Q4_K_M file holds q and k
in Q4_K and v in Q6_K for some layers (gate and up, down likewise in other
mixes). One layout for all of them would cost bytes (the 4-bit parts widened to 8
bits) or exactness (Q6_K re-quantized). Instead each part keeps the many-row
kernel's tiles of its own kind and writes its own columns of one output
(quantized_gemm's output stride), so a decode step reads each weight byte once,
as the file holds it. csrc/decode_layers.c walks the same parts.
"""

from __future__ import annotations

import torch

from runtime.kernels.quantized_matmul import NativeMatmul


class StackedMatmul:
    """y = x [W_0; W_1; ...]^T, the W_i NativeMatmuls with tiles (the many-row kernel takes every row count);
    the subset of NativeMatmul's interface the packed linear layers use."""

    one_row = False

    def __init__(self, parts: list[NativeMatmul]):
        assert parts and all(p.tiles is not None for p in parts), "every part in the many-row kernel's tiles"
        assert len({p.in_features for p in parts}) == 1
        self.parts = parts
        self.in_features = parts[0].in_features
        self.out_features = sum(p.out_features for p in parts)
        self.nbytes = sum(p.nbytes for p in parts)
        self.bits = None
        """No one width: each part has its own."""

    @property
    def tiles(self) -> tuple:
        """The parts' tiles (every part has them)."""
        return tuple(p.tiles for p in self.parts)

    @property
    def tiled_nbytes(self) -> int:
        return sum(p.tiled_nbytes for p in self.parts)

    def gemm(
        self,
        x: torch.Tensor,
        out_dtype: torch.dtype | None = None,
        portable: bool = False,
        silu: bool = False,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """x [M, K] -> [M, N], each part into its columns (NativeMatmul.gemm; no fused SiLU epilogue)."""
        assert not silu, "the SiLU epilogue pairs gate and up columns of one layout"
        x = x.contiguous()
        m = x.shape[0]
        if out is None:
            out = torch.empty(m, self.out_features, dtype=out_dtype or x.dtype)
        assert out.shape == (m, self.out_features) and out.is_contiguous()
        column = 0
        for p in self.parts:
            p.gemm(x, portable=portable, out=out[:, column : column + p.out_features])
            column += p.out_features
        return out

    __call__ = gemm

    def dequantize_rows(self, ids: torch.Tensor) -> torch.Tensor:
        starts = [0]
        for p in self.parts:
            starts.append(starts[-1] + p.out_features)
        out = torch.empty(ids.shape[0], self.in_features)
        for i, p in enumerate(self.parts):
            mine = (ids >= starts[i]) & (ids < starts[i + 1])
            if mine.any():
                out[mine] = p.dequantize_rows(ids[mine] - starts[i])
        return out
