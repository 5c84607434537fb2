"""Every Triton kernel compiles for a GPU, here without one: the launches a model's forward makes on the
CUDA path (Triton layer ops and attention) are recorded instead of run, each family in float32 and bfloat16,
and each distinct one (its argument types and constants) is compiled by Triton down to machine code for an
H100 / H200 (sm_90) and an A100 (sm_80), with the ptxas that Triton's wheel brings.

Triton's interpreter, which runs the kernels' arithmetic on CPU in the other tests, does not type-check a
kernel as its compiler does: a kernel it ran correctly failed to compile on a GPU (a Python conditional on
a value loaded from memory). Each kernel is compiled once per distinct launch, in a process of its own
(the modules define their kernels only where CUDA is, so the subprocess says it is there; nothing is launched)."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("triton", reason="needs Triton (the test extra installs it)")

SCRIPT = textwrap.dedent("""
    import pathlib, tempfile
    import torch
    torch.cuda.is_available = lambda: True  # the kernel modules define their kernels only where CUDA is
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.jit import JITFunction

    launches = []

    class Record:
        def __init__(self, fn):
            self.fn = fn

        def __call__(self, *args, **kwargs):
            launches.append((self.fn, args, kwargs))

    JITFunction.__getitem__ = lambda self, grid: Record(self)  # a launch is recorded, not run

    from runtime import Engine
    from runtime.attention.triton_backend import TritonBackend
    from runtime.kernels import triton_layer_ops
    from tests.random_families import FAMILIES, PROMPT_LEN, VOCAB, hf_model, packable, save_hf_dir

    tmp = pathlib.Path(tempfile.mkdtemp())
    prompt = torch.randint(3, VOCAB, (PROMPT_LEN,), generator=torch.Generator().manual_seed(5)).tolist()
    for name in FAMILIES:
        layers = dict(num_hidden_layers=2)
        if name == "gemma3":
            layers["layer_types"] = ["sliding_attention", "full_attention"]
        path = save_hf_dir(hf_model(name, **packable(name), **layers), tmp / name)
        for dtype in ("float32", "bfloat16"):
            engine = Engine.from_pretrained(str(path), dtype=dtype, device="cpu", kv_cache_bytes=4 << 20)
            engine.model.layer_ops = triton_layer_ops
            engine.runner.attention = TritonBackend()
            before = len(launches)
            engine.prompt_logits(prompt)  # its outputs are never written: only the launches count
            assert len(launches) > before, name

    TYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.int64: "i64",
             torch.int32: "i32", torch.bool: "i1"}

    def type_of(value):
        if isinstance(value, torch.Tensor):
            return "*" + TYPES[value.dtype]
        if isinstance(value, bool):
            return "i1"
        if isinstance(value, int):
            return "i32" if -2**31 <= value < 2**31 else "i64"
        if isinstance(value, float):
            return "fp32"
        raise TypeError(f"argument of type {type(value).__name__}")

    distinct = {}
    for fn, args, kwargs in launches:
        params = fn.arg_names
        constants = {k: v for k, v in kwargs.items() if k in params}
        options = {k: v for k, v in kwargs.items() if k not in params}
        assert len(args) + len(constants) == len(params), (fn.__name__, len(args), len(params))
        signature = {p: type_of(a) for p, a in zip(params, args)} | {k: "constexpr" for k in constants}
        key = (fn.__name__, tuple(signature.items()), tuple(sorted(constants.items())), tuple(sorted(options.items())))
        distinct[key] = (fn, signature, constants, options)
    names = set()
    for arch in (90, 80):
        for fn, signature, constants, options in distinct.values():
            source = ASTSource(fn, signature, {(fn.arg_names.index(k),): v for k, v in constants.items()})
            kernel = triton.compile(source, target=GPUTarget("cuda", arch, 32), options=options)
            assert kernel.asm["cubin"], (fn.__name__, arch)
            names.add(fn.__name__)
    print("OK", len(distinct), sorted(names))
""")


@pytest.mark.slow  # a process of its own that compiles each kernel for two GPUs
def test_every_triton_launch_compiles_for_sm90_and_sm80(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)  # compiled here, not found in an earlier run's cache
    env["TRITON_DEFAULT_FP_FUSION"] = "1"  # Triton's default today, said aloud (it warns otherwise)
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    kernels = {"_decode_split", "_merge_splits", "_add_rms_norm", "_silu_mul", "_gelu_mul", "_rope_write_kv"}
    assert done.stdout.strip().startswith("OK") and kernels <= set(
        ast.literal_eval(done.stdout.split(" ", 2)[2])
    ), done.stdout[-2000:]
