"""Byte sizes as users write them: an int, or a string such as "8GiB", "512 MB", "64k"."""

from __future__ import annotations

import re

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1 << 10,
    "kb": 1000,
    "kib": 1 << 10,
    "m": 1 << 20,
    "mb": 1000**2,
    "mib": 1 << 20,
    "g": 1 << 30,
    "gb": 1000**3,
    "gib": 1 << 30,
    "t": 1 << 40,
    "tb": 1000**4,
    "tib": 1 << 40,
}
_PATTERN = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*$")


def parse_size(value: int | str | None, field: str) -> int | None:
    """Return `value` in bytes (None stays None); `field` names the option in the error message."""
    if value is None:
        return None
    if isinstance(value, bool):
        raise TypeError(f"{field}: expected a byte count (int) or a size string like '8GiB', got {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"{field}: a byte count must be >= 0, got {value}")
        return value
    if isinstance(value, str):
        match = _PATTERN.match(value)
        unit = match.group(2).lower() if match else None
        if match is None or unit not in _UNITS:
            raise ValueError(
                f"{field}: cannot read {value!r} as a size; write bytes as an int or a string "
                "like '512MiB', '8GiB', '2GB'"
            )
        return int(float(match.group(1)) * _UNITS[unit])
    raise TypeError(
        f"{field}: expected a byte count (int) or a size string like '8GiB', got {type(value).__name__}"
    )
