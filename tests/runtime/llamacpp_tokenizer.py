"""llama.cpp's own tokenizer, called through the shared library in xllamacpp's wheel (ctypes): the
reference that GGUF vocabularies are compared with where llama.cpp ships no test vectors (Gemma 3)."""

from __future__ import annotations

import ctypes
import os

VOCAB_ONLY_OFFSET = 72
"""Byte offset of llama_model_params.vocab_only (after nine pointer-sized fields) in llama.h."""


class _Params(ctypes.Structure):
    _fields_ = [("raw", ctypes.c_uint8 * 256)]  # larger than the struct: returned through a hidden pointer


class LlamaCppVocab:
    """One GGUF file's vocabulary loaded by llama.cpp (vocab_only: no weights)."""

    def __init__(self, path: str):
        import xllamacpp

        lib = ctypes.CDLL(os.path.join(os.path.dirname(xllamacpp.__file__), "xllamacpp.abi3.so"))
        lib.llama_model_default_params.restype = _Params
        lib.llama_model_load_from_file.argtypes = [ctypes.c_char_p, _Params]
        lib.llama_model_load_from_file.restype = ctypes.c_void_p
        lib.llama_model_get_vocab.argtypes = [ctypes.c_void_p]
        lib.llama_model_get_vocab.restype = ctypes.c_void_p
        lib.llama_tokenize.argtypes = [
            ctypes.c_void_p, ctypes.c_char_p, ctypes.c_int32, ctypes.POINTER(ctypes.c_int32), ctypes.c_int32,
            ctypes.c_bool, ctypes.c_bool,
        ]  # fmt: skip
        lib.llama_tokenize.restype = ctypes.c_int32
        lib.llama_backend_init()
        params = lib.llama_model_default_params()
        # vocab_only, check_tensors, use_extra_bufts, no_host, no_alloc, load_mtp: false, false, true, ...
        flags = list(params.raw[VOCAB_ONLY_OFFSET : VOCAB_ONLY_OFFSET + 3])
        if flags != [0, 0, 1]:
            raise RuntimeError(f"xllamacpp's llama_model_params layout is not the expected one: {flags}")
        params.raw[VOCAB_ONLY_OFFSET] = 1
        self._lib = lib
        self._model = lib.llama_model_load_from_file(os.fsencode(path), params)
        if not self._model:
            raise RuntimeError(f"llama.cpp could not load {path}")
        self._vocab = lib.llama_model_get_vocab(self._model)

    def tokenize(self, text: str, add_special: bool = False, parse_special: bool = False) -> list[int]:
        data = text.encode()
        room = len(data) + 8
        out = (ctypes.c_int32 * room)()
        n = self._lib.llama_tokenize(self._vocab, data, len(data), out, room, add_special, parse_special)
        if n < 0:
            raise RuntimeError(f"llama_tokenize failed ({n})")
        return list(out[:n])
