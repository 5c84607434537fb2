"""The portable kernels on aarch64: runtime/kernels/csrc cross-compiled with Debian's gcc-aarch64-linux-gnu (NEON,
4-float vectors) and run under qemu-user through a small C driver (kernel_driver.c), against PyTorch's
functions on the same inputs. Speed there is not measured. `make test` installs the packages
(make cross-aarch64)."""

from __future__ import annotations

import os
import shutil
import struct
import subprocess

import pytest
import torch
import torch.nn.functional as F

from runtime.kernels import library as native_kernels
from runtime.model.model import rms_norm

CC, QEMU, SYSROOT = "aarch64-linux-gnu-gcc", "qemu-aarch64", "/usr/aarch64-linux-gnu"
pytestmark = pytest.mark.skipif(
    shutil.which(CC) is None or shutil.which(QEMU) is None,
    reason="no aarch64 cross compiler or qemu-user: `make cross-aarch64` installs them",
)
pytestmark = [pytestmark, pytest.mark.slow]  # cross-compiles and runs under qemu


@pytest.fixture(scope="module")
def driver(tmp_path_factory):
    out = tmp_path_factory.mktemp("aarch64") / "kernel_driver"
    sources = [str(s) for s in native_kernels.SOURCES] + [
        os.path.join(os.path.dirname(__file__), "kernel_driver.c")
    ]
    flags = [f for f in native_kernels.CFLAGS if f != "-fPIC"]
    built = subprocess.run(
        [CC, *flags, f"-I{native_kernels.CSRC}", *sources, "-o", str(out), "-lm"],
        capture_output=True,
        text=True,
    )
    assert built.returncode == 0, built.stderr
    assert "warning" not in built.stderr, built.stderr  # -Wall clean here too
    return out


def run(driver, tmp_path, name: str, args: list) -> None:
    """Calls the kernel under qemu; tensors are its buffers (copied back in place), (tag, value) its scalars."""
    blob = bytearray()
    tensors = []
    for a in args:
        if a is None:
            blob += b"z"
        elif isinstance(a, torch.Tensor):
            data = a.contiguous().view(torch.uint8).numpy().tobytes()
            blob += b"p" + struct.pack("<Q", len(data)) + data
            tensors.append(a)
        else:
            tag, value = a
            blob += tag.encode() + struct.pack({"q": "<q", "i": "<i", "f": "<f"}[tag], value)
    (tmp_path / "args").write_bytes(bytes(blob))
    result = subprocess.run(
        [QEMU, "-L", SYSROOT, str(driver), name, str(tmp_path / "args"), str(tmp_path / "out")],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "2"},
    )
    assert result.returncode == 0, result.stderr
    data, at = (tmp_path / "out").read_bytes(), 0
    for t in tensors:
        (n,) = struct.unpack_from("<Q", data, at)
        t.view(-1).view(torch.uint8)[:] = torch.frombuffer(
            bytearray(data[at + 8 : at + 8 + n]), dtype=torch.uint8
        )
        at += 8 + n


def _bf16(dtype) -> tuple[str, int]:
    return ("i", int(dtype == torch.bfloat16))


def _close(got, expected, dtype):
    diff, size = (got.float() - expected.float()).abs(), expected.float().abs()
    if dtype == torch.float32:
        assert diff.max() <= 1e-5 * size.max()
    else:
        assert (diff <= 2**-7 * size + 1e-6).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_layer_ops_on_aarch64(driver, tmp_path, dtype):
    g = torch.Generator().manual_seed(0)
    rows, d = 5, 576
    h = (torch.randn(rows, d, generator=g) * 4).to(dtype)
    delta = torch.randn(rows, d, generator=g).to(dtype)
    weight = torch.rand(d, generator=g).to(dtype)
    expected_h = h + delta
    out = torch.empty_like(h)
    run(
        driver,
        tmp_path,
        "add_rms_norm",
        [h, delta, weight, out, ("q", rows), ("q", d), ("f", 1e-5), _bf16(dtype), ("i", 2)],
    )
    assert torch.equal(h, expected_h)
    _close(out, rms_norm(expected_h, weight, 1e-5), dtype)

    gate_up = (torch.randn(rows, 2 * 1540, generator=g) * 3).to(dtype)
    gate_up[0, :4] = torch.tensor([-200.0, -90.0, 90.0, 0.0])
    act = torch.empty(rows, 1540, dtype=dtype)
    run(driver, tmp_path, "silu_mul", [gate_up, act, ("q", rows), ("q", 1540), _bf16(dtype), ("i", 2)])
    gate, up = gate_up.chunk(2, dim=-1)
    _close(act, F.silu(gate) * up, dtype)


