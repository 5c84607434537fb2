"""Fused projections whose parts are GGUF blocks of different kinds (a K-quant mix: q and k in Q4_K, v in
Q6_K), each part kept in its own kind's tiles (runtime.kernels.stacked_matmul), at every instruction-set level.

Weights: real K-quant bytes from llama.cpp's own quantizers (xllamacpp's library) on random float weights.
Oracles: each part multiplied alone by the same kernel (the stacked result must be those columns, bit for
bit), and numpy over gguf-py's de-quantization within the kernels' stated bound."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf import quants

from runtime import Engine
from runtime.kernels.quantized_matmul import KQ4_BITS, KQ5_BITS, q4_k_tiles, vector_loops
from runtime.kernels.stacked_matmul import StackedMatmul
from runtime.quant.gguf_blocks import GGUFBlocks
from runtime.quant.linear import Int4Linear, pack_native, pack_stacked
from tests.bench.size_ladder import Shape, write_llama
from tests.runtime.native_levels import kernel_level  # noqa: F401 (a fixture)
from tests.runtime.test_kquant_kernels import ggml, kernel_bound, llama_quantize  # noqa: F401 (ggml: a fixture)
from tests.runtime.test_native_decode import _generate

K = 512


def real_blocks(lib, kind: str, n: int, seed: int) -> tuple[GGUFBlocks, np.ndarray]:
    w = np.random.default_rng(seed).standard_normal((n, K)).astype(np.float32) * 0.05
    raw = llama_quantize(lib, kind, w)
    exact = quants.dequantize(raw, gguf.GGMLQuantizationType[kind]).reshape(n, K)
    assert np.abs(exact - w).max() < 0.05  # a real quantization of w, not noise
    return GGUFBlocks.parse(kind, raw, (n, K)), exact


MIXES = {
    "q4_k_m attention": [("Q4_K", 128), ("Q4_K", 64), ("Q6_K", 64)],
    "q5_k_m attention": [("Q5_K", 64), ("Q5_K", 32), ("Q6_K", 32)],
    "q8_0 and q4_0": [("Q8_0", 32), ("Q4_0", 96)],
}


@pytest.mark.parametrize("mix", MIXES)
@pytest.mark.parametrize("rows", [1, 3, 9, 70])
def test_stacked_parts_are_each_parts_own_product(mix, rows, ggml, kernel_level):  # noqa: F811
    made = [real_blocks(ggml, kind, n, seed) for seed, (kind, n) in enumerate(MIXES[mix])]
    w = pack_stacked([b for b, _ in made], torch.float32, torch.device("cpu"))
    if not vector_loops():  # the generic level makes no tiles: the parts are stacked in one form, as before
        assert w is None
        return
    assert isinstance(w, Int4Linear) and isinstance(w.native, StackedMatmul)
    alone = [pack_native(b, torch.float32).native for b, _ in made]
    # each part in its own kind's layout: Q6_K in its 6-bit tiles, none widened to another kind's
    assert [p.bits for p in w.native.parts] == [p.bits for p in alone]
    x = torch.from_numpy(np.random.default_rng(rows).standard_normal((rows, K)).astype(np.float32))
    got = w(x)
    want = torch.cat([p.gemm(x) for p in alone], dim=1)
    assert torch.equal(got, want)
    exact = np.concatenate([e for _, e in made])
    bound = np.concatenate([kernel_bound(b, x.numpy()) for b, _ in made], axis=1)
    assert (np.abs(got.numpy() - x.numpy() @ exact.T) <= bound).all()


def test_bfloat16_rows_and_lookups(ggml):  # noqa: F811
    made = [real_blocks(ggml, kind, n, seed) for seed, (kind, n) in enumerate(MIXES["q4_k_m attention"])]
    w = pack_stacked([b for b, _ in made], torch.bfloat16, torch.device("cpu"))
    x = torch.randn(5, K).to(torch.bfloat16)
    alone = [pack_native(b, torch.bfloat16).native for b, _ in made]
    assert torch.equal(w(x), torch.cat([p.gemm(x) for p in alone], dim=1))
    ids = torch.tensor([0, 127, 128, 191, 192, 255])
    starts = {0: 0, 127: 0, 128: 128, 191: 128, 192: 192, 255: 192}
    rows = w.native.dequantize_rows(ids)
    for i, r in zip(ids.tolist(), rows):
        part = [0, 1, 2][[0, 128, 192].index(starts[i])]
        assert torch.equal(r, alone[part].dequantize_rows(torch.tensor([i - starts[i]]))[0])


def test_parts_of_one_kind_are_not_stacked(ggml):  # noqa: F811
    made = [real_blocks(ggml, "Q4_K", n, seed) for seed, n in enumerate([64, 32])]
    assert pack_stacked([b for b, _ in made], torch.float32, torch.device("cpu")) is None


# A Q4_K_M-like mix, as llama.cpp's quantizer writes one: q, k, gate, up in Q4_K; v and down of layer 0 in
# Q6_K (of layer 1 in Q4_K); the tied embedding in Q6_K.
TINY = Shape("tiny", 256, 2, 4, 2, 512)


def k_m_like(lib, base: str):
    """A Q4_K_M (base Q4_K) or Q5_K_M (base Q5_K) file's mix of kinds."""

    def encode(name: str, w: np.ndarray):
        six = name == "token_embd.weight" or (
            name.startswith("blk.0.") and ("attn_v" in name or "down" in name)
        )
        kind = "Q6_K" if six else base
        return llama_quantize(lib, kind, w), gguf.GGMLQuantizationType[kind]

    return encode


