"""The C loop over a decode-only step's layers (runtime/model/decode_layers.py) computes what the Python loop over
the same kernels computes, bit for bit: the same greedy tokens and the same logprobs, with the real model,
in bfloat16 and float32, at batch sizes that take the one-row and the many-row matmul."""

from __future__ import annotations

import threading

import pytest
import torch

import runtime.model.decode_layers as native_decode
import runtime.model.model
import runtime.runner.model_runner as model_runner
from runtime import Engine, SamplingParams
from runtime.kernels.library import load
from runtime.model.model import RotaryEmbedding
from runtime.model.rope_scaling import inverse_frequencies
from tests.runtime.conftest import CHATS

pytestmark = pytest.mark.slow  # loads the real model


def _generate(engine: Engine, prompts: list[str], c_loop: bool, monkeypatch) -> tuple[list, int]:
    """Greedy tokens and top-3 logprobs per prompt, with the C loop allowed or not; and how many steps it ran."""
    ran = []
    forward = native_decode.NativeDecode.forward

    def counted(self, *args):
        ran.append(args[0].shape[0])
        return forward(self, *args)

    with monkeypatch.context() as m:
        m.setattr(native_decode.NativeDecode, "forward", counted)
        if not c_loop:
            m.setattr(native_decode.NativeDecode, "possible", staticmethod(lambda model, kv: False))
        engine.model._native_decode = None  # decided again for this run
        params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=3)
        outs = engine.generate(prompts, params)
    engine.model._native_decode = None
    return [(o.token_ids, o.logprobs) for o in outs], len(ran)


