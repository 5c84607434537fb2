"""GGUF block parsing: a Q4_0 / Q4_1 / Q8_0 / Q5_0 / Q5_1 / Q4_K / Q5_K / Q6_K matrix read into its block
fields (codes, scales, offsets) in numpy, dequantized exactly as ggml does, reordered by rows, or mapped onto
the affine forms the packed layers multiply by (runtime.quant.linear).

Every type becomes codes with a scale and (for the asymmetric types) an offset per group of inputs:
  Q4_0  w = d * (q - 8)               groups of 32, q 0..15
  Q4_1  w = d * q + m                 groups of 32, q 0..15
  Q8_0  w = d * q                     groups of 32, q -128..127 (int8)
  Q5_0  w = d * (q - 16)              groups of 32, q 0..31
  Q5_1  w = d * q + m                 groups of 32, q 0..31
  Q4_K  w = (d sc) * q - (dmin m)     groups of 32 inside super-blocks of 256, q 0..15, sc and m 6-bit
  Q5_K  w = (d sc) * q - (dmin m)     the same with q 0..31
  Q6_K  w = (d sc) * (q - 32)         groups of 16 inside super-blocks of 256, q 0..63, sc int8
The products d sc and dmin m are formed in float32 as ggml forms them, so `dequantize` equals ggml's (and
gguf-py's) bit for bit. Q6_K's groups of 16 fit no layout of groups of 32: the C kernels keep it in a 6-bit
layout of its own (`q6_k_fields`, runtime.kernels.quantized_matmul.NativeMatmul.q6_k); where those are not
used `kernel_blocks` re-quantizes it to Q8_0 (see there for the bound).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

GROUP = 32
SUPER = 256
"""Elements per K-quant super-block."""

BLOCK_BYTES = {
    "Q4_0": 18,
    "Q4_1": 20,
    "Q8_0": 34,
    "Q5_0": 22,
    "Q5_1": 24,
    "Q4_K": 144,
    "Q5_K": 176,
    "Q6_K": 210,
}
BLOCK_ELEMENTS = {k: SUPER if k.endswith("_K") else GROUP for k in BLOCK_BYTES}
TYPES = tuple(BLOCK_BYTES)
CENTER = {"Q4_0": 8, "Q5_0": 16, "Q6_K": 32}
"""Symmetric types: w = scale * (code - center)."""
FOUR_BIT = ("Q4_0", "Q4_1", "Q4_K")
AFFINE8 = "AFFINE8"
"""Not a GGUF type: codes 0..255, w = scale * code + minimum per group of 32, the form the C kernels' 8-bit
layout takes; what fused projections whose parts differ in 8-bit kinds are stacked as (GGUFBlocks.stack)."""
EIGHT_BIT = ("Q8_0", "Q5_0", "Q5_1", "Q5_K", "Q6_K", AFFINE8)


def group_size(kind: str) -> int:
    """Inputs sharing one scale (and offset): 16 for Q6_K, 32 for every other type."""
    return 16 if kind == "Q6_K" else GROUP


def _f16(b: np.ndarray, widen: bool = True) -> np.ndarray:
    """Two bytes per row -> the float16 they hold, [rows]; `widen`: as float32."""
    h = np.ascontiguousarray(b).view(np.float16).reshape(-1)
    return h.astype(np.float32) if widen else h


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """[blocks, 16 * n] bytes -> [blocks, n, 32]: low nibbles of each 16 (or 32) bytes, then the high."""
    return np.stack([qs & 0x0F, qs >> 4], axis=-2)


def _k_scales(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K's 12 packed bytes -> 8 scales and 8 minimums (6 bits each) per super-block."""
    s = scales.reshape(-1, 3, 4)
    a, b, c = s[:, 0], s[:, 1], s[:, 2]
    sc = np.concatenate([a & 0x3F, (c & 0x0F) | ((a >> 6) << 4)], axis=1)
    m = np.concatenate([b & 0x3F, (c >> 4) | ((b >> 6) << 4)], axis=1)
    return sc, m


