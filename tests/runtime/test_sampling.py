"""Sampling knobs and stop conditions, checked against their definitions."""

from __future__ import annotations

import pytest
import torch

from runtime import SamplingParams
from runtime.kernels import library as native_kernels
from runtime.kernels import nucleus_sampling as native_sampling
from runtime.kernels.library import load
from runtime.sample.sampler import sample
from tests.random_llama import TINY, engine_for, hf_llama
from tests.runtime.conftest import chat_ids
from tests.runtime.native_levels import LEVELS, kernel_level  # noqa: F401 (a fixture)


@pytest.fixture(params=[*(f"native-{level}" for level in LEVELS), "pytorch"])
def sampling_path(request, monkeypatch):
    """Each distribution test runs on both paths: the C kernel (rows without top-k) at every level this CPU
    runs, and PyTorch's ops."""
    if request.param == "pytorch":
        monkeypatch.setattr(native_sampling, "usable", lambda logits: False)
        yield request.param
        return
    with native_kernels.use_level(request.param.removeprefix("native-")):
        yield request.param


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The engine on a copy of a random Llama's weights (transformers' own initialisation): seeded draws do
    not depend on the model."""
    return engine_for(hf_llama(TINY, seed=4), tmp_path_factory.mktemp("tiny"), torch.float32, "cpu")


def test_seeded_sampling_is_reproducible_and_batch_independent(tiny):
    prompt = [3 + (11 * j) % 400 for j in range(30)]
    params = SamplingParams(max_tokens=20, temperature=0.9, top_p=0.95, seed=1234, ignore_eos=True)
    alone = tiny.generate([prompt], params)[0].token_ids
    others = [[5 + n, 40 + 3 * n, 7] * (n + 2) for n in range(3)]
    mixed = tiny.generate(others + [prompt], [SamplingParams(max_tokens=20, temperature=1.0)] * 3 + [params])
    assert mixed[-1].token_ids == alone
    other_seed = tiny.generate(
        [prompt], SamplingParams(max_tokens=20, temperature=0.9, top_p=0.95, seed=99, ignore_eos=True)
    )[0].token_ids
    assert other_seed != alone


def test_top_k_one_is_greedy_and_top_p_tiny_is_greedy(sampling_path):
    logits = torch.randn(4, 1000)
    greedy = logits.argmax(-1).tolist()
    gens = [torch.Generator().manual_seed(i) for i in range(4)]
    assert sample(logits, [SamplingParams(temperature=1.0, top_k=1)] * 4, gens) == greedy
    assert sample(logits, [SamplingParams(temperature=1.0, top_p=1e-6)] * 4, gens) == greedy


def test_top_k_draws_only_from_the_k_most_likely(sampling_path):
    logits = torch.randn(1, 500)
    allowed = set(logits[0].topk(5).indices.tolist())
    gen = torch.Generator().manual_seed(0)
    seen = {sample(logits, [SamplingParams(temperature=2.0, top_k=5)], [gen])[0] for _ in range(300)}
    assert seen <= allowed and len(seen) > 1


def test_top_p_draws_only_from_the_nucleus(sampling_path):
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    logits = probs.log()
    gen = torch.Generator().manual_seed(0)
    seen = {sample(logits, [SamplingParams(temperature=1.0, top_p=0.8)], [gen])[0] for _ in range(400)}
    assert seen == {0, 1}  # 0.5 + 0.3 reaches 0.8: the rest is cut


def _nucleus_by_sort(logits: torch.Tensor, temperature: float, top_p: float, top_k: int = 0) -> torch.Tensor:
    """The definition, computed with a full sort (the sampler never sorts): keep the largest probabilities
    until the mass before the next one reaches top_p, renormalise."""
    probs = torch.softmax(logits / temperature, dim=-1)
    values, order = probs.sort(descending=True)
    if top_k:
        values = torch.softmax((logits / temperature)[order][:top_k], dim=-1)
        order = order[:top_k]
    keep = (values.cumsum(0) - values) < top_p
    out = torch.zeros_like(probs)
    out[order[keep]] = values[keep]
    return out / out.sum()


def test_top_p_and_top_k_rows_follow_their_nucleus_in_a_mixed_batch(sampling_path):
    torch.manual_seed(3)
    logits = torch.randn(5, 40) * torch.tensor([[0.5], [2.0], [1.0], [3.0], [0.3]])
    params = [
        SamplingParams(temperature=1.0, top_p=0.9),  # a flat row: a wide nucleus, many rejections
        SamplingParams(temperature=0.7, top_p=0.5),
        SamplingParams(temperature=0),
        SamplingParams(temperature=1.3, top_k=6, top_p=0.8),
        SamplingParams(temperature=0.8, top_p=0.97),
    ]
    copies = 3000  # each row repeated: one call draws them all (rows without a seed share the global RNG)
    batch = logits.repeat(copies, 1)
    draws = torch.tensor(sample(batch, params * copies, [None] * len(batch))).view(copies, 5)
    assert (draws[:, 2] == logits[2].argmax()).all()
    for row, p in [(0, params[0]), (1, params[1]), (3, params[3]), (4, params[4])]:
        expected = _nucleus_by_sort(logits[row], p.temperature, p.top_p, max(p.top_k, 0))
        freq = torch.bincount(draws[:, row], minlength=40).float() / len(draws)
        assert set(draws[:, row].tolist()) <= set(expected.nonzero().flatten().tolist()), row
        assert torch.allclose(freq, expected, atol=0.03), (row, freq, expected)


def test_a_large_vocabulary_follows_its_nucleus(sampling_path):
    """A vocabulary of the model's size with a long tail, a few masked (-inf) tokens and rows at several
    temperatures and top-p: each row's draws stay in its nucleus and follow it (total variation)."""
    torch.manual_seed(11)
    vocab = 49152
    logits = torch.randn(4, vocab) * 2.5
    logits[:, 7] = 9.0  # one likely token, then a tail
    logits[:, 100:110] = float("-inf")
    params = [
        SamplingParams(temperature=0.8, top_p=0.9),
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.5, top_p=0.6),
        SamplingParams(temperature=1.2, top_p=0.95),
    ]
    copies = 600
    draws = torch.tensor(sample(logits.repeat(copies, 1), params * copies, [None] * 4 * copies)).view(
        copies, 4
    )
    assert not ((draws >= 100) & (draws < 110)).any()
    for row, p in enumerate(params):
        expected = _nucleus_by_sort(logits[row], p.temperature, p.top_p)
        assert set(draws[:, row].tolist()) <= set(expected.nonzero().flatten().tolist()), row
        # the likely token's share, and the tail's, as the distribution says
        assert abs((draws[:, row] == 7).float().mean() - expected[7]) < 0.06, (row, expected[7])


