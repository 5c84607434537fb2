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
With float32 activations the packed matmul computes the dequantized weights'
function (to float rounding); torch's kernels are fast only with bfloat16
activations, where the scales are rounded to bfloat16 too.

The packed kernel wins where a step is bound by reading weights (a few rows:
decode); with many rows (prefill chunks, large decode batches) a dense bfloat16
matmul computes faster on CPUs with fast bfloat16. So a GGUF's packed projections may also keep their blocks
dequantized to a dense copy, used from `dense_rows` rows up; the model measures
that crossover once at load (measure_dense_rows) and drops the copies where
dense never wins. The copy costs the dense weights' memory again.

For one row (a single stream's decode) a C kernel with 8-bit activations
(runtime.kernels.quantized_matmul) multiplies the same blocks with integer dot products;
it keeps its own copy of the blocks and is used up to `native_rows` rows,
again only where the model measured it faster at load.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import torch
import torch.nn.functional as F

from runtime.kernels import quantized_matmul as native_matmul
from runtime.kernels.quantized_matmul import NativeMatmul

GROUP = 32
QUANTIZATIONS = ("auto", "none", "gguf", "int8", "int4")
"""auto: keep the GGUF's blocks packed on CPU where they are fast (bfloat16 activations; or float32 chosen
by dtype 'auto', where the C kernel with 8-bit activations measured faster than the dense matmul at one
row, packed_measures_faster), else dequantize; none: dequantize everything; gguf: keep the GGUF's blocks
in any dtype; int8 / int4: quantize float weights on load to 8 bits (symmetric) or 4 bits (min/max) per
group of 32 (a GGUF's blocks are dequantized first; under int4 the LM head gets 8 bits: at 4 it alone
costs measurable perplexity on this model, tests/bench/perplexity.py)."""


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
        self.packed = torch._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32).contiguous(), 2)
        # [K / group, rows, 2]: scale and zero of each group for each output row
        self.scales_and_zeros = torch.stack([scale.t(), zero.t()], dim=-1).to(dtype).contiguous()
        self.nbytes = (
            self.packed.numel() * self.packed.element_size()
            + self.scales_and_zeros.numel() * self.scales_and_zeros.element_size()
        )

    def native_path(self, rows: int) -> str | None:
        """The C kernel that takes this many rows: 'one-row' (up to native_rows), 'many-row' (from gemm_rows),
        or None (the dense copy or torch's packed kernel). csrc/decode_layers.c routes by the same rule."""
        if self.native_rows is not None and rows <= self.native_rows:
            return "one-row"
        if self.gemm_rows is not None and rows >= self.gemm_rows:
            return "many-row"
        return None

    def silu_mul_into(self, x: torch.Tensor, out: torch.Tensor) -> bool:
        """For a fused [gate; up] weight: out [rows, out / 2] = SiLU(gate) x up of x [rows, in], in the many-row
        kernel's epilogue, where x's rows take that kernel (csrc/decode_layers.c does the same); False where
        they do not, and the caller multiplies and runs the layer op (the same values either way)."""
        if self.native_path(x.shape[0]) != "many-row" or self.out_features % 64:
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
    """An embedding table kept in its GGUF blocks; `table[ids]` dequantizes just those rows."""

    def __init__(self, blocks: GGUFBlocks, dtype: torch.dtype):
        self.dtype = dtype
        self.offset = 0 if blocks.kind == "Q8_0" else 8
        self.codes = torch.from_numpy(blocks.codes)
        self.scale = torch.from_numpy(blocks.scale)
        zero = np.zeros_like(blocks.scale) if blocks.kind == "Q8_0" else blocks.int4_fields()[2]
        self.zero = torch.from_numpy(zero)

    def __getitem__(self, ids: torch.Tensor) -> torch.Tensor:
        n = ids.shape[0]
        codes = self.codes[ids].view(n, -1, GROUP).float() - self.offset
        rows = codes * self.scale[ids].unsqueeze(-1) + self.zero[ids].unsqueeze(-1)
        return rows.view(n, -1).to(self.dtype)


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


def pack_gguf(blocks: GGUFBlocks, dtype: torch.dtype, dense: bool = False) -> Int4Linear:
    """The GGUF's blocks as they are, in the int4 kernel's layout; `dense`: also a dequantized copy."""
    codes, scale, zero = blocks.int4_fields()
    packed = Int4Linear(
        torch.from_numpy(codes),
        torch.from_numpy(scale),
        torch.from_numpy(zero),
        dtype,
        halves=blocks.kind == "Q8_0",
    )
    if dense:
        packed.dense = torch.from_numpy(blocks.dequantize()).to(dtype)
    if native_matmul.usable(packed.in_features, dtype, torch.device("cpu")):
        packed.native = (
            NativeMatmul.from_q8(blocks.codes, blocks.scale)
            if blocks.kind == "Q8_0"
            else NativeMatmul.from_int4_fields(codes, scale, zero)
        )
    return packed


