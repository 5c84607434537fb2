"""Model files at the sizes people serve, for the sizes bench: Llama-shaped random weights written as F16
GGUF with gguf-py (SmolLM2's vocabulary and tokenizer, copied from the default model's file), quantized by
llama.cpp's own quantizer into the types people download. Built once into a cache folder
(`PRESCIENT_BENCH_CACHE`, default ~/.cache/prescient/sizes), never into the repository.

`python -m tests.bench.size_ladder 1b q4_k_m` prints the path of one file (building what is missing)."""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from runtime.model.checkpoint import default_model_path


@dataclass(frozen=True)
class Shape:
    name: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int = 49152  # SmolLM2's, whose tokenizer the files carry
    tied: bool = True

    @property
    def parameters(self) -> int:
        head_dim = self.hidden // self.heads
        attention = self.hidden * head_dim * (2 * self.heads + 2 * self.kv_heads)
        per_layer = attention + 3 * self.hidden * self.ffn + 2 * self.hidden
        return self.layers * per_layer + self.vocab * self.hidden * (1 if self.tied else 2) + self.hidden


SHAPES = {
    "135m": Shape("135m", 576, 30, 9, 3, 1536),
    "1b": Shape("1b", 2048, 16, 32, 8, 8192),  # Llama 3.2 1B
    "3b": Shape("3b", 3072, 28, 24, 8, 8192),  # Llama 3.2 3B
    "8b": Shape("8b", 4096, 32, 32, 8, 14336, tied=False),  # Llama 3.1 8B
}

# llama.cpp's file types (enum llama_ftype)
FTYPES = {"q4_0": 2, "q8_0": 7, "q4_k_s": 14, "q4_k_m": 15, "q5_k_m": 17, "q6_k": 18}


def cache_dir() -> Path:
    path = Path(os.environ.get("PRESCIENT_BENCH_CACHE", Path.home() / ".cache" / "prescient" / "sizes"))
    path.mkdir(parents=True, exist_ok=True)
    return path


def _copy_tokenizer(reader, writer) -> None:
    import gguf

    for field in reader.fields.values():
        if not field.name.startswith("tokenizer."):
            continue
        kind = field.types[0]
        if kind == gguf.GGUFValueType.ARRAY:
            sub = field.types[-1]
            if sub == gguf.GGUFValueType.STRING:
                values = [bytes(field.parts[i]).decode("utf-8") for i in field.data]
            else:
                values = [field.parts[i].tolist()[0] for i in field.data]
            writer.add_array(field.name, values)
        elif kind == gguf.GGUFValueType.STRING:
            writer.add_string(field.name, bytes(field.parts[field.data[0]]).decode("utf-8"))
        else:
            writer.add_key_value(field.name, field.parts[field.data[0]].tolist()[0], kind)


def write_f16(shape: Shape, path: Path, seed: int = 0) -> Path:
    """Random weights (normal, std 0.02; norms near 1) in F16, written one tensor at a time, so a file
    larger than memory's spare room can be made."""
    return write_llama(shape, path, seed)


