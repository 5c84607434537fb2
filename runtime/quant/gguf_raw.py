"""A GGUF matrix as the file's bytes (GGUFRaw), laid by the C kernels (csrc/gguf_relayout.c) straight into the
many-row kernel's tiles: one pass over the mapped file per matrix, parallel over groups of 16 rows, with no
parsed copy (GGUFBlocks) in between, so a load's peak is the tiles plus the matrix's pages of the file.

The tiles are byte for byte those pack_native makes from the parsed blocks (tests/runtime/test_gguf_relayout.py
compares them): Q4_0, Q4_1 and Q8_0 with float16 scales and offsets, Q5_0 and Q5_1 likewise with a plane of
their fifth bits, Q4_K and Q5_K in their own tiles, Q6_K in its 6-bit tiles. Where a kind, shape or level has
no such path, or a scale does not fit float16 (GGUFBlocks.fits_float16), `pack_raw` returns None and the
caller parses the blocks instead.

The dense paths (quantization none, int8, int4) take the same bytes to float32 in one pass
(csrc/gguf_dequantize.c, `dequantize_raw`), bit for bit GGUFBlocks.dequantize, every GGUF block kind.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from runtime.kernels import quantized_matmul as native_matmul
from runtime.kernels.library import load
from runtime.kernels.quantized_matmul import FIVE_BITS, KQ4_BITS, KQ5_BITS, TILE_COLUMNS, NativeMatmul
from runtime.kernels.stacked_matmul import StackedMatmul
from runtime.quant.linear import Int4Linear

KINDS = {"Q4_0": 0, "Q8_0": 1, "Q5_K": 2, "Q4_K": 3, "Q6_K": 4, "Q4_1": 5, "Q5_0": 6, "Q5_1": 7}
"""csrc/gguf_relayout.c's kind numbers."""
BITS = {
    "Q4_0": 4,
    "Q4_1": 4,
    "Q5_0": FIVE_BITS,
    "Q5_1": FIVE_BITS,
    "Q8_0": 8,
    "Q5_K": KQ5_BITS,
    "Q4_K": KQ4_BITS,
    "Q6_K": 6,
}
"""The tiles' `bits` (NativeMatmul.bits) per kind."""
FOLIO_BYTES = 2 << 20
"""The largest folio the page cache maps at once (release_pages widens to it)."""
CHUNK_BYTES = 16 << 20
"""Bytes of the file tiles_from_raw lays out between releases of their pages."""
DEQUANTIZE_KINDS = {"Q4_0": 0, "Q4_1": 1, "Q5_0": 2, "Q5_1": 3, "Q8_0": 4, "Q4_K": 5, "Q5_K": 6, "Q6_K": 7}
"""csrc/gguf_dequantize.c's kind numbers."""


@dataclass
class GGUFRaw:
    """A matrix's bytes in the mapped file: data [file rows, bytes a row] uint8; output row r is the file's
    row rows[r] (rows None: row r); shape (N, K) of the output."""

    kind: str
    data: np.ndarray
    shape: tuple[int, int]
    rows: np.ndarray | None = None
    taken: Callable[[], None] = lambda: None
    """Called once the model has made its weight from these bytes (the load's progress)."""

    def take_rows(self, order: np.ndarray) -> GGUFRaw:
        rows = np.asarray(order, np.int64) if self.rows is None else self.rows[order]
        return GGUFRaw(self.kind, self.data, (len(rows), self.shape[1]), np.ascontiguousarray(rows, np.int64))

    def release(self) -> None:
        """Drop the matrix's pages of the mapped file from this process (release_pages)."""
        release_pages(self.data)


def _path(kind: str) -> bool:
    """This library lays `kind` out into the tiles pack_native would choose for it here."""
    if kind == "Q6_K":
        return True
    if kind in ("Q4_K", "Q5_K"):
        return native_matmul.q4_k_tiles()
    return kind in KINDS and native_matmul.vector_loops()