DENSE_ROW_CANDIDATES = (8, 16, 32, 64, 128, 256)


def measure_dense_rows(w: Int4Linear, rounds: int = 5) -> int | None:
    """The fewest rows (of DENSE_ROW_CANDIDATES) from which w's dense copy multiplied faster than its packed
    blocks in median seconds, packed and dense interleaved so load elsewhere hits both; None: never."""
    if w.dense is None:
        return None
    for rows in DENSE_ROW_CANDIDATES:
        x = torch.randn(rows, w.in_features).to(w.dense.dtype)
        packed, dense = [], []
        w.dense_rows = None
        w(x)
        F.linear(x, w.dense)
        for _ in range(rounds):
            start = time.perf_counter()
            w(x)
            packed.append(time.perf_counter() - start)
            start = time.perf_counter()
            F.linear(x, w.dense)
            dense.append(time.perf_counter() - start)
        if statistics.median(dense) < statistics.median(packed):
            return rows
    return None


ROW_CANDIDATES = (1, 2, 4, 8, 16, 32, 64)
"""Row counts at which the C kernels are timed against the other paths on load."""


def row_paths(timings: dict[int, dict[str, float]]) -> tuple[int | None, int | None]:
    """The rule that routes rows between a weight's paths, from its timings: {rows: {path: seconds}} with
    paths "one-row" (the C kernel's one-row loops), "loops" (its many-row loops on the tiled copy) and
    "rest" (what the weight does otherwise: the dense copy or torch's packed kernel), each where the weight
    has it. Returns (native_rows, gemm_rows): the one-row loops take up to native_rows rows, the most rows
    up to which they were the fastest path at every candidate (None: not at 1 row); the many-row loops take
    from gemm_rows, the fewest rows above those from which they were the fastest at every larger candidate
    timed (None: never; timing stops once they have won twice in a row). Where the many-row loops win
    right above the one-row kernel's rows, or beat the rest at every count up to where they win, they
    start right after the one-row kernel's rows, so no row count in between falls to a slower path."""
    counts = sorted(timings)

    def fastest(rows: int) -> str:
        return min(timings[rows], key=timings[rows].get)

    native = None
    for rows in counts:
        if "one-row" not in timings[rows] or fastest(rows) != "one-row":
            break
        native = rows
    above = [r for r in counts if native is None or r > native]
    gemm = None
    for i, rows in enumerate(above):
        if all("loops" in timings[r] and fastest(r) == "loops" for r in above[i:]):
            gemm = rows
            break
    # they also take the counts between where they beat the rest (the dense copy or torch's kernel)
    if gemm is not None and all(
        "loops" in timings[r] and timings[r]["loops"] <= timings[r].get("rest", float("inf"))
        for r in above
        if r < gemm
    ):
        gemm = (native or 0) + 1
    return native, gemm


def measure_row_paths(w: Int4Linear, rounds: int = 5, calls: int = 2) -> tuple[int | None, int | None]:
    """Times w's paths at each of ROW_CANDIDATES (the fastest round's seconds of `calls` calls, the
    paths interleaved round by round) and routes rows by row_paths. The fastest round, not the median: on
    an oversubscribed host a round of a multi-threaded kernel also pays its team's waits for a descheduled
    thread, which only ever slows a round down, sometimes by orders of magnitude, enough to tip a median
    to a path many times slower. Wall time,
    not CPU time: the waiting thread of an OpenMP team spins, so CPU time charges those waits too. Stops
    timing once the many-row loops won at two candidates in a row (their lead grows with the rows) or the
    one-row kernel is all that is left to beat."""
    if w.native is None:
        return None, None
    w.native_rows, w.gemm_rows = None, None
    paths = {"one-row": w.native, "rest": w}
    if w.native.tiles is not None:
        paths["loops"] = w.native.gemm

    def seconds(fn, x) -> float:
        start = time.perf_counter()
        for _ in range(calls):
            fn(x)
        return time.perf_counter() - start

    timings: dict[int, dict[str, float]] = {}
    loops_won = 0
    for rows in ROW_CANDIDATES:
        x = torch.randn(rows, w.in_features).to(w.scales_and_zeros.dtype)
        taken = {name: [] for name in paths}
        for fn in paths.values():
            fn(x)
        for _ in range(rounds):
            for name, fn in paths.items():
                taken[name].append(seconds(fn, x))
        timings[rows] = {name: min(t) for name, t in taken.items()}
        loops_won = loops_won + 1 if min(timings[rows], key=timings[rows].get) == "loops" else 0
        if loops_won == 2:
            break
        if "one-row" in paths and timings[rows]["one-row"] > min(timings[rows].values()):
            paths.pop("one-row", None)  # it is out from here on; keep timing the others
    return row_paths(timings)


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


