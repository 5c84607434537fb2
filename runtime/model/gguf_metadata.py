"""The key-value header of a GGUF file, read without touching its tensors.

gguf-py's GGUFReader builds a numpy view per array element, which takes tens of seconds on a 262,144-token
vocabulary (Gemma's); this reads the same header in well under a second, so the tokenizer can be checked
before any weight is read. Layout (little-endian): magic "GGUF", version u32, tensor count u64, key-value
count u64, then per pair: key (u64 length + UTF-8), value type u32, value; an array value is element type
u32, count u64, elements; a string is u64 length + UTF-8 bytes.
"""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np

_SCALARS = {  # GGUF value type -> (struct format, numpy dtype)
    0: ("<B", np.uint8),
    1: ("<b", np.int8),
    2: ("<H", np.uint16),
    3: ("<h", np.int16),
    4: ("<I", np.uint32),
    5: ("<i", np.int32),
    6: ("<f", np.float32),
    7: ("<?", np.bool_),
    10: ("<Q", np.uint64),
    11: ("<q", np.int64),
    12: ("<d", np.float64),
}
_STRING, _ARRAY = 8, 9
_U64 = struct.Struct("<Q")


class _Cursor:
    def __init__(self, data: memoryview):
        self.data = data
        self.pos = 0

    def take(self, n: int) -> memoryview:
        if self.pos + n > len(self.data):
            raise ValueError("the header ends early (truncated file?)")
        view = self.data[self.pos : self.pos + n]
        self.pos += n
        return view

    def unpack(self, fmt: str):
        return struct.unpack(fmt, self.take(struct.calcsize(fmt)))[0]

    def string(self) -> str:
        return bytes(self.take(self.unpack("<Q"))).decode("utf-8", errors="replace")

    def strings(self, count: int) -> list[str]:
        """`count` strings in a row (a vocabulary: one loop with the offsets in locals)."""
        data, pos, end = self.data, self.pos, len(self.data)
        length = _U64.unpack_from
        out = []
        for _ in range(count):
            if pos + 8 > end:
                raise ValueError("the header ends early (truncated file?)")
            (n,) = length(data, pos)
            pos += 8
            if pos + n > end:
                raise ValueError("the header ends early (truncated file?)")
            out.append(str(data[pos : pos + n], "utf-8", "replace"))
            pos += n
        self.pos = pos
        return out

    def value(self, kind: int):
        if kind == _STRING:
            return self.string()
        if kind in _SCALARS:
            return self.unpack(_SCALARS[kind][0])
        if kind != _ARRAY:
            raise ValueError(f"unknown value type {kind}")
        item, count = self.unpack("<I"), self.unpack("<Q")
        if item == _STRING:
            return self.strings(count)
        if item in _SCALARS:
            dtype = np.dtype(_SCALARS[item][1]).newbyteorder("<")
            return np.frombuffer(self.take(count * dtype.itemsize), dtype=dtype).tolist()
        return [self.value(item) for _ in range(count)]


def read_gguf_metadata(path: str | Path) -> dict:
    """Every key of the file's header with its value (arrays as lists). Raises ValueError naming the file
    when it is not a GGUF file or its header is cut short."""
    return read_gguf_header(path)[0]


def read_gguf_header(path: str | Path) -> tuple[dict, int]:
    """read_gguf_metadata's keys, and where the tensor table after them starts (a byte offset in the file)."""
    try:
        with open(path, "rb") as f:
            head = f.read(24)
            if len(head) < 24 or head[:4] != b"GGUF":
                raise ValueError("not a GGUF file (no GGUF magic)")
            version, _tensors, count = struct.unpack("<IQQ", head[4:])
            if version < 2:
                raise ValueError(f"GGUF version {version} is not supported (2 or later)")
            import mmap

            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
                view = memoryview(mapped)
                try:
                    cursor = _Cursor(view)
                    cursor.pos = 24
                    meta = {}
                    for _ in range(count):
                        key = cursor.string()
                        meta[key] = cursor.value(cursor.unpack("<I"))
                    return meta, cursor.pos
                finally:
                    del cursor
                    view.release()
    except (OSError, ValueError, struct.error, UnicodeDecodeError) as exc:
        raise ValueError(f"model: cannot read {str(path)!r} as GGUF: {exc}") from exc
