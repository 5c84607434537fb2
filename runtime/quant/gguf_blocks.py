"""GGUF block parsing: a Q4_0 / Q4_1 / Q8_0 matrix read into its block fields (codes, scales, minimums),
dequantized, reordered by rows, or mapped onto the 4-bit form the packed layers multiply by
(runtime.quant.linear)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

GROUP = 32


@dataclass
class GGUFBlocks:
    """A GGUF Q4_0 / Q4_1 / Q8_0 matrix as its block fields, rows in the matrix's row order.
    codes [N, K] (uint8 0..15 for Q4_*, int8 for Q8_0); scale, minimum [N, K / 32] float32."""

    kind: str
    codes: np.ndarray
    scale: np.ndarray
    minimum: np.ndarray | None = None

    @property
    def shape(self) -> tuple[int, int]:
        return self.codes.shape

    @classmethod
    def parse(cls, kind: str, raw: np.ndarray, shape: tuple[int, int]) -> GGUFBlocks:
        """raw: the tensor's bytes as ggml stores them (blocks of 32 along each row)."""
        n, k = shape
        if kind == "Q8_0":
            blocks = raw.reshape(-1).view(np.uint8).reshape(n * k // GROUP, 34)
            scale = blocks[:, :2].copy().view(np.float16).astype(np.float32)
            codes = blocks[:, 2:].copy().view(np.int8)
            return cls(kind, codes.reshape(n, k), scale.reshape(n, k // GROUP))
        size = {"Q4_0": 18, "Q4_1": 20}[kind]
        blocks = raw.reshape(-1).view(np.uint8).reshape(n * k // GROUP, size)
        scale = blocks[:, :2].copy().view(np.float16).astype(np.float32).reshape(n, k // GROUP)
        minimum = None
        if kind == "Q4_1":
            minimum = blocks[:, 2:4].copy().view(np.float16).astype(np.float32).reshape(n, k // GROUP)
        qs = blocks[:, size - 16 :]
        # byte j holds element j in its low nibble and element j + 16 in its high nibble
        codes = np.concatenate([qs & 0x0F, qs >> 4], axis=1)
        return cls(kind, codes.reshape(n, k), scale, minimum)

    def dequantize(self) -> np.ndarray:
        n, k = self.shape
        codes = self.codes.reshape(n, k // GROUP, GROUP).astype(np.float32)
        if self.kind == "Q4_0":
            w = (codes - 8) * self.scale[..., None]
        elif self.kind == "Q4_1":
            w = codes * self.scale[..., None] + self.minimum[..., None]
        else:
            w = codes * self.scale[..., None]
        return w.reshape(n, k)

    def take_rows(self, order: np.ndarray) -> GGUFBlocks:
        def pick(a):
            return None if a is None else np.ascontiguousarray(a[order])

        return GGUFBlocks(self.kind, pick(self.codes), pick(self.scale), pick(self.minimum))

    @staticmethod
    def stack(parts: list[GGUFBlocks]) -> GGUFBlocks | None:
        """Row-wise concatenation (fused projections); None when the parts differ in kind."""
        if len({p.kind for p in parts}) != 1:
            return None

        def cat(xs):
            return None if xs[0] is None else np.concatenate(xs)

        return GGUFBlocks(
            parts[0].kind,
            cat([p.codes for p in parts]),
            cat([p.scale for p in parts]),
            cat([p.minimum for p in parts]),
        )

    def int4_fields(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(codes 0..15 [R, K], scale [R, K/32], zero [R, K/32]) with w = (code - 8) * scale + zero;
        R = 2N for Q8_0 (hi halves, then lo halves)."""
        if self.kind == "Q4_0":
            return self.codes, self.scale, np.zeros_like(self.scale)
        if self.kind == "Q4_1":
            return self.codes, self.scale, self.minimum + 8 * self.scale
        u = self.codes.astype(np.int16) + 128
        codes = np.concatenate([u >> 4, u & 0x0F]).astype(np.uint8)
        scale = np.concatenate([16 * self.scale, self.scale])
        zero = np.concatenate([np.zeros_like(self.scale), 8 * self.scale])
        return codes, scale, zero
