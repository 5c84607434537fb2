"""The tensor types and file types of a GGUF file that a load meets most, named as ggml names them, without
importing gguf-py (a few tens of milliseconds of every load): each type's number, elements a block and bytes a
block. Other numbers are looked up in gguf-py where they occur."""

from __future__ import annotations

import enum


class GGMLType(enum.IntEnum):
    """A tensor's type number in a GGUF file (equal, as an int, to gguf-py's GGMLQuantizationType)."""

    F32 = 0
    F16 = 1
    Q4_0 = 2
    Q4_1 = 3
    Q5_0 = 6
    Q5_1 = 7
    Q8_0 = 8
    Q2_K = 10
    Q3_K = 11
    Q4_K = 12
    Q5_K = 13
    Q6_K = 14
    I8 = 24
    I16 = 25
    I32 = 26
    I64 = 27
    F64 = 28
    BF16 = 30


BLOCKS = {  # elements a block, bytes a block
    GGMLType.F32: (1, 4),
    GGMLType.F16: (1, 2),
    GGMLType.Q4_0: (32, 18),
    GGMLType.Q4_1: (32, 20),
    GGMLType.Q5_0: (32, 22),
    GGMLType.Q5_1: (32, 24),
    GGMLType.Q8_0: (32, 34),
    GGMLType.Q2_K: (256, 84),
    GGMLType.Q3_K: (256, 110),
    GGMLType.Q4_K: (256, 144),
    GGMLType.Q5_K: (256, 176),
    GGMLType.Q6_K: (256, 210),
    GGMLType.I8: (1, 1),
    GGMLType.I16: (1, 2),
    GGMLType.I32: (1, 4),
    GGMLType.I64: (1, 8),
    GGMLType.F64: (1, 8),
    GGMLType.BF16: (1, 2),
}

FILE_TYPES = {  # general.file_type -> llama.cpp's name for the file's quantization
    0: "ALL_F32",
    1: "F16",
    2: "Q4_0",
    3: "Q4_1",
    7: "Q8_0",
    8: "Q5_0",
    9: "Q5_1",
    10: "Q2_K",
    11: "Q3_K_S",
    12: "Q3_K_M",
    13: "Q3_K_L",
    14: "Q4_K_S",
    15: "Q4_K_M",
    16: "Q5_K_S",
    17: "Q5_K_M",
    18: "Q6_K",
    32: "BF16",
}


def tensor_type(number: int) -> tuple[enum.IntEnum, int, int]:
    """(the type, elements a block, bytes a block) of a tensor type number; ValueError where neither this
    table nor gguf-py knows it."""
    if number in BLOCKS:
        kind = GGMLType(number)
        return (kind, *BLOCKS[kind])
    import gguf

    kind = gguf.GGMLQuantizationType(number)
    return (kind, *gguf.GGML_QUANT_SIZES[kind])


def file_type_name(number: int) -> str:
    """llama.cpp's name of a general.file_type ('Q4_K_M'); ValueError where unknown."""
    if number in FILE_TYPES:
        return FILE_TYPES[number]
    import gguf

    return gguf.LlamaFileType(number).name.removeprefix("MOSTLY_")