@pytest.mark.usefixtures("kernel_level")
def test_native_rows_without_finite_logits_and_seeded_draws():
    if load() is None:
        pytest.fail("the native kernels did not build here")
    logits = torch.full((3, 300), float("-inf"))
    logits[1, 42] = 1.0  # one finite logit: always that one
    logits[2] = torch.randn(300)
    uniforms = torch.tensor([0.5, 0.999, 0.25], dtype=torch.float64)
    out = native_sampling.nucleus_sample(logits, [1.0, 0.7, 0.9], [0.9, 0.9, 0.8], uniforms).tolist()
    assert out[0] == 0 and out[1] == 42  # no finite logit: the first largest, as argmax takes
    # a row's token depends only on its logits, parameters and uniform: the same in any batch
    batch = torch.randn(8, 300)
    batch[5] = logits[2]
    single = native_sampling.nucleus_sample(logits[2:3], [0.9], [0.8], uniforms[2:3])
    batch_u = torch.rand(8, dtype=torch.float64)
    batch_u[5] = 0.25
    again = native_sampling.nucleus_sample(
        batch, [1.0] * 5 + [0.9] + [1.0] * 2, [1.0] * 5 + [0.8] + [1.0] * 2, batch_u
    )
    assert again[5] == single[0] == out[2]