def _pinned_engine(dtype: str, monkeypatch, **options) -> Engine:
    """The default model with the GGUF's blocks kept in this dtype (float32's default dequantizes them) and no
    prefix cache (a second run must prefill exactly as the first did). Routes pinned instead of measured (a
    busy machine can measure torch's kernel faster at some row count, and the C loop then rightly stands
    aside): the one-row kernel up to 4 rows, the many-row kernel from 5 where this CPU has its loops."""
    if load() is None:
        pytest.skip("the native kernels cannot be built here")
    monkeypatch.setattr(
        runtime.model.model, "measure_row_paths", lambda w: (4, 5 if w.native.tiles is not None else None)
    )
    return Engine.from_pretrained(
        dtype=dtype,
        device="cpu",
        quantization="gguf",
        kv_cache_bytes=64 << 20,
        enable_prefix_caching=False,
        **options,
    )


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_c_layer_loop_equals_python_loop(dtype, monkeypatch):
    engine = _pinned_engine(dtype, monkeypatch, max_num_seqs=40)
    assert engine.model.dtype == getattr(torch, dtype)
    many_rows = all(w.native.tiles is not None for w in engine.model._packed())
    for n in (1, 3, 5, 40):
        prompts = [CHATS[i % len(CHATS)] + " " * (i // len(CHATS)) for i in range(n)]
        with_c, steps = _generate(engine, prompts, True, monkeypatch)
        # every step decodes n rows at most, and those of n > 4 need the many-row loops
        assert (steps > 0) == (n <= 4 or many_rows), (n, steps)
        without_c, none = _generate(engine, prompts, False, monkeypatch)
        assert none == 0
        assert with_c == without_c


def test_dense_weights_keep_the_python_loop(engine_fp32, monkeypatch):
    """float32's default dequantizes the GGUF: dense projections, which the C loop does not take."""
    outs, steps = _generate(engine_fp32, CHATS[:2], True, monkeypatch)
    assert steps == 0
    assert all(len(tokens) == 12 for tokens, _ in outs)


def test_rope_tables_grow_to_the_same_values_as_whole_ones():
    """On CPU the tables start short and grow as later positions come; every row equals the table made for
    the whole context at once (the same float32 products, the same rounding)."""
    inv_freq = inverse_frequencies(64, 10000.0)
    rope = RotaryEmbedding(inv_freq, 20000, torch.bfloat16, torch.device("cpu"))
    assert rope.length == RotaryEmbedding.INITIAL_POSITIONS < 20000
    assert not rope.cover(100)
    first = RotaryEmbedding.INITIAL_POSITIONS
    assert rope.cover(first + 1) and rope.length == 2 * first  # doubles
    assert rope.cover(5 * first) and rope.length == 5 * first  # or takes the positions asked for
    assert rope.cover(20000) and rope.length == 20000 and not rope.cover(20001)
    freqs = torch.outer(torch.arange(20000, dtype=torch.int64).float(), inv_freq)
    cos, sin = freqs.cos().to(torch.bfloat16), freqs.sin().to(torch.bfloat16)
    assert torch.equal(rope.cos, torch.cat((cos, cos), dim=-1))
    assert torch.equal(rope.sin_signed, torch.cat((-sin, sin), dim=-1))


def test_tables_grown_mid_generation_give_the_same_tokens_and_move_the_c_loop(monkeypatch):
    """Tables that start at 8 positions grow during the prefills and again during decoding; the C loop,
    which holds their addresses, is made again and reads the new ones: the same tokens and logprobs as
    with tables that never grow."""
    if load() is None:
        pytest.skip("the native kernels cannot be built here")
    engine = Engine.from_pretrained(
        dtype="bfloat16",
        device="cpu",
        quantization="gguf",
        kv_cache_bytes=64 << 20,
        enable_prefix_caching=False,
    )
    model = engine.model
    prompts = CHATS[:3]
    whole, _ = _generate(engine, prompts, True, monkeypatch)
    assert model.rope.length == RotaryEmbedding.INITIAL_POSITIONS  # never grew
    monkeypatch.setattr(RotaryEmbedding, "INITIAL_POSITIONS", 8)
    old = model.rope
    model.rope = RotaryEmbedding(old.inv_freq, old.max_len, old.dtype, old.device, old.attention_factor)
    model.local_rope = model.rope
    lengths = []
    cover = RotaryEmbedding.cover

    def watched(self, positions):
        grown = cover(self, positions)
        lengths.append(self.length) if grown else None
        return grown

    monkeypatch.setattr(RotaryEmbedding, "cover", watched)
    engine.model._native_decode = None
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=3)
    grown = [(o.token_ids, o.logprobs) for o in engine.generate(prompts, params)]
    prompt = max(len(engine.tokenizer.encode(p)) for p in prompts)
    # grew in the prefill, then while decoding, to the last position
    assert lengths[0] >= prompt and len(lengths) >= 2 and lengths[-1] >= prompt + 11, (prompt, lengths)
    assert grown == whole
    loop = model._native_decode[1]
    assert loop is not None and all(
        layer.cos == model.rope.cos.data_ptr() and layer.sin_signed == model.rope.sin_signed.data_ptr()
        for layer in loop.layers
    )


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_decode_rows_split_between_threads_give_one_threads_tokens(dtype, monkeypatch):
    """set_split(parts): each part of a decode step's rows through every layer and the LM head on a thread of
    its own (the calling thread and helpers), each kernel on one thread. Each row's arithmetic is the one-thread
    step's for the part's rows, so the greedy tokens and logprobs are those of one thread and no split, at
    row counts whose parts take the one-row kernel, the many-row kernel, or one of each (9 rows in 2: 4 and 5),
    and in 3 parts; the prompts' prefill runs in two parts of whole sequences, each its own forward."""
    engine = _pinned_engine(dtype, monkeypatch, max_num_seqs=16, adaptive_threads=False)
    threads = torch.get_num_threads()
    lib = load()
    rows_kernel = lib.decode_layers_rows
    try:
        torch.set_num_threads(1)
        for n, parts in ((2, 2), (9, 2), (16, 2), (7, 3)):
            prompts = [CHATS[i % len(CHATS)] + " " * (i // len(CHATS)) for i in range(n)]
            alone, steps = _generate(engine, prompts, True, monkeypatch)
            assert steps > 0
            helpers = native_decode.set_split(parts)
            assert len(helpers) == parts - 1 and threading.get_native_id() not in helpers
            pool, handed = native_decode._pool, []
            submit = pool.submit
            pool.submit = lambda fn, *args, _submit=submit, _handed=handed: (
                _handed.append(fn) or _submit(fn, *args)
            )
            ran_on = []
            monkeypatch.setattr(
                lib,
                "decode_layers_rows",
                lambda *a, _on=ran_on: _on.append(threading.get_native_id()) or rows_kernel(*a),
            )
            prefill_parts = []
            monkeypatch.setattr(
                model_runner,
                "run_parts",
                lambda fns, _ran=prefill_parts: _ran.append(len(fns)) or native_decode.run_parts(fns),
            )
            try:
                split, _ = _generate(engine, prompts, True, monkeypatch)
            finally:
                del pool.submit
                native_decode.set_split(1)
            # every decode step ran one part of its layers on this thread and parts - 1 on the helpers, handed
            # them its LM head rows too, and the prompts' prefill ran in two parts of whole sequences
            assert ran_on.count(threading.get_native_id()) == steps, (ran_on, steps)
            layer_parts = sum(1 for tid in ran_on if tid in helpers)
            assert layer_parts == (parts - 1) * steps, (layer_parts, steps)
            assert len(ran_on) == parts * steps
            assert len(handed) > layer_parts
            assert prefill_parts and set(prefill_parts) == {2}
            assert split == alone, (n, parts)
    finally:
        native_decode.set_split(1)
        torch.set_num_threads(threads)
