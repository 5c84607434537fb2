"""The load names a GGUF file's tensor types and file type from a table of its own (importing gguf-py costs
every load tens of milliseconds): that table against gguf-py's, and the tensor table read with and without the
header's position handed over."""

from __future__ import annotations

import gguf
import numpy as np

from runtime.model.checkpoint import default_model_path
from runtime.model.ggml_types import BLOCKS, FILE_TYPES, GGMLType, file_type_name, tensor_type
from runtime.model.gguf_metadata import read_gguf_header
from runtime.model.gguf_tensors import read_gguf_tensors


def test_tensor_types_are_gguf_pys():
    for kind in GGMLType:
        theirs = gguf.GGMLQuantizationType(int(kind))
        assert theirs.name == kind.name
        assert BLOCKS[kind] == tuple(gguf.GGML_QUANT_SIZES[theirs]), kind.name
        assert kind == theirs and hash(kind) == hash(theirs)  # gguf-py's own tables find ours
    assert set(BLOCKS) == set(GGMLType)


def test_types_outside_the_table_come_from_gguf_py():
    for theirs in gguf.GGMLQuantizationType:
        kind, block, size = tensor_type(int(theirs))
        assert kind.name == theirs.name and (block, size) == tuple(gguf.GGML_QUANT_SIZES[theirs])


def test_file_types_are_llama_cpps():
    for number, name in FILE_TYPES.items():
        assert gguf.LlamaFileType(number).name.removeprefix("MOSTLY_") == name
    for theirs in gguf.LlamaFileType:
        if theirs != gguf.LlamaFileType.GUESSED:
            assert file_type_name(int(theirs)) == theirs.name.removeprefix("MOSTLY_")


def test_tensor_table_is_gguf_pys_with_or_without_the_header_handed_over():
    path = default_model_path()
    plain, handed = read_gguf_tensors(path), read_gguf_tensors(path, read_gguf_header(path))
    assert len(plain) == len(handed) > 0
    reader = {t.name: t for t in gguf.GGUFReader(path).tensors}
    assert len(plain) == len(reader)
    for a, b in zip(plain, handed):
        assert (a.name, a.tensor_type, a.shape, a.n_bytes) == (b.name, b.tensor_type, b.shape, b.n_bytes)
        theirs = reader[a.name]
        assert a.tensor_type == theirs.tensor_type and a.tensor_type.name == theirs.tensor_type.name
        assert a.shape == tuple(int(d) for d in theirs.shape) and a.n_bytes == int(theirs.n_bytes)
        assert np.array_equal(
            np.asarray(a.data).reshape(-1).view(np.uint8), np.asarray(b.data).reshape(-1).view(np.uint8)
        )
        assert np.array_equal(
            np.asarray(a.data).reshape(-1).view(np.uint8), np.asarray(theirs.data).reshape(-1).view(np.uint8)
        )
