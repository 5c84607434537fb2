"""Every supported family against transformers, from a Hugging Face directory and from a GGUF.

A tiny random model of each family (tests/random_families.py: sliding windows shorter than the prompt,
soft-caps that bite, llama3 / LongRoPE scaling over a 32-token original context, head_dim != hidden /
heads, randomised biases and norm weights) is saved both ways; our engine, in float32, must give
transformers' logits within 1e-4 and its 32 greedy tokens, from both files. A second test shows that each
feature matters: the same weights with the feature turned off miss transformers' logits by far.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from runtime import Engine, SamplingParams
from runtime.attention import torch_backend
from runtime.kernels import paged_attention as native_attention
from runtime.model.checkpoint import load_checkpoint
from runtime.model.model import LlamaModel
from runtime.model.tokenizer import Tokenizer
from tests.random_families import FAMILIES, PROMPT_LEN, VOCAB, hf_model, save_hf_dir, write_gguf
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
    diff = (engine.prompt_logits(ids) - theirs).abs().max().item()
    assert diff < 1e-4, f"{name} from {source}: max logit difference {diff}"
    out = engine.generate([ids], SamplingParams(max_tokens=32, temperature=0, ignore_eos=True))[0]
    assert out.token_ids == expected
    cap = engine.model.config.attn_logit_softcap
    assert set(limits) == ({(w, cap) for w in engine.model.windows} if c_kernels else set())


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