@dataclass
class GGUFBlocks:
    """A GGUF matrix as its block fields, rows in the matrix's row order. codes [N, K] (uint8; int8 for
    Q8_0); scale and minimum [N, K / group] (group 16 for Q6_K, else 32): float16 as the file stores them
    for Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 (every product with them is formed in float32), float32 for the
    K-quants' products (and wherever a caller gives float32); minimum is the additive
    offset of the asymmetric types (Q4_1, Q5_1, Q4_K, Q5_K: for the K-quants -dmin m), else None.
    super_scale: the K-quants' d [N, K / 256] (float32 of its float16), which their scale d sc holds exactly
    as a multiple of (q6_k_fields, q4_k_fields), else None. super_minimum: Q4_K / Q5_K's dmin likewise, of
    which -minimum is a multiple, else None."""

    kind: str
    codes: np.ndarray
    scale: np.ndarray
    minimum: np.ndarray | None = None
    super_scale: np.ndarray | None = None
    super_minimum: np.ndarray | None = None

    @property
    def shape(self) -> tuple[int, int]:
        return self.codes.shape

    @property
    def group(self) -> int:
        return group_size(self.kind)

    @classmethod
    def parse(cls, kind: str, raw: np.ndarray, shape: tuple[int, int]) -> GGUFBlocks:
        """raw: the tensor's bytes as ggml stores them (blocks along each row)."""
        n, k = shape
        size, per = BLOCK_BYTES[kind], BLOCK_ELEMENTS[kind]
        if k % per:
            raise ValueError(f"{kind}: row width {k} is not a multiple of its block of {per}")
        b = raw.reshape(-1).view(np.uint8).reshape(n * k // per, size)
        nb = b.shape[0]
        minimum = super_scale = super_minimum = None
        if kind == "Q8_0":
            codes, scale = b[:, 2:].view(np.int8), _f16(b[:, :2], widen=False)
        elif kind in ("Q4_0", "Q4_1"):
            scale = _f16(b[:, :2], widen=False)
            if kind == "Q4_1":
                minimum = _f16(b[:, 2:4], widen=False)
            codes = _nibbles(b[:, size - 16 :])
        elif kind in ("Q5_0", "Q5_1"):
            scale = _f16(b[:, :2], widen=False)
            if kind == "Q5_1":
                minimum = _f16(b[:, 2:4], widen=False)
            at = 4 if kind == "Q5_1" else 2
            qh = np.ascontiguousarray(b[:, at : at + 4]).view(np.uint32).reshape(nb, 1)
            high = ((qh >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)
            codes = _nibbles(b[:, at + 4 :]).reshape(nb, 32) | (high << 4)
        elif kind in ("Q4_K", "Q5_K"):
            d, dmin = _f16(b[:, :2])[:, None], _f16(b[:, 2:4])[:, None]
            super_scale, super_minimum = d.reshape(n, k // SUPER), dmin.reshape(n, k // SUPER)
            sc, m = _k_scales(b[:, 4:16])
            scale = (d * sc.astype(np.float32)).reshape(-1)
            minimum = -(dmin * m.astype(np.float32)).reshape(-1)
            if kind == "Q4_K":  # 4 chunks of 32 bytes: sub-block 2c in the low nibbles, 2c + 1 in the high
                codes = _nibbles(b[:, 16:].reshape(nb, 4, 32))
            else:  # bit j of qh[l] is the fifth bit of sub-block j's element l
                qh = b[:, 16:48].reshape(nb, 1, 32)
                high = ((qh >> np.arange(8, dtype=np.uint8)[:, None]) & 1).reshape(nb, 4, 2, 32)
                codes = _nibbles(b[:, 48:].reshape(nb, 4, 32)) | (high << 4)
        elif kind == "Q6_K":  # ql[128] qh[64] scales[16] d: halves of 128, each 4 runs of 32
            d = _f16(b[:, 208:210])[:, None]
            super_scale = d.reshape(n, k // SUPER)
            scale = (d * b[:, 192:208].view(np.int8).astype(np.float32)).reshape(-1)
            ql = b[:, :128].reshape(nb, 2, 1, 64)
            low = np.concatenate([ql & 0x0F, ql >> 4], axis=2).reshape(nb, 2, 4, 32)
            qh = b[:, 128:192].reshape(nb, 2, 1, 32)
            high = (qh >> (2 * np.arange(4, dtype=np.uint8))[:, None]) & 3
            codes = low | (high << 4)
        else:
            raise ValueError(f"GGUF type {kind} is not parsed into blocks")
        codes = np.ascontiguousarray(codes).reshape(n, k)
        groups = k // group_size(kind)
        scale = scale.reshape(n, groups)
        minimum = None if minimum is None else minimum.reshape(n, groups)
        return cls(kind, codes, scale, minimum, super_scale, super_minimum)

    def dequantize(self) -> np.ndarray:
        """float32 [N, K], equal to ggml's de-quantization bit for bit."""
        n, k = self.shape
        g = self.group
        codes = self.codes.reshape(n, k // g, g)
        scale = self.scale.astype(np.float32, copy=False)[..., None]
        if self.kind in CENTER:
            w = scale * (codes.astype(np.int16) - CENTER[self.kind]).astype(np.float32)
        elif self.minimum is not None:
            w = scale * codes.astype(np.float32) + self.minimum.astype(np.float32, copy=False)[..., None]
        else:
            w = scale * codes.astype(np.float32)
        return w.reshape(n, k)

    def take_rows(self, order: np.ndarray) -> GGUFBlocks:
        def pick(a):
            return None if a is None else np.ascontiguousarray(a[order])

        return GGUFBlocks(
            self.kind,
            pick(self.codes),
            pick(self.scale),
            pick(self.minimum),
            pick(self.super_scale),
            pick(self.super_minimum),
        )

    @staticmethod
    def stack(parts: list[GGUFBlocks]) -> GGUFBlocks | None:
        """Row-wise concatenation (fused projections). Parts of different 8-bit-layout kinds (Q8_0, Q5_0,
        Q5_1, Q5_K, Q6_K: a K-quant file's q, k and v often differ) are stacked in the AFFINE8 form
        (to_affine8); None when the parts cannot share a form (4-bit and 8-bit)."""
        if len({p.kind for p in parts}) != 1:
            if not all(p.kind in EIGHT_BIT for p in parts):
                return None
            parts = [p.to_affine8() for p in parts]

        def cat(xs):
            return None if xs[0] is None else np.concatenate(xs)

        return GGUFBlocks(
            parts[0].kind,
            cat([p.codes for p in parts]),
            cat([p.scale for p in parts]),
            cat([p.minimum for p in parts]),
            cat([p.super_scale for p in parts]),
            cat([p.super_minimum for p in parts]),
        )

    def q6_k_fields(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Q6_K as the file holds it: (codes 0..63 [N, K], sc int8 [N, K / 16], d float16 [N, K / 256]), w =
        d * sc * (code - 32). sc is scale / d, exact: d sc is exact in float32 (11 by 8 significant bits)."""
        assert self.kind == "Q6_K" and self.super_scale is not None
        n, k = self.shape
        d = np.repeat(self.super_scale, SUPER // 16, axis=1)
        sc = np.divide(self.scale, d, out=np.zeros_like(self.scale), where=d != 0)
        return self.codes, np.rint(sc).astype(np.int8), self.super_scale.astype(np.float16)

    def q4_k_fields(self) -> tuple[np.ndarray, ...]:
        """Q4_K or Q5_K as the file holds it: (codes 0..15 or 0..31 [N, K], sc and m uint8 [N, K / 32] (6 bits
        each), d and dmin float16 [N, K / 256]), w = d sc code - dmin m, as ggml de-quantizes it. sc is scale / d
        and m is -minimum / dmin, exact (d sc and dmin m are exact in float32)."""
        assert self.kind in ("Q4_K", "Q5_K") and self.super_minimum is not None
        d = np.repeat(self.super_scale, SUPER // GROUP, axis=1)
        dmin = np.repeat(self.super_minimum, SUPER // GROUP, axis=1)
        sc = np.divide(self.scale, d, out=np.zeros_like(self.scale), where=d != 0)
        m = np.divide(-self.minimum, dmin, out=np.zeros_like(self.minimum), where=dmin != 0)
        f16 = np.float16
        return (
            self.codes,
            np.rint(sc).astype(np.uint8),
            np.rint(m).astype(np.uint8),
            self.super_scale.astype(f16),
            self.super_minimum.astype(f16),
        )

    def kernel_blocks(self) -> GGUFBlocks:
        """These blocks in groups of 32, as the kernels take them: itself for every type but Q6_K, which is
        re-quantized to Q8_0 (symmetric 8 bits per 32, the scale rounded up to a float16 so the kernels hold
        it exactly): each weight moves by at most half that scale, max|w| / 254 over its group of 32 (up to
        float16's rounding up, 2^-10), i.e. at most 16/127 (about 1/8) of the largest Q6_K step (d |sc|) in
        those 32 inputs, since max|w| <= 32 d |sc| (tests/runtime/test_kquant_kernels.py)."""
        if self.kind != "Q6_K":
            return self
        n, k = self.shape
        w = self.dequantize().reshape(n, k // GROUP, GROUP)
        amax = np.abs(w).max(axis=-1)
        scale = (amax / 127).astype(np.float16)
        low = scale.astype(np.float32) * 127 < amax
        scale[low] = np.nextafter(scale[low], np.float16(np.inf))
        scale = scale.astype(np.float32)
        inv = np.divide(1, scale, out=np.zeros_like(scale), where=scale > 0)
        codes = np.clip(np.rint(w * inv[..., None]), -127, 127).astype(np.int8).reshape(n, k)
        return GGUFBlocks("Q8_0", codes, scale)

    def to_affine8(self) -> GGUFBlocks:
        """These blocks (an 8-bit-layout kind) as AFFINE8; Q6_K re-quantized first (kernel_blocks). Exact for
        Q8_0 and Q5_0 (their d is a float16, so d * code and the offset -128 d or -16 d are exact)."""
        codes, scale, offset, bits = self.kernel_blocks().affine()
        assert bits == 8
        return GGUFBlocks(AFFINE8, codes, scale, offset)

    def fits_float16(self) -> bool:
        """The kernels' float16 scales and offsets hold this matrix's (finite; a K-quant's d sc or dmin m can
        exceed float16's range, where the matrix is de-quantized instead)."""
        fields = [self.scale] + ([] if self.minimum is None else [self.minimum])
        limit = float(np.finfo(np.float16).max) / (128 if self.kind in ("Q8_0", "Q6_K", AFFINE8) else 32)
        return all(float(np.abs(f).max(initial=0)) <= limit for f in fields)

    def affine(
        self, in_place: bool = False, factor: bool = False
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray | float, int]:
        """(codes [N, K] unsigned, scale, offset [N, K / 32], bits) with w = scale * code + offset: the C
        kernels' layout (runtime.kernels.quantized_matmul). bits 4: codes 0..15; bits 8: codes 0..255 (Q8_0's
        code + 128; the 5-bit types' codes 0..31 as they are). Groups of 32 (kernel_blocks first for Q6_K).
        `in_place`: Q8_0's codes become unsigned in their own memory (these blocks are spent). `factor`: a
        symmetric type's offset (Q8_0, Q4_0, Q5_0) as the number c with offset = c * scale, no array made
        (NativeMatmul takes either)."""
        assert self.group == GROUP, "kernel_blocks() first"
        bits = 4 if self.kind in FOUR_BIT else 8
        if self.kind == AFFINE8:
            return self.codes, self.scale, self.minimum, 8
        if self.kind == "Q8_0":
            if in_place:  # q + 128 mod 256 is q's bits with the top one flipped
                unsigned = self.codes.view(np.uint8)
                unsigned ^= 0x80
            else:
                unsigned = (self.codes.astype(np.int16) + 128).astype(np.uint8)
            return unsigned, self.scale, -128.0 if factor else -128 * self.scale, 8
        if self.minimum is not None:
            return self.codes, self.scale, self.minimum, bits
        c = -CENTER[self.kind]
        return self.codes, self.scale, float(c) if factor else c * self.scale, bits

    def int4_fields(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(codes 0..15 [R, K], scale [R, K/32], zero [R, K/32]) with w = (code - 8) * scale + zero (torch's
        int4 kernel); R = 2N for the 8-bit types: u = hi * 16 + lo, w = 16s (hi - 8) + [s (lo - 8) + o + 136s],
        the hi halves' rows, then the lo halves'."""
        codes, scale, offset, bits = self.affine()
        scale, offset = scale.astype(np.float32, copy=False), offset.astype(np.float32, copy=False)
        if bits == 4:
            return codes, scale, offset + 8 * scale
        codes = np.concatenate([codes >> 4, codes & 0x0F])
        return (
            codes,
            np.concatenate([16 * scale, scale]),
            np.concatenate([np.zeros_like(scale), offset + 136 * scale]),
        )