def write_llama(shape: Shape, path: Path, seed: int = 0, encode=None) -> Path:
    """write_f16's file; `encode(name, w float32 [N, K]) -> (array, GGMLQuantizationType)` stores a matrix in
    another type (the array: its raw bytes for a block type), where it returns one (None: F16). Made whole
    in memory, for the small shapes of the tests."""
    import gguf

    rng = np.random.default_rng(seed)
    tmp = path.with_suffix(".partial")
    writer = gguf.GGUFWriter(str(tmp), "llama")
    writer.add_name(f"random llama {shape.name}")
    writer.add_context_length(8192)
    writer.add_embedding_length(shape.hidden)
    writer.add_block_count(shape.layers)
    writer.add_feed_forward_length(shape.ffn)
    writer.add_head_count(shape.heads)
    writer.add_head_count_kv(shape.kv_heads)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(500000.0)
    writer.add_vocab_size(shape.vocab)
    writer.add_rope_dimension_count(shape.hidden // shape.heads)
    writer.add_file_type(1)  # MOSTLY_F16
    _copy_tokenizer(gguf.GGUFReader(default_model_path()), writer)

    hd = shape.hidden // shape.heads
    tensors: list[tuple[str, tuple[int, ...]]] = [("token_embd.weight", (shape.vocab, shape.hidden))]
    for i in range(shape.layers):
        b = f"blk.{i}."
        tensors += [
            (b + "attn_norm.weight", (shape.hidden,)),
            (b + "attn_q.weight", (shape.heads * hd, shape.hidden)),
            (b + "attn_k.weight", (shape.kv_heads * hd, shape.hidden)),
            (b + "attn_v.weight", (shape.kv_heads * hd, shape.hidden)),
            (b + "attn_output.weight", (shape.hidden, shape.heads * hd)),
            (b + "ffn_norm.weight", (shape.hidden,)),
            (b + "ffn_gate.weight", (shape.ffn, shape.hidden)),
            (b + "ffn_up.weight", (shape.ffn, shape.hidden)),
            (b + "ffn_down.weight", (shape.hidden, shape.ffn)),
        ]
    tensors.append(("output_norm.weight", (shape.hidden,)))
    if not shape.tied:
        tensors.append(("output.weight", (shape.vocab, shape.hidden)))

    def weights(s: tuple[int, ...]) -> np.ndarray:
        if len(s) == 1:
            return (1.0 + 0.1 * rng.standard_normal(s)).astype(np.float32)
        w = np.empty(s, np.float16 if encode is None else np.float32)
        rows = max(1, (1 << 24) // s[1])
        for a in range(0, s[0], rows):  # 16M values at a time
            part = rng.standard_normal((min(rows, s[0] - a), s[1]), dtype=np.float32)
            w[a : a + rows] = part * np.float32(0.02)
        return w

    if encode is not None:
        for name, s in tensors:
            w = weights(s)
            coded = encode(name, w) if len(s) == 2 else None
            if coded is None:
                writer.add_tensor(name, w if len(s) == 1 else w.astype(np.float16))
            else:
                writer.add_tensor(name, coded[0], raw_shape=coded[0].shape, raw_dtype=coded[1])
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        tmp.rename(path)
        return path

    for name, s in tensors:
        dtype = np.dtype(np.float32 if len(s) == 1 else np.float16)
        writer.add_tensor_info(name, s, dtype, int(np.prod(s)) * dtype.itemsize)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for _, s in tensors:
        w = weights(s)
        writer.write_tensor_data(w)
        del w
    writer.close()
    tmp.rename(path)
    return path


def quantize(src: Path, dst: Path, ftype: int, threads: int | None = None) -> Path:
    """llama.cpp's own quantizer (llama-cpp-python's llama_model_quantize)."""
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = ftype
    params.nthread = threads or os.cpu_count() or 2
    tmp = dst.with_suffix(".partial")
    rc = llama_cpp.llama_model_quantize(str(src).encode(), str(tmp).encode(), params)
    if rc != 0:
        raise RuntimeError(f"llama_model_quantize({src} -> {dst}, ftype {ftype}) returned {rc}")
    tmp.rename(dst)
    return dst


def model_file(size: str, kind: str, log=print) -> Path:
    """The cached file of SHAPES[size] in FTYPES[kind] (or "f16"), built where missing."""
    shape = SHAPES[size]
    folder = cache_dir()
    f16 = folder / f"llama-{size}-f16.gguf"
    if not f16.exists():
        started = time.time()
        write_f16(shape, f16)
        log(f"wrote {f16} ({f16.stat().st_size / 2**20:,.0f} MiB) in {time.time() - started:.0f} s")
    if kind == "f16":
        return f16
    path = folder / f"llama-{size}-{kind}.gguf"
    if not path.exists():
        started = time.time()
        quantize(f16, path, FTYPES[kind])
        log(
            f"quantized {path.name} ({path.stat().st_size / 2**20:,.0f} MiB) in {time.time() - started:.0f} s"
        )
    return path


if __name__ == "__main__":
    print(model_file(sys.argv[1], sys.argv[2], log=lambda m: print(m, file=sys.stderr)))
