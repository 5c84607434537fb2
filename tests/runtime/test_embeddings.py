"""Pooling requests (SamplingParams.pooling) against transformers' final hidden states of the same weights:
last-token and mean pooling, through chunked prefill, beside generating requests, after a prefix hit."""

from __future__ import annotations

import pytest
import torch

from runtime import SamplingParams
from tests.random_llama import TINY, engine_for, hf_llama

pytestmark = pytest.mark.slow  # builds a transformers model

PROMPTS = [[5 + (7 * i + 3 * k) % 400 for i in range(n)] for k, n in enumerate((3, 40, 100, 17, 1))]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    hf = hf_llama(TINY)
    # a small step budget: the 100-token prompt prefills in chunks
    engine = engine_for(hf, tmp_path_factory.mktemp("emb"), torch.float32, "cpu", max_num_batched_tokens=32)
    return hf, engine


@torch.no_grad()
def reference(hf, ids: list[int], pooling: str) -> torch.Tensor:
    hidden = hf(torch.tensor([ids]), output_hidden_states=True).hidden_states[-1][0]  # after the final norm
    vector = hidden[-1] if pooling == "last" else hidden.mean(0)
    return torch.nn.functional.normalize(vector, dim=0)


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_pooled_hidden_states_match_transformers(models, pooling):
    hf, engine = models
    params = SamplingParams(max_tokens=1, pooling=pooling)
    generating = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    outs = engine.generate([*PROMPTS, PROMPTS[1]], [params] * len(PROMPTS) + [generating])
    for ids, out in zip(PROMPTS, outs):
        assert out.finish_reason == "stop" and out.token_ids == [2]  # the placeholder eos: nothing sampled
        ours = torch.tensor(out.embedding)
        assert ours.shape == (TINY["hidden_size"],)
        assert abs(ours.norm().item() - 1) < 1e-5
        diff = (ours - reference(hf, ids, pooling)).abs().max().item()
        assert diff < 1e-4, f"{pooling} pooling of {len(ids)} tokens differs by {diff}"
    assert outs[-1].embedding is None and len(outs[-1].token_ids) == 8
    # again: the prompts' blocks are in the prefix cache now (mean pooling must not use them)
    again = engine.generate(PROMPTS[2], params)[0]
    assert (torch.tensor(again.embedding) - torch.tensor(outs[2].embedding)).abs().max() < 1e-5
    assert not engine.has_unfinished_requests()


def test_pooling_refuses_generation_settings():
    with pytest.raises(ValueError, match="pooling"):
        SamplingParams(max_tokens=4, pooling="last")
    with pytest.raises(ValueError, match="pooling"):
        SamplingParams(max_tokens=1, pooling="cls")
