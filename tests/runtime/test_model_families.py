"""Every supported family against transformers, from a Hugging Face directory and from a GGUF.

A tiny random model of each family (tests/random_families.py: sliding windows shorter than the prompt,
soft-caps that bite, llama3 / LongRoPE scaling over a 32-token original context, head_dim != hidden /
heads, randomised biases and norm weights) is saved both ways; our engine, in float32, must give
transformers' logits within 1e-4 and its 32 greedy tokens, from both files. A second test shows that each
feature matters: the same weights with the feature turned off miss transformers' logits by far. Every family
runs on the fused C layer ops (asserted), and its decode steps on the C layer loop (asserted: the same tokens
and logprobs as the Python loop over the same kernels).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import runtime.model.decode_layers as native_decode
import runtime.model.model
from runtime import Engine, SamplingParams
from runtime.attention import torch_backend
from runtime.kernels import layer_ops as native_layer_ops
from runtime.kernels import paged_attention as native_attention
from runtime.model.checkpoint import load_checkpoint
from runtime.model.model import LlamaModel
from runtime.model.tokenizer import Tokenizer
from tests.random_families import FAMILIES, PROMPT_LEN, VOCAB, hf_model, packable, save_hf_dir, write_gguf
from tests.runtime.conftest import reference_greedy

pytestmark = pytest.mark.slow  # builds and runs transformers models

FEATURES = {
    "llama3": {"rope_freq_factors": None},
    "mistral": {"sliding_window": None},
    "qwen2": {"qkv_bias": False},
    "qwen3": {"qk_norm": False},
    "gemma2": {
        "sliding_window": None,
        "attn_logit_softcap": None,
        "final_logit_softcap": None,
        "embed_scale": 1.0,
        "sandwich_norms": False,
        "hidden_act": "silu",
    },
    "gemma3": {"rope_theta_local": None, "rope_linear_factor": 1.0, "qk_norm": False, "sliding_window": None},
    "phi3": {"rope_freq_factors": None, "rope_attention_factor": 1.0, "sliding_window": None},
}
"""Per family, config fields set back to plain Llama's value: each must change the logits."""


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    """(family, transformers model, HF directory, GGUF file, prompt ids, transformers' logits and 32 greedy
    tokens)."""
    name = request.param
    model = hf_model(name)
    tmp = tmp_path_factory.mktemp(name)
    hf_dir = save_hf_dir(model, tmp / "hf")
    gguf_file = write_gguf(model, name, tmp / f"{name}.gguf")
    ids = torch.randint(3, VOCAB, (PROMPT_LEN,), generator=torch.Generator().manual_seed(5)).tolist()
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0]
    return name, model, hf_dir, gguf_file, ids, logits, reference_greedy(model, ids, 32)


def _counting_fused_calls(monkeypatch) -> list[int]:
    """Counts the fused layer ops' RoPE calls (one a layer and step)."""
    calls = []
    rope_write_kv = native_layer_ops.rope_write_kv

    def counted(*args, **kwargs):
        calls.append(1)
        return rope_write_kv(*args, **kwargs)

    monkeypatch.setattr(native_layer_ops, "rope_write_kv", counted)
    return calls


@pytest.mark.parametrize("source", ["hf", "gguf"])
def test_logits_and_greedy_tokens_match_transformers(family, source, monkeypatch):
    """Logits within 1e-4 and the same 32 greedy tokens; every layer's attention, windowed and soft-capped
    ones too, runs in the C backend's kernels where they take the head_dim (the PyTorch windowed path is
    then not called), else in the PyTorch backend."""
    name, _, hf_dir, gguf_file, ids, theirs, expected = family
    path = hf_dir if source == "hf" else gguf_file
    engine = Engine.from_pretrained(str(path), dtype="float32", device="cpu", kv_cache_bytes=4 << 20)
    c_kernels = engine.model.config.head_dim % 16 == 0  # qwen2's and phi3's head_dim 20 is not one they take
    assert engine.runner.attention.name == ("c" if c_kernels else "torch")
    limits = []  # (window, softcap) of every C kernel call
    for kernel in ("decode_attention", "prefill_attention"):
        real = getattr(native_attention, kernel)
        at = 6 if kernel == "decode_attention" else 7  # where window and softcap sit in its arguments
        monkeypatch.setattr(
            native_attention, kernel, lambda *a, real=real, at=at: limits.append(a[at:]) or real(*a)
        )
    if c_kernels:
        monkeypatch.setattr(torch_backend, "windowed_attention", None)  # calling it would fail the test
    arch = {"llama3": "llama", "mistral": "llama"}.get(name, name)
    assert engine.model.config.architecture == arch
    assert engine.model.layer_ops is native_layer_ops and engine.model.native_decode
    fused = _counting_fused_calls(monkeypatch)
    diff = (engine.prompt_logits(ids) - theirs).abs().max().item()
    assert diff < 1e-4, f"{name} from {source}: max logit difference {diff}"
    out = engine.generate([ids], SamplingParams(max_tokens=32, temperature=0, ignore_eos=True))[0]
    assert out.token_ids == expected
    cap = engine.model.config.attn_logit_softcap
    assert set(limits) == ({(w, cap) for w in engine.model.windows} if c_kernels else set())
    assert len(fused) >= 33 * engine.model.config.num_layers  # the prompt and every decode step, fused


