"""A GGUF whose header disagrees with its tensors, or that asks for what is not supported, is refused before
any weight is read, with an error naming the header key, the tensor or the unsupported thing: never a crash
in the kernels or a server that loads and then fails every request.

The broken files are real GGUFs: copies of the default model with one header value changed in place by
gguf-py (as its gguf_set_metadata script does), or tiny models written by gguf-py."""

from __future__ import annotations

import shutil

import numpy as np
import pytest

from runtime import Engine
from runtime.model.checkpoint import default_model_path
from tests.random_families import hf_model, write_gguf

pytestmark = pytest.mark.slow  # reads copies of the real model


@pytest.fixture(scope="module")
def header_values() -> dict[str, tuple[int, np.dtype]]:
    """Where each integer header value of the default GGUF lies in the file (its byte offset) and its type, as
    gguf-py reads them: parsing the header costs seconds, so once for the module."""
    import gguf

    reader = gguf.GGUFReader(default_model_path())
    out = {}
    for key, field in reader.fields.items():
        part = field.parts[field.data[0]] if field.data else None
        if part is not None and part.size == 1 and part.dtype.kind in "iu":
            out[key] = (part.ctypes.data - reader.data.ctypes.data, part.dtype)
    return out


def _default_with(tmp_path, header_values, key: str, value: int):
    """A copy of the default GGUF with one integer header value replaced in place (where gguf-py read it, as
    its gguf_set_metadata script writes it)."""
    path = tmp_path / "broken.gguf"
    shutil.copyfile(default_model_path(), path)
    offset, dtype = header_values[key]
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(np.array([value], dtype=dtype).tobytes())
    return path


@pytest.mark.parametrize(
    "key, value, named",
    [
        ("llama.embedding_length", 8192, ["'token_embd.weight'", "embedding_length 8192"]),
        ("llama.feed_forward_length", 256, ["'blk.0.ffn_", "feed_forward_length 256"]),
        ("llama.context_length", 1 << 31, ["context length 2147483648"]),
    ],
)
def test_header_sizes_that_disagree_with_the_tensors_are_refused(tmp_path, header_values, key, value, named):
    path = _default_with(tmp_path, header_values, key, value)
    with pytest.raises(ValueError) as err:
        Engine.from_pretrained(str(path), dtype="float32", device="cpu", kv_cache_bytes=8 << 20)
    for part in named:
        assert part in str(err.value), str(err.value)


@pytest.fixture(scope="module")
def tiny_llama():
    return hf_model("llama3")


def _refusal(tmp_path, model, **kwargs) -> str:
    path = write_gguf(model, "llama3", tmp_path / "m.gguf", **kwargs)
    with pytest.raises(ValueError) as err:
        Engine.from_pretrained(str(path), dtype="float32", device="cpu", kv_cache_bytes=4 << 20)
    return str(err.value)


def test_unsupported_tokenizer_is_refused_first(tmp_path, tiny_llama):
    """Named, and before the header's sizes are even compared with the tensors (which are wrong here too)."""
    message = _refusal(tmp_path, tiny_llama, tokenizer_model="rwkv", overrides={"embedding_length": 96})
    assert "'rwkv'" in message and "tokenizer.ggml.model" in message


def test_unsupported_tensor_type_is_named(tmp_path, tiny_llama):
    import gguf

    def add_q8_k(writer):  # Q8_K (llama.cpp's activation format) is never a weight type gguf-py reads
        size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType.Q8_K][1]
        raw = np.zeros((4, size), dtype=np.uint8)
        writer.add_tensor("blk.0.extra.weight", raw, raw_dtype=gguf.GGMLQuantizationType.Q8_K)

    message = _refusal(tmp_path, tiny_llama, edit=add_q8_k)
    assert "'blk.0.extra.weight'" in message and "Q8_K" in message


def test_tensor_the_architecture_does_not_use_is_named(tmp_path, tiny_llama):
    def add_qkv(writer):
        writer.add_tensor("blk.1.attn_qkv.weight", np.zeros((3, 80), dtype=np.float32))

    message = _refusal(tmp_path, tiny_llama, edit=add_qkv)
    assert "blk.1.attn_qkv.weight" in message and "llama" in message


def test_unsupported_architecture_is_named(tmp_path):
    import gguf

    path = tmp_path / "mamba.gguf"
    writer = gguf.GGUFWriter(str(path), "mamba")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="unsupported architecture 'mamba'.*supported: llama, qwen2"):
        Engine.from_pretrained(str(path), dtype="float32", device="cpu")