@pytest.mark.parametrize("heads, kv_heads, d", [(9, 3, 64), (8, 1, 128), (4, 2, 32)])  # fast path; generic
def test_decode_attention_on_aarch64(driver, tmp_path, heads, kv_heads, d):
    g = torch.Generator().manual_seed(1)
    bs, lens = 16, torch.tensor([1, 37, 130], dtype=torch.int64)
    width = int((lens.max() + bs - 1) // bs)
    blocks = len(lens) * width
    k_cache = torch.randn(blocks, bs, kv_heads, d, generator=g).bfloat16()
    v_cache = torch.randn(blocks, bs, kv_heads, d, generator=g).bfloat16()
    tables = torch.randperm(blocks, generator=g).view(len(lens), width)
    q = torch.randn(len(lens), heads, d, generator=g)
    out = torch.empty_like(q)
    args = [q, k_cache, v_cache, tables, lens, out]
    args += [("q", v) for v in (len(lens), heads, kv_heads, d, bs, width)]
    args += [("f", d**-0.5), ("q", 0), ("f", 0.0), ("i", 2)]  # no window, no soft-cap
    run(driver, tmp_path, "paged_decode_attention_bf16", args)
    for b, n in enumerate(lens.tolist()):
        k = k_cache[tables[b]].flatten(0, 1)[:n].float().repeat_interleave(heads // kv_heads, dim=1)
        v = v_cache[tables[b]].flatten(0, 1)[:n].float().repeat_interleave(heads // kv_heads, dim=1)
        scores = torch.einsum("hd,nhd->hn", q[b], k) * d**-0.5
        expected = torch.einsum("hn,nhd->hd", scores.softmax(-1), v)
        torch.testing.assert_close(out[b], expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("heads, kv_heads", [(9, 3), (16, 2)])  # a group within the lanes; over several
def test_prefill_attention_on_aarch64(driver, tmp_path, heads, kv_heads):
    g = torch.Generator().manual_seed(2)
    bs, d, rows, ctx = 16, 64, 21, 40
    width = (ctx + bs - 1) // bs
    k_cache = torch.randn(width + 2, bs, kv_heads, d, generator=g).bfloat16()
    v_cache = torch.randn(width + 2, bs, kv_heads, d, generator=g).bfloat16()
    tables = torch.randperm(width + 2, generator=g)[:width].view(1, width).contiguous()
    q = torch.randn(rows, heads, d, generator=g)
    out = torch.zeros_like(q)
    spans = torch.tensor([[0, rows, ctx]], dtype=torch.int64)
    args = [q, k_cache, v_cache, tables, ("q", width), spans, ("q", 1), out, ("i", 0)]
    args += [("q", v) for v in (heads, kv_heads, d, bs)] + [("f", d**-0.5), ("q", 0), ("f", 0.0), ("i", 2)]
    run(driver, tmp_path, "paged_prefill_attention_bf16", args)
    k = k_cache[tables[0]].flatten(0, 1)[:ctx].float().repeat_interleave(heads // kv_heads, dim=1)
    v = v_cache[tables[0]].flatten(0, 1)[:ctx].float().repeat_interleave(heads // kv_heads, dim=1)
    scores = torch.einsum("nhd,chd->hnc", q, k) * d**-0.5
    hidden = torch.arange(ctx).unsqueeze(0) > torch.arange(ctx - rows, ctx).unsqueeze(1)
    expected = torch.einsum("hnc,chd->nhd", scores.masked_fill(hidden, float("-inf")).softmax(-1), v)
    torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4)


def test_nucleus_sampling_on_aarch64(driver, tmp_path):
    """Draws inside each row's nucleus, and the same tokens as this machine's generic level on the same
    uniforms (the race's hashes are exact; only a near tie may go the other way)."""
    g = torch.Generator().manual_seed(3)
    rows, vocab = 64, 1000
    logits = torch.randn(rows, vocab, generator=g) * 3
    temperature = torch.full((rows,), 0.8)
    top_p = torch.full((rows,), 0.7)
    uniforms = torch.rand(rows, generator=g, dtype=torch.float64)
    out = torch.empty(rows, dtype=torch.int64)
    work = torch.empty(rows * vocab)
    args = [
        logits,
        ("q", rows),
        ("q", vocab),
        ("q", vocab),
        temperature,
        top_p,
        uniforms,
        work,
        out,
        ("i", 2),
    ]
    run(driver, tmp_path, "nucleus_sample", args)
    probs = (logits / 0.8).softmax(-1)
    for r in range(rows):
        above = probs[r][probs[r] > probs[r, out[r]]].sum()
        assert above < 0.7 + 1e-5, r
    lib = native_kernels.load_level("generic")
    here = torch.empty_like(out)
    lib.nucleus_sample(
        logits.data_ptr(),
        rows,
        vocab,
        vocab,
        temperature.data_ptr(),
        top_p.data_ptr(),
        uniforms.data_ptr(),
        work.data_ptr(),
        here.data_ptr(),
        1,
    )
    assert (here == out).float().mean() >= 0.95