def test_bfloat16_follows_transformers(family, monkeypatch):
    """bfloat16 on the fused path: the logits stay near float32 transformers' (a few bfloat16 roundings a
    layer) and the first greedy token agrees."""
    name, _, hf_dir, _, ids, theirs, expected = family
    engine = Engine.from_pretrained(str(hf_dir), dtype="bfloat16", device="cpu", kv_cache_bytes=4 << 20)
    fused = _counting_fused_calls(monkeypatch)
    logits = engine.prompt_logits(ids)
    assert fused
    assert (logits - theirs).abs().max().item() < 0.05 * theirs.abs().max().item(), name
    out = engine.generate([ids], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))[0]
    assert len(out.token_ids) == 4 and out.token_ids[0] == expected[0]


@pytest.fixture(scope="module", params=list(FAMILIES))
def packable_family(request, tmp_path_factory):
    """(family, HF directory, prompt ids) of a model with packable widths (random_families.packable)."""
    name = request.param
    extra = packable(name)
    hf_dir = save_hf_dir(hf_model(name, **extra), tmp_path_factory.mktemp(f"{name}-packable") / "hf")
    ids = torch.randint(3, VOCAB, (PROMPT_LEN,), generator=torch.Generator().manual_seed(6)).tolist()
    return name, hf_dir, ids


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_c_layer_loop_takes_the_family(packable_family, dtype, monkeypatch):
    """Packed (int8) projections: every family's decode steps run in the C layer loop (windows and soft-caps
    in the C attention kernel), with the same tokens and logprobs as the Python loop over the same kernels."""
    name, hf_dir, ids = packable_family
    monkeypatch.setattr(runtime.model.model, "measure_row_paths", lambda w: (4, None))  # the one-row kernel
    engine = Engine.from_pretrained(
        str(hf_dir), dtype=dtype, device="cpu", quantization="int8", kv_cache_bytes=4 << 20
    )
    model = engine.model
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=3)
    ran = []
    forward = native_decode.NativeDecode.forward

    def counted(self, *args):
        ran.append(1)
        return forward(self, *args)

    monkeypatch.setattr(native_decode.NativeDecode, "forward", counted)
    model._native_decode = None
    with_c = [(o.token_ids, o.logprobs) for o in engine.generate([ids, ids[:20]], params)]
    assert ran, name
    monkeypatch.setattr(native_decode.NativeDecode, "possible", staticmethod(lambda model, kv: False))
    model._native_decode = None
    without_c = [(o.token_ids, o.logprobs) for o in engine.generate([ids, ids[:20]], params)]
    assert with_c == without_c


def test_each_feature_changes_the_logits(family):
    """The config makes every feature of the family bite: without it, the logits are far off."""
    name, _, hf_dir, _, ids, theirs, _ = family
    ckpt = load_checkpoint(str(hf_dir))
    tokenizer = Tokenizer(ckpt.tokenizer)
    for field, plain in FEATURES[name].items():
        config = dataclasses.replace(ckpt.config, **{field: plain})
        model = LlamaModel(config, ckpt.weights, torch.float32, torch.device("cpu"))
        engine = Engine(model, tokenizer, None, kv_cache_bytes=4 << 20)
        diff = (engine.prompt_logits(ids) - theirs).abs().max().item()
        assert diff > 1e-2, f"{name}: {field}={plain!r} changes the logits by only {diff}"


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs Triton (the test extra)")
def test_triton_layer_ops_take_every_family_in_the_interpreter(tmp_path):
    """CUDA's fused path on CPU under Triton's interpreter: with the Triton twins as the layer ops, each
    family scores a prompt within 1e-4 of transformers (QKV bias, q/k norms, GELU, sandwich norms, embedding
    scale, two RoPE bases, windows and soft-caps all on the path)."""
    script = textwrap.dedent(f"""
        import torch
        from runtime import Engine
        from runtime.kernels import triton_layer_ops
        from tests.random_families import FAMILIES, PROMPT_LEN, VOCAB, hf_model, packable, save_hf_dir
        import pathlib
        ids = torch.randint(3, VOCAB, (PROMPT_LEN,), generator=torch.Generator().manual_seed(5)).tolist()
        for name in FAMILIES:
            # the interpreter's time grows with the tokens: 20 are past every window; phi3 takes all 40, past
            # its 32-token original context, where its long RoPE factors apply
            prompt = ids if name == "phi3" else ids[:20]
            # two layers (the interpreter runs each kernel's programs one by one in Python): the second's norm
            # takes the first's output; gemma3's are one sliding and one global layer
            layers = dict(num_hidden_layers=2)
            if name == "gemma3":
                layers["layer_types"] = ["sliding_attention", "full_attention"]
            model = hf_model(name, **packable(name), **layers)
            path = save_hf_dir(model, pathlib.Path({str(tmp_path)!r}) / name)
            with torch.no_grad():
                theirs = model(torch.tensor([prompt])).logits[0]
            engine = Engine.from_pretrained(str(path), dtype="float32", device="cpu", kv_cache_bytes=4 << 20)
            assert engine.model.config.head_dim == 32
            engine.model.layer_ops = triton_layer_ops
            diff = (engine.prompt_logits(prompt) - theirs).abs().max().item()
            assert diff < 1e-4, (name, diff)
        print("OK")
    """)
    env = dict(os.environ, TRITON_INTERPRET="1")
    done = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0 and done.stdout.strip().endswith("OK"), done.stderr[-3000:]