def relayable(parts: list[GGUFRaw], dtype: torch.dtype) -> bool:
    """Every part has a path here (its kind, N % 32 == 0, K a whole number of its blocks, K % 64 == 0)."""
    if load() is None or not parts or len({p.shape[1] for p in parts}) != 1:
        return False
    k = parts[0].shape[1]
    if not native_matmul.usable(k, dtype, torch.device("cpu")):
        return False
    return all(
        _path(p.kind)
        and p.shape[0] % (2 * TILE_COLUMNS) == 0
        and k % (256 if p.kind.endswith("_K") else 32) == 0
        for p in parts
    )


def tiles_from_raw(parts: list[GGUFRaw], threads: int | None = None) -> NativeMatmul | None:
    """The parts (one kind, stacked by rows) as one NativeMatmul in the many-row kernel's tiles, or None where
    a scale does not fit float16; each part's pages of the mapped file released as it is laid out.
    relayable() first."""
    kind = parts[0].kind
    assert all(p.kind == kind for p in parts)
    n, k = sum(p.shape[0] for p in parts), parts[0].shape[1]
    g, nb, ns = n // TILE_COLUMNS, k // 32, k // 256
    if kind in ("Q4_K", "Q5_K"):
        bufs = (
            torch.empty(g, nb, 4 if kind == "Q4_K" else 5, TILE_COLUMNS, 4, dtype=torch.uint8),
            torch.empty(g, nb, 2, TILE_COLUMNS, dtype=torch.uint8),
            torch.empty(g, ns, 2, TILE_COLUMNS, dtype=torch.float16),
        )
    elif kind == "Q6_K":
        bufs = (
            torch.empty(g, nb, 6, 4 * TILE_COLUMNS, dtype=torch.uint8),
            torch.empty(g, ns, TILE_COLUMNS, dtype=torch.float16),
            torch.empty(g, nb, TILE_COLUMNS, 2, dtype=torch.int8),
        )
    else:  # Q4_0, Q5_0 and Q8_0 with no offsets (the kernels form -8 d, -16 d and -128 d), Q4_1 and Q5_1 with
        # their minimum
        vectors = {"Q4_0": 4, "Q4_1": 4, "Q5_0": 5, "Q5_1": 5}.get(kind, 8)
        bufs = (
            torch.empty(g, nb, vectors, TILE_COLUMNS, 4, dtype=torch.uint8),
            torch.empty(g, nb, TILE_COLUMNS, dtype=torch.float16),
            torch.empty(*((g, nb, TILE_COLUMNS) if kind in ("Q4_1", "Q5_1") else (0,)), dtype=torch.float16),
        )
    lib = load()
    threads = threads or torch.get_num_threads()
    at = 0  # tile groups written so far
    for p in parts:
        # a chunk of rows at a time (~16 MiB of the file), its pages of the file released once laid out where
        # the rows are the file's in order, so a large matrix's tiles and file pages are not resident together
        step = max(
            2 * TILE_COLUMNS, (CHUNK_BYTES // p.data.strides[0]) // (2 * TILE_COLUMNS) * (2 * TILE_COLUMNS)
        )
        for r0 in range(0, p.shape[0], step):
            r1 = min(p.shape[0], r0 + step)
            if p.rows is None:
                data, rows = p.data[r0:r1], None
            else:
                data, rows = p.data, p.rows[r0:r1]
            bad = lib.gguf_relayout(
                KINDS[kind],
                data.ctypes.data,
                data.strides[0],
                0 if rows is None else rows.ctypes.data,
                r1 - r0,
                k,
                *(b[at + r0 // TILE_COLUMNS :].data_ptr() for b in bufs),
                threads,
            )
            if bad:
                return None
            if rows is None:
                release_pages(data)
        if p.rows is not None:  # rows in another order: the part's pages once it is all laid out
            p.release()
        at += p.shape[0] // TILE_COLUMNS
    return NativeMatmul.from_tiles(BITS[kind], bufs, n, k)


def pack_raw(parts: list[GGUFRaw], dtype: torch.dtype) -> Int4Linear | None:
    """A packed weight (Int4Linear.native_only) from the parts' bytes (stacked by rows): one NativeMatmul where
    they share a kind, else a StackedMatmul of one per run of parts of one kind; each part's pages of
    the file released once laid out. None where a scale does not fit float16 (the caller parses instead).
    relayable() first."""
    # one multiplication per run of parts of one kind (q and k of a kind, v of another: two)
    runs = [list(run) for _, run in itertools.groupby(parts, key=lambda p: p.kind)]
    natives = []
    for run in runs:
        native = tiles_from_raw(run)
        if native is None:
            return None
        natives.append(native)
    native = natives[0] if len(natives) == 1 else StackedMatmul(natives)
    return Int4Linear.native_only(native, dtype)


def release_pages(view: np.ndarray) -> None:
    """madvise(MADV_DONTNEED) the pages of a read-only memory-mapped array's bytes (a no-op elsewhere): they
    leave this process's resident set and are read from the page cache if touched again. The range is widened
    to whole 2 MiB folios (within the mapping): the page cache maps a file's large folios whole on a fault, so a
    norm of a few KiB can bring 2 MiB; dropping a neighbour's pages costs it only a fault from the cache."""
    import ctypes
    import mmap

    base = view
    while base is not None and not isinstance(base, (np.memmap, mmap.mmap)):
        base = getattr(base, "base", None)
    if base is None:
        return
    while isinstance(getattr(base, "base", None), np.memmap):  # the whole mapping, not a slice of it
        base = base.base
    if isinstance(base, np.memmap):
        first, last = base.ctypes.data, base.ctypes.data + base.nbytes
    else:
        first, last = view.ctypes.data, view.ctypes.data + view.nbytes
    page, folio = mmap.PAGESIZE, FOLIO_BYTES
    start = view.ctypes.data
    end = start + view.nbytes
    lo = max(start // folio * folio, -(-first // page) * page)
    hi = min(-(-end // folio) * folio, last // page * page)
    if hi > lo and (c := libc()) is not None:
        c.madvise(ctypes.c_void_p(lo), ctypes.c_size_t(hi - lo), ctypes.c_int(mmap.MADV_DONTNEED))


@functools.lru_cache(maxsize=1)
def libc():
    """The C library the process runs on, loaded once (None where it cannot be): madvise here, malloc_trim
    after a load's parses (runtime/model/model.py)."""
    import ctypes

    try:
        return ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None


def dequantize_raw(parts: list[GGUFRaw], threads: int | None = None) -> np.ndarray | None:
    """The parts (stacked by rows) de-quantized to float32 [N, K] straight from the file's bytes, each part's
    pages of the file released after; None where the C kernels are not loaded or a part's kind or width has no
    path there (the caller parses the blocks instead)."""
    lib = load()
    k = parts[0].shape[1] if parts else 0
    if (
        lib is None
        or not parts
        or any(p.kind not in DEQUANTIZE_KINDS or p.shape[1] != k for p in parts)
        or any(k % (256 if p.kind.endswith("_K") else 32) for p in parts)
    ):
        return None
    out = np.empty((sum(p.shape[0] for p in parts), k), np.float32)
    threads = threads or torch.get_num_threads()
    at = 0
    for p in parts:
        bad = lib.gguf_dequantize(
            DEQUANTIZE_KINDS[p.kind],
            p.data.ctypes.data,
            p.data.strides[0],
            0 if p.rows is None else p.rows.ctypes.data,
            p.shape[0],
            k,
            out[at:].ctypes.data,
            threads,
        )
        if bad:
            return None
        at += p.shape[0]
    for p in parts:
        p.release()
    return out