@pytest.mark.usefixtures("kernel_level")
@pytest.mark.parametrize("vocab", [1, 5, 16, 300, 49_152, 262_145])
def test_native_greedy_rows_are_torch_argmax(vocab):
    """greedy_sample returns torch.argmax's index for every row: random rows, ties (the first wins, across
    and within vector lanes and in the tail), a NaN (the first NaN), rows of -inf, one row broadcast, strided
    rows, and a batch large enough to share its rows over the threads."""
    if load() is None:
        pytest.fail("the native kernels did not build here")
    gen = torch.Generator().manual_seed(vocab)
    logits = torch.randn(40, vocab + 3, generator=gen)[:, :vocab]  # strided rows
    big = float(logits.max()) + 1
    for row, spots in enumerate([[0, vocab - 1], [vocab - 1], [vocab // 2, vocab // 2 + 1], [vocab - 1, 0]]):
        logits[row, [i % vocab for i in spots]] = big  # tied maxima: the first index wins
    logits[4] = float("-inf")
    logits[5, vocab // 3] = float("nan")
    logits[6, [vocab // 3, vocab - 1]] = float("nan")
    logits[7] = 0.0
    logits[8, -1] = float("inf")
    logits[9] = float("-inf")
    logits[9, vocab - 1] = -1e30
    assert native_sampling.greedy_sample(logits).tolist() == logits.argmax(dim=-1).tolist()
    one = logits[2:3]
    assert native_sampling.greedy_sample(one).tolist() == one.argmax(dim=-1).tolist()


@pytest.mark.usefixtures("kernel_level")
def test_native_draws_barely_move_when_the_logits_barely_move():
    """The same uniform on logits that differ by float noise (another batch, a recomputation after
    preemption) draws the same token almost always: an inverse CDF in index order would move across the run of
    unlikely tokens where its target lands (a seeded request then changes its output under load)."""
    if load() is None:
        pytest.fail("the native kernels did not build here")
    torch.manual_seed(5)
    vocab, n = 49152, 400
    logits = torch.randn(1, vocab) * 2.0
    logits[0, :20] += 8.0  # a few likely tokens and a long, diffuse tail (~a third of the mass)
    noisy = logits + torch.randn(1, vocab) * 1e-4  # an inverse CDF in index order keeps ~95% here
    uniforms = torch.rand(n, dtype=torch.float64)
    a = native_sampling.nucleus_sample(logits.expand(n, vocab), [1.0] * n, [1.0] * n, uniforms)
    b = native_sampling.nucleus_sample(noisy.expand(n, vocab), [1.0] * n, [1.0] * n, uniforms)
    tail = (a >= 20).float().mean().item()
    assert 0.1 < tail < 0.6, tail  # the draws do reach the tail, where an inverse CDF is fragile
    assert (a == b).float().mean().item() >= 0.995


def test_temperature_sampling_follows_the_distribution(sampling_path):
    probs = torch.tensor([0.6, 0.3, 0.1])
    gen = torch.Generator().manual_seed(7)
    draws = [
        sample(probs.log().unsqueeze(0), [SamplingParams(temperature=1.0)], [gen])[0] for _ in range(3000)
    ]
    freq = torch.bincount(torch.tensor(draws), minlength=3).float() / len(draws)
    assert torch.allclose(freq, probs, atol=0.03)


def test_stop_string_is_removed_and_reported(engine_fp32):
    prompt = chat_ids(engine_fp32.tokenizer, "Count from 1 to 20, separated by commas.")
    free = engine_fp32.generate([prompt], SamplingParams(max_tokens=40, temperature=0))[0]
    assert "7" in free.text, free.text
    stop_at = free.text[free.text.index("7") : free.text.index("7") + 2]
    out = engine_fp32.generate([prompt], SamplingParams(max_tokens=40, temperature=0, stop=[stop_at]))[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop_at
    assert out.text == free.text[: free.text.index(stop_at)]


def test_stop_token_ids_and_max_tokens(engine_fp32):
    prompt = chat_ids(engine_fp32.tokenizer, "Write a long poem about autumn.")
    free = engine_fp32.generate([prompt], SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))[0]
    assert len(free.token_ids) == 16 and free.finish_reason == "length"
    target = free.token_ids[5]
    out = engine_fp32.generate(
        [prompt], SamplingParams(max_tokens=16, temperature=0, stop_token_ids=[target])
    )[0]
    cut = free.token_ids.index(target)
    assert out.token_ids == free.token_ids[: cut + 1]
    assert out.finish_reason == "stop" and out.stop_reason == target


def test_ignore_eos_runs_past_end_of_turn(engine_fp32):
    prompt = chat_ids(engine_fp32.tokenizer, "Say just the word 'yes'.")
    stopped = engine_fp32.generate([prompt], SamplingParams(max_tokens=20, temperature=0))[0]
    assert stopped.finish_reason == "stop" and stopped.token_ids[-1] == engine_fp32.tokenizer.eos_token_id
    longer = engine_fp32.generate([prompt], SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))[0]
    assert len(longer.token_ids) == 20 and longer.token_ids[: len(stopped.token_ids)] == stopped.token_ids


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(max_tokens=0), "max_tokens"),
        (dict(temperature=-0.5), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_k=-3), "top_k"),
        (dict(max_tokens="8"), "max_tokens"),
        (dict(stop=[""]), "stop"),
    ],
)
def test_bad_sampling_params_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


@pytest.fixture(scope="module")
def echo(tmp_path_factory):
    """transformers' Llama with random weights made to repeat itself, as a language model does on a list asked
    twice: its LM head is its embedding table (x3) and its layers' outputs are damped (x0.3), so tokens it
    has seen stand out. The engine on a copy of its weights, a prompt ending in the model's own greedy output,
    and the greedy output of the prompt without penalties. The penalties act on the logits, whatever the model;
    this one makes each of them, the prompt's part in the repetition penalty and the output-only counts of
    frequency and presence decide some token (checked against altered formulas when it was chosen)."""
    hf = hf_llama(TINY, seed=4)
    with torch.no_grad():
        hf.lm_head.weight.copy_(hf.model.embed_tokens.weight * 3)
        for layer in hf.model.layers:
            layer.self_attn.o_proj.weight.mul_(0.3)
            layer.mlp.down_proj.weight.mul_(0.3)
    engine = engine_for(hf, tmp_path_factory.mktemp("penalties"), torch.float32, "cpu", num_blocks=64)
    greedy = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    start = [3 + (7 * j) % 30 for j in range(20)]
    prompt = start + engine.generate([start], greedy)[0].token_ids
    plain = engine.generate([prompt], SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))[0]
    return hf, engine, prompt, plain.token_ids


