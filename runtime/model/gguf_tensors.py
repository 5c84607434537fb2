"""The tensor table of a GGUF file: each tensor's name, type, shape and bytes (a view of the file mapped
read-only), without building gguf-py's per-element views of the header's arrays (GGUFReader holds about
2.5 x a 253 MB file's size in those for a 262,144-token vocabulary while it reads them).

Layout after the key-value header (runtime.model.gguf_metadata): per tensor, name (u64 length + UTF-8),
dimension count u32, dimensions u64 each (innermost first), type u32, offset u64 from the data section,
which starts at the next multiple of `general.alignment` (32 when absent) after the table.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from runtime.model.ggml_types import tensor_type
from runtime.model.gguf_metadata import _Cursor, read_gguf_header

DEFAULT_ALIGNMENT = 32
_PLAIN = {
    "F32": np.float32,
    "F16": np.float16,
    "F64": np.float64,
    "I8": np.int8,
    "I16": np.int16,
    "I32": np.int32,
    "I64": np.int64,
}


@dataclass
class GGUFTensor:
    """As gguf-py's ReaderTensor: shape innermost first; data the bytes as gguf-py shapes them (plain types
    as their numbers, outermost first; block types as uint8 [..., bytes per row])."""

    name: str
    tensor_type: object
    shape: tuple[int, ...]
    n_bytes: int
    data: np.ndarray


def read_gguf_tensors(path: str | Path, header: tuple[dict, int] | None = None) -> list[GGUFTensor]:
    """header: read_gguf_header's (keys, tensor table offset) of this file, where the caller has read it (else
    it is read here)."""
    keys, table_at = header if header is not None else read_gguf_header(path)
    alignment = int(keys.get("general.alignment", DEFAULT_ALIGNMENT))
    mapped = np.memmap(path, dtype=np.uint8, mode="r")
    cursor = _Cursor(memoryview(mapped))
    try:
        if bytes(cursor.take(4)) != b"GGUF":
            raise ValueError("not a GGUF file (no GGUF magic)")
        _version, count, _pairs = struct.unpack("<IQQ", cursor.take(20))
        cursor.pos = table_at
        infos = []
        for _ in range(count):
            name = cursor.string()
            dims = tuple(cursor.unpack("<Q") for _ in range(cursor.unpack("<I")))
            infos.append((name, dims, cursor.unpack("<I"), cursor.unpack("<Q")))
        start = -(-cursor.pos // alignment) * alignment
    finally:
        del cursor
    tensors = []
    for name, dims, kind, offset in infos:
        qtype, block, size = tensor_type(kind)
        elements = int(np.prod(dims, dtype=np.int64))
        n_bytes = elements // block * size
        raw = mapped[start + offset : start + offset + n_bytes]
        if raw.shape[0] != n_bytes:
            raise ValueError(f"tensor {name!r} runs past the end of the file (truncated file?)")
        if qtype.name in _PLAIN:
            data = raw.view(_PLAIN[qtype.name]).reshape(tuple(reversed(dims)))
        else:
            data = raw.reshape(*reversed(dims[1:]), dims[0] // block * size)
        tensors.append(GGUFTensor(name, qtype, dims, n_bytes, data))
    return tensors
