"""The CUDA path: the Triton attention kernel (sliding windows and soft-caps too), decode steps replayed from
CUDA graphs, and the engine on a GPU against transformers on the same GPU and weights, every model family.

CI has no GPU: there the kernels run under Triton's interpreter on CPU tensors (float32; the interpreter
mishandles bfloat16), test_triton_compile.py compiles every launch for a GPU, and the tests that need one are
skipped (they ran on a lent H100 and, with the family and window tests, on an H200; tests/bench/RESULTS.md).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F

from runtime import SamplingParams
from runtime.runner.cuda_graphs import capture_sizes
from tests.random_families import FAMILIES
from tests.random_llama import TINY, engine_for, hf_llama

try:
    import triton

    HAVE_TRITON = True
    OLD_INTERPRETER = tuple(int(p) for p in triton.__version__.split(".")[:2]) < (3, 9)
except ImportError:
    HAVE_TRITON, OLD_INTERPRETER = False, False

cuda = pytest.mark.skipif(
    not (torch.cuda.is_available() and HAVE_TRITON), reason="needs a CUDA GPU and Triton"
)


def reference_decode(q, k_cache, v_cache, tables, lens, scale):
    """Each sequence's positions gathered slot by slot, then scaled_dot_product_attention (float64)."""
    b, heads, d = q.shape
    bs, kv_heads = k_cache.shape[1], k_cache.shape[2]
    out = torch.empty(b, heads, d, dtype=torch.float64)
    for i in range(b):
        pos = torch.arange(int(lens[i]))
        slots = tables[i].cpu()[pos // bs] * bs + pos % bs
        k = k_cache.reshape(-1, kv_heads, d)[slots.to(k_cache.device)].double().cpu().transpose(0, 1)
        v = v_cache.reshape(-1, kv_heads, d)[slots.to(v_cache.device)].double().cpu().transpose(0, 1)
        qi = q[i].double().cpu().unsqueeze(1)  # [heads, 1, d]
        o = F.scaled_dot_product_attention(qi, k, v, scale=scale, enable_gqa=heads != kv_heads)
        out[i] = o[:, 0]
    return out


def random_decode_case(gen, heads, kv_heads, d, block_size, lens, dtype, device):
    """Queries, a pool of blocks in random order, and block tables padded with random (unread) ids."""
    num_blocks = sum(-(-n // block_size) for n in lens) + 3
    k_cache = torch.randn(num_blocks, block_size, kv_heads, d, generator=gen).to(device, dtype)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, d, generator=gen).to(device, dtype)
    order = torch.randperm(num_blocks, generator=gen)
    width = max(-(-n // block_size) for n in lens) + 2
    tables, used = [], 0
    for n in lens:
        need = -(-n // block_size)
        row = order[used : used + need].tolist()
        used += need
        row += torch.randint(0, num_blocks, (width - need,), generator=gen).tolist()
        tables.append(row)
    tables = torch.tensor(tables, dtype=torch.int64, device=device)
    q = torch.randn(len(lens), heads, d, generator=gen).to(device, dtype)
    return q, k_cache, v_cache, tables, torch.tensor(lens, device=device)


def test_capture_sizes_cover_every_step_up_to_the_largest():
    for largest in (1, 3, 8, 13, 64, 100, 512, 2048):
        sizes = capture_sizes(largest)
        assert sizes == sorted(set(sizes)) and sizes[-1] == largest
        for t in range(1, largest + 1):  # every step has a size: a decode batch within 8, a prefill within 64
            fit = min(s for s in sizes if s >= t)
            assert fit - t < (8 if t <= 64 else 64) and fit <= 2 * t
    assert capture_sizes(512) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64, 128, 192, 256, 320, 384, 448, 512]


@pytest.mark.slow  # Triton's interpreter in a process of its own
@pytest.mark.skipif(not HAVE_TRITON, reason="needs Triton (the test extra installs it)")
@pytest.mark.skipif(
    OLD_INTERPRETER, reason="Triton's interpreter before 3.9 cannot loop to a bound read from memory"
)
def test_triton_decode_kernel_matches_sdpa_in_the_interpreter():
    """The kernel's indexing and online softmax on CPU under TRITON_INTERPRET=1 (set before Triton is
    imported, hence the subprocess): GQA groups that are and are not powers of two, one KV head, lengths
    from 1 to past several tiles, shuffled blocks."""
    script = textwrap.dedent("""
        import torch
        from runtime.kernels import triton_attention
        from tests.runtime.test_cuda import random_decode_case, reference_decode
        gen = torch.Generator().manual_seed(7)
        for heads, kv_heads, d, bs, lens in [
            (9, 3, 64, 8, [1, 7, 64, 65, 200, 600]),
            (8, 8, 32, 16, [3, 129]),
            (8, 2, 128, 8, [33, 1]),
            (6, 1, 16, 4, [100, 2, 9]),
        ]:
            q, k, v, tables, lengths = random_decode_case(gen, heads, kv_heads, d, bs, lens, torch.float32, "cpu")
            out = triton_attention.decode_attention(q, k, v, tables, lengths, d**-0.5)
            ref = reference_decode(q, k, v, tables, lengths, d**-0.5)
            err = (out.double() - ref).norm() / ref.norm()
            assert err < 1e-5, (heads, kv_heads, d, bs, lens, err.item())
        print("OK")
    """)
    env = dict(os.environ, TRITON_INTERPRET="1")
    done = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0 and done.stdout.strip().endswith("OK"), done.stderr[-3000:]


@pytest.mark.slow  # Triton's interpreter in a process of its own
@pytest.mark.skipif(not HAVE_TRITON, reason="needs Triton (the test extra installs it)")
def test_triton_layer_ops_and_attention_run_the_model_in_the_interpreter():
    """The CUDA configuration on CPU, under the interpreter: a model whose element-wise layer work runs in the
    Triton kernels scores a prompt as the PyTorch ops do, and as transformers does; with the Triton attention
    too, sequences generated together (steps mixing decodes and prefill chunks in one launch) pick tokens
    transformers' logits agree with."""
    script = textwrap.dedent("""
        import tempfile, pathlib
        import torch
        from runtime import SamplingParams
        from runtime.attention.triton_backend import TritonBackend
        from runtime.kernels import triton_layer_ops
        from tests.random_llama import TINY, engine_for, hf_llama
        from tests.runtime.test_cuda import teacher_forced_check
        # two layers (the interpreter runs each kernel's programs one by one in Python): the second reads the
        # first's output and its own KV cache layer
        hf = hf_llama(dict(TINY, num_hidden_layers=2), "cpu", torch.float32, seed=5)
        # 16 tokens a step: prompts prefill in chunks while the shorter ones already decode
        tmp = pathlib.Path(tempfile.mkdtemp())
        engine = engine_for(hf, tmp, torch.float32, "cpu", max_num_batched_tokens=16)
        prompt = [3 + (11 * j) % 500 for j in range(37)]
        engine.model.layer_ops = triton_layer_ops
        fused = engine.prompt_logits(prompt)
        engine.model.native_decode = False
        plain = engine.prompt_logits(prompt)
        with torch.no_grad():
            theirs = hf(torch.tensor([prompt])).logits[0]
        assert (fused - plain).abs().max().item() < 1e-4, (fused - plain).abs().max().item()
        assert (fused - theirs).abs().max().item() < 1e-4
        engine.model.native_decode = True
        engine.runner.attention = TritonBackend()
        prompts = [[3 + (5 * i + 3 * j) % 500 for j in range(2 + 5 * i)] for i in range(3)]
        outs = engine.generate(prompts, SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
        for prompt, out in zip(prompts, outs):
            teacher_forced_check(hf, prompt, out.token_ids, 1e-3)
        print("OK")
    """)
    env = dict(os.environ, TRITON_INTERPRET="1")
    done = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0 and done.stdout.strip().endswith("OK"), done.stderr[-3000:]


@cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_decode_kernel_matches_sdpa_on_cuda(dtype):
    from runtime.kernels import triton_attention

    gen = torch.Generator().manual_seed(11)
    for heads, kv_heads, d, bs, lens in [
        (9, 3, 64, 8, [1, 5, 64, 300, 1000, 2, 4096]),
        (32, 8, 64, 16, [17, 513]),
        (8, 8, 128, 8, [1, 250]),
    ]:
        q, k, v, tables, lengths = random_decode_case(gen, heads, kv_heads, d, bs, lens, dtype, "cuda")
        assert triton_attention.usable(q, k)
        out = torch.full_like(q, float("nan"))
        triton_attention.decode_attention(q, k, v, tables, lengths, d**-0.5, out)
        ref = reference_decode(q, k, v, tables, lengths, d**-0.5)
        err = (out.double().cpu() - ref).norm() / ref.norm()
        assert err < (1e-5 if dtype == torch.float32 else 1e-2), (heads, kv_heads, d, lens, err.item())


def teacher_forced_check(hf_model, prompt, tokens, tol):
    """Each token the engine chose is, by transformers' logits over the same sequence, within tol of the
    most likely one (an exact argmax match would fail on near ties, which rounding order decides)."""
    ids = torch.tensor([prompt + tokens], device=hf_model.device)
    with torch.no_grad():
        logits = hf_model(ids).logits[0, len(prompt) - 1 : -1].float()
    chosen = logits.gather(1, torch.tensor(tokens, device=logits.device)[:, None])[:, 0]
    gap = logits.max(dim=1).values - chosen
    assert (gap <= tol).all(), gap.tolist()


@pytest.fixture(scope="module")
def tiny_cuda():
    if not (torch.cuda.is_available() and HAVE_TRITON):
        pytest.skip("needs a CUDA GPU and Triton")
    return hf_llama(TINY, "cuda", torch.float32, seed=3)


@cuda
def test_engine_on_cuda_matches_transformers_with_graphs_and_eager(tiny_cuda, tmp_path):
    """Float32 on the GPU: prompt logits against transformers' on the same GPU, and greedy generations of
    sequences of different lengths running together (steps of 5 decodes replay the graph of 8; steps with
    prefill chunks replay graphs too, their rows and the decodes in one attention launch; with enforce_eager
    all of it op by op), each token checked against transformers' logits."""
    prompts = [[3 + (7 * i + j) % 500 for j in range(5 + 23 * i)] for i in range(5)]
    for eager in (False, True):
        engine = engine_for(
            tiny_cuda,
            tmp_path,
            torch.float32,
            "cuda",
            enforce_eager=eager,
            max_num_seqs=16,
            max_num_batched_tokens=32,  # long prompts prefill in chunks beside decodes
        )
        assert engine.runner.attention.name == "triton"
        assert (engine.runner.graphs is None) == eager
        with torch.no_grad():
            theirs = tiny_cuda(torch.tensor([prompts[4]], device="cuda")).logits[0].float()
        assert (engine.prompt_logits(prompts[4]) - theirs).abs().max().item() < 1e-3
        outs = engine.generate(prompts, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))
        for prompt, out in zip(prompts, outs):
            assert len(out.token_ids) == 40
            teacher_forced_check(tiny_cuda, prompt, out.token_ids, 1e-3)


@cuda
def test_graph_replay_computes_the_eager_step_and_writes_only_its_slots(tiny_cuda, tmp_path):
    """One step of 3 decodes and a 4-token prefill chunk through the graph of 8 tokens (bfloat16): the same
    hidden states as the eager forward, and the pool changes only at the 7 new tokens' slots and the scratch
    block."""
    from runtime.attention.triton_backend import TritonBackend

    engine = engine_for(tiny_cuda, tmp_path, torch.bfloat16, "cuda", max_num_seqs=8)
    runner, kv = engine.runner, engine.kv
    assert runner.graphs.size_for(7) == 8
    bs = kv.block_size
    kv.pool.normal_()
    tables = [[0, 1], [3, 4, 5, 6], [7, 8, 9], [10, 11, 12]]
    ends = [9, 30, 17, 20]  # the chunk computes positions 16..19 of the fourth sequence
    lens = [9, 30, 17, 17, 18, 19, 20]
    index = [0, 1, 2, 3, 3, 3, 3]
    positions = [n - 1 for n in lens]
    slots = [tables[k][p // bs] * bs + p % bs for k, p in zip(index, positions)]
    ids = [5, 77, 300, 8, 9, 10, 11]
    assert all(len(t) * bs >= e for t, e in zip(tables, ends))
    before = kv.pool.clone()
    graphed = runner.graphs.run(ids, positions, slots, tables, lens, index).clone()
    after_graph = kv.pool.clone()
    kv.pool.copy_(before)
    dev = "cuda"
    width = max(map(len, tables))
    meta = TritonBackend().metadata(
        slot_mapping=torch.tensor(slots, device=dev),
        row_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], device=dev),
        row_lens=torch.tensor(lens, device=dev),
        row_table_index=torch.tensor(index, device=dev),
    )
    eager = engine.model.forward(torch.tensor(ids, device=dev), torch.tensor(positions, device=dev), meta, kv)
    assert (graphed.float() - eager.float()).abs().max().item() < 2e-2 * eager.float().abs().max().item()
    assert after_graph.isfinite().all()
    flat = lambda pool: pool.view(pool.shape[0], 2, -1, pool.shape[-2], pool.shape[-1])  # noqa: E731
    changed = (flat(after_graph) != flat(before)).flatten(3).any(-1).any(1).any(0).nonzero()[:, 0].tolist()
    scratch = range(kv.scratch_slot, kv.scratch_slot + bs)
    assert set(slots) <= set(changed) and set(changed) <= set(slots) | set(scratch)


@cuda
def test_fused_layer_ops_compute_the_pytorch_layer_on_cuda_in_bfloat16(tiny_cuda, tmp_path):
    """bfloat16 on the GPU: the Triton layer ops round where the PyTorch ops do, so the two paths' logits
    agree to bfloat16 precision, and both stay near transformers' float32 logits."""
    engine = engine_for(tiny_cuda, tmp_path, torch.bfloat16, "cuda", enforce_eager=True)
    assert engine.model.layer_ops.__name__ == "runtime.kernels.triton_layer_ops"
    prompt = [3 + (13 * j) % 500 for j in range(70)]
    fused = engine.prompt_logits(prompt)
    engine.model.native_decode = False
    plain = engine.prompt_logits(prompt)
    with torch.no_grad():
        theirs = tiny_cuda(torch.tensor([prompt], device="cuda")).logits[0].float()
    scale = theirs.abs().max().item()
    assert (fused - plain).abs().max().item() < 0.02 * scale
    assert (fused - theirs).norm() / theirs.norm() < 0.02


@cuda
def test_speculative_verification_replays_graphs_and_emits_greedy_tokens(tiny_cuda, tmp_path):
    """Proposals verified on the GPU (the greedy continuation with every third token wrong): steps that
    carry several rows per sequence replay the captured graphs (float32), proposals are accepted, and every
    emitted token is transformers' greedy choice over the same sequence (teacher-forced, as above)."""
    engine = engine_for(
        tiny_cuda,
        tmp_path,
        torch.float32,
        "cuda",
        max_num_seqs=8,
        speculative_config={
            "method": "ngram",
            "num_speculative_tokens": 4,
            "prompt_lookup_min": 1,
            "prompt_lookup_max": 3,
            "disable_by_batch_size": 1000,
        },
    )
    engine.speculator.row_cost = 0.0  # proposals at every rate: the test checks verification
    graphs, observe = engine.runner.graphs, engine.speculator.observe
    replayed, judged = [], []

    def run(ids, positions, slots, tables, lens, index):
        replayed.append(len(ids) - len(tables))  # rows beyond one a sequence: proposals verified
        return type(graphs).run(graphs, ids, positions, slots, tables, lens, index)

    def counted(request_id, num_drafts, num_accepted):
        judged.append((num_drafts, num_accepted))
        observe(request_id, num_drafts, num_accepted)

    graphs.run, engine.speculator.observe = run, counted
    rng = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 400, (n,), generator=rng).tolist() for n in (5, 9, 14, 20)]
    params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    engine.speculator._propose = lambda request, state: []
    truth = {tuple(p): out.token_ids for p, out in zip(prompts, engine.generate(prompts, params))}

    def propose(request, state):  # the greedy continuation, every third token wrong
        at = request.num_output_tokens
        drafts = list(truth[tuple(request.prompt_token_ids)][at : at + 4])
        return [(t + 1) % 500 if (at + i) % 3 == 2 else t for i, t in enumerate(drafts)]

    engine.speculator._propose = propose
    replayed.clear()
    outs = engine.generate(prompts, params)
    assert max(replayed) > 0, "no step verified proposals through a graph"
    assert sum(a for _, a in judged) > 0, judged
    for prompt, out in zip(prompts, outs):
        assert len(out.token_ids) == 32
        teacher_forced_check(tiny_cuda, prompt, out.token_ids, 1e-3)


def incremental_check(hf_model, prompt, tokens, tol):
    """teacher_forced_check through transformers' own KV cache, one token a forward (as reference_greedy
    runs it): the semantics the CPU family tests hold the engine to where a model's RoPE depends on the
    length of the forward (phi3's LongRoPE)."""
    dev = hf_model.device
    with torch.no_grad():
        out = hf_model(torch.tensor([prompt], device=dev), use_cache=True)
        for step, token in enumerate(tokens):
            logits = out.logits[0, -1].float()
            gap = (logits.max() - logits[token]).item()
            assert gap <= tol, (step, gap)
            out = hf_model(
                torch.tensor([[token]], device=dev), past_key_values=out.past_key_values, use_cache=True
            )


@cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window, softcap", [(13, None), (None, 5.0), (40, 5.0)])
def test_triton_backend_applies_window_and_softcap_on_cuda(dtype, window, softcap):
    """test_triton_window.py's check on the GPU, both dtypes: head_dim 64 / 128 / 256 with GQA under each
    window and soft-cap, and the 700-position sequence whose window skips two whole splits."""
    from tests.runtime.test_triton_window import SHAPES, check_triton_backend

    cases = [(shape, (window, softcap)) for shape in SHAPES]
    check_triton_backend("cuda", dtype, cases, long_softcap=softcap, relative=True)


@cuda
@pytest.mark.parametrize("name", list(FAMILIES))
def test_every_family_runs_on_cuda_as_transformers_does(name, tmp_path):
    """Each family of tests/random_families.py (windows shorter than the prompt, soft-caps that bite, QKV
    bias, q/k norms, sandwich norms, two RoPE bases, LongRoPE) in float32 on the GPU with CUDA graphs, the
    Triton attention and layer ops: prompt logits within 1e-3 of transformers' on the same GPU, and greedy
    generations of four prompts prefilled in 32-token chunks beside each other's decodes, every token
    transformers' choice through its own cache (within 1e-3 of its best logit)."""
    from runtime import Engine
    from tests.random_families import PROMPT_LEN, VOCAB, hf_model, packable, save_hf_dir

    model = hf_model(name, **packable(name))
    path = save_hf_dir(model, tmp_path / name)
    model = model.to("cuda")
    engine = Engine.from_pretrained(
        str(path),
        dtype="float32",
        device="cuda",
        kv_cache_bytes=64 << 20,
        max_num_seqs=8,
        max_num_batched_tokens=32,
    )
    assert engine.runner.attention.name == "triton" and engine.runner.graphs is not None
    assert engine.model.layer_ops.__name__ == "runtime.kernels.triton_layer_ops"
    gen = torch.Generator().manual_seed(9)
    # every prompt past phi3's 32-token original context (its long factors from the first token)
    prompts = [torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in (PROMPT_LEN, 33, 47, 61)]
    with torch.no_grad():
        theirs = model(torch.tensor([prompts[0]], device="cuda")).logits[0].float()
    diff = (engine.prompt_logits(prompts[0]) - theirs).abs().max().item()
    assert diff < 1e-3, diff
    outs = engine.generate(prompts, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        assert len(out.token_ids) == 24
        incremental_check(model, prompt, out.token_ids, 1e-3)