@pytest.mark.parametrize(
    "penalties",
    [
        dict(frequency_penalty=1.5),
        dict(presence_penalty=2.0),
        dict(repetition_penalty=1.3),
        dict(repetition_penalty=1.2, frequency_penalty=0.5, presence_penalty=-0.5),
    ],
)
def test_penalties_greedy_equal_transformers_with_the_published_formulas(echo, penalties):
    """Greedy under penalties against transformers' forward on the same weights, with the repetition penalty
    from transformers' own logits processor (prompt and output tokens) and OpenAI's documented
    frequency/presence formula (output tokens only): logit[j] -= count[j] * frequency + (count[j] > 0) *
    presence."""
    from transformers import RepetitionPenaltyLogitsProcessor

    model, engine, prompt, plain = echo
    rep = RepetitionPenaltyLogitsProcessor(penalties.get("repetition_penalty", 1.0))
    ids, expected = torch.tensor([prompt]), []
    with torch.no_grad():
        out = model(ids, use_cache=True)
        for _ in range(24):
            logits = rep(ids, out.logits[:, -1].float().clone())[0]
            counts = torch.bincount(torch.tensor(expected, dtype=torch.int64), minlength=logits.shape[0])
            logits -= penalties.get("frequency_penalty", 0) * counts + penalties.get(
                "presence_penalty", 0
            ) * (counts > 0)
            token = int(logits.argmax())
            expected.append(token)
            ids = torch.cat([ids, torch.tensor([[token]])], dim=1)
            out = model(torch.tensor([[token]]), past_key_values=out.past_key_values, use_cache=True)
    got = engine.generate(
        [prompt], SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, **penalties)
    )[0]
    assert got.token_ids == expected
    assert got.token_ids != plain, "the penalty was meant to change this output"


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(presence_penalty=2.5),
        dict(frequency_penalty=-3),
        dict(repetition_penalty=0),
        dict(repetition_penalty="1"),
    ],
)
def test_bad_penalties_name_the_field(kwargs):
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        SamplingParams(**kwargs)