def check_quantization(quantization: str | None, device: torch.device) -> str:
    q = quantization or "auto"
    if q not in QUANTIZATIONS:
        raise ValueError(
            f"quantization: {quantization!r} is not supported; choose one of {list(QUANTIZATIONS)}"
        )
    if q not in ("auto", "none") and device.type != "cpu":
        raise ValueError(
            f"quantization: {q!r} runs on CPU only (torch's weight-only kernels); "
            f"use 'none' or 'auto' on {device.type}"
        )
    return q


def resolve_quantization(
    quantization: str | None, dtype: torch.dtype, device: torch.device, dtype_chosen: bool = False
) -> str:
    """'auto' keeps a GGUF's blocks packed on CPU where the packed kernels are fast: bfloat16 activations,
    or a float32 that dtype 'auto' chose (`dtype_chosen`: the CPU computes bfloat16 slowly, as on AVX2) where
    packed_measures_faster; a float32 the user named stays dense (exact). It dequantizes elsewhere; any
    other choice stands."""
    q = check_quantization(quantization, device)
    if q == "auto":
        if device.type != "cpu":
            return "none"
        if dtype == torch.bfloat16 or (dtype == torch.float32 and dtype_chosen and packed_measures_faster()):
            return "gguf"
        return "none"
    return q


@lru_cache(maxsize=1)
def packed_measures_faster(rounds: int = 7, calls: int = 8) -> bool:
    """Whether the C kernel multiplies one row of float32 activations by a model-shaped 4-bit weight (1,536 x
    576, blocks of 32) faster than the dense float32 matmul does (fastest round's seconds, interleaved): the
    step a single stream's decode repeats, bound by reading weights (0.56 bytes a weight packed, 4 dense).
    False without the kernel or its vector loops (the portable loops are no match for a dense matmul)."""
    lib = native_matmul.load()
    if lib is None or not lib.quantized_matmul_vectorized():
        return False
    rng = np.random.default_rng(0)
    n, k = 1536, 576
    codes = rng.integers(0, 16, (n, k), dtype=np.uint8)
    scale = rng.uniform(0.001, 0.01, (n, k // GROUP)).astype(np.float32)
    offset = -8 * scale
    packed = NativeMatmul(codes, scale, offset, 4)
    dense = torch.from_numpy(
        ((codes.reshape(n, -1, GROUP) - 8.0) * scale[..., None]).reshape(n, k).astype(np.float32)
    )
    x = torch.randn(1, k)
    paths = {"packed": lambda: packed(x), "dense": lambda: F.linear(x, dense)}
    if packed.tiles is not None:
        paths["packed many-row"] = lambda: packed.gemm(x)
    taken: dict[str, list[float]] = {name: [] for name in paths}
    for fn in paths.values():
        fn()
    for _ in range(rounds):
        for name, fn in paths.items():
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            taken[name].append(time.perf_counter() - start)
    best = {name: min(t) for name, t in taken.items()}  # the least disturbed round (measure_row_paths)
    return min(best, key=best.get) != "dense"


def make_linear(
    source, quantization: str, dtype: torch.dtype, device: torch.device, dense: bool = False
) -> torch.Tensor | Int4Linear:
    """A projection weight [N, K] from a numpy array or GGUFBlocks, packed or dense as `quantization` says
    (already resolved: 'gguf' keeps blocks, 'none' dequantizes, 'int8' / 'int4' re-quantize);
    `dense`: packed GGUF blocks also keep a dequantized copy (see the module docstring)."""
    if isinstance(source, GGUFBlocks) and quantization == "gguf" and source.shape[1] % GROUP == 0:
        return pack_gguf(source, dtype, dense)
    dense = torch.from_numpy(source.dequantize() if isinstance(source, GGUFBlocks) else source)
    if quantization == "int8":
        return quantize_int8(dense, dtype)
    if quantization == "int4" and dense.shape[1] % GROUP == 0:
        return quantize_int4(dense, dtype)
    return dense.to(device=device, dtype=dtype)