@pytest.fixture(scope="module", params=["Q4_K", "Q5_K"])
def mixed_file(ggml, tmp_path_factory, request):  # noqa: F811
    base = request.param
    path = tmp_path_factory.mktemp("mixed") / f"tiny-{base.lower()}_m.gguf"
    return base, write_llama(TINY, path, seed=3, encode=k_m_like(ggml, base))


def test_a_k_quant_mix_loads_each_matrix_in_its_own_kind_and_decodes_as_dense(mixed_file, monkeypatch):
    base, mixed_file = mixed_file
    packed = Engine.from_pretrained(
        str(mixed_file), dtype="float32", quantization="gguf", kv_cache_bytes=16 << 20
    )
    m = packed.model
    if vector_loops():
        # Q4_K's and Q5_K's own tiles where the level has them
        own, fallback = (KQ4_BITS, 4) if base == "Q4_K" else (KQ5_BITS, 8)
        k = own if q4_k_tiles() else fallback
        # q and k (one kind, one run of rows) in one multiplication, v in its own
        parts = m.layers[0].qkv.native.parts
        assert [p.bits for p in parts] == [k, 6]
        kv_rows = TINY.hidden // TINY.heads * TINY.kv_heads
        assert [p.out_features for p in parts] == [TINY.hidden + kv_rows, kv_rows]
        assert m.layers[0].down.native.bits == 6 and m.layers[1].down.native.bits == k
        assert not isinstance(m.layers[1].qkv.native, StackedMatmul)  # one kind: one layout
        # the tied Q6_K table held once, in its 6-bit tiles: the LM head's and the lookups' bytes
        assert m.lm_head.native.bits == 6 and m.embed.blocks is m.lm_head.native
    dense = Engine.from_pretrained(
        str(mixed_file), dtype="float32", quantization="none", kv_cache_bytes=16 << 20
    )
    prompt = list(range(1000, 1040))
    got, want = packed.prompt_logits(prompt), dense.prompt_logits(prompt)
    # 8-bit activations and float16 block scales: a few percent of the logits' spread at most
    assert ((got - want).norm(dim=-1) / want.norm(dim=-1)).max() < 0.05
    # the C layer loop (stacked parts walked in C) gives the Python loop's tokens and logprobs
    with_c, steps = _generate(packed, [prompt, prompt[:20]], True, monkeypatch)
    assert steps > 0 or not vector_loops()
    without_c, none = _generate(packed, [prompt, prompt[:20]], False, monkeypatch)
    assert none == 0 and with_c == without_c
