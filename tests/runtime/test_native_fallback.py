"""The native kernels never stop startup: every way it can fail to build or load ends on the PyTorch
path with exactly one warning line. Real processes, a real compiler, a real noexec mount where one can be made."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
import time

import pytest

pytestmark = pytest.mark.slow  # builds the C kernels from scratch or loads the real model

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PROBE = textwrap.dedent("""
    import logging, sys
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    from runtime import native_kernels
    lib = native_kernels.load()
    print("KERNEL", "native" if lib is not None else "pytorch")
    print("TARGET", native_kernels._target())
""")


def probe(env: dict, script: str = PROBE, timeout: float = 120) -> tuple[str, list[str], float]:
    started = time.monotonic()
    out = subprocess.run(
        [sys.executable, "-c", script],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "PRESCIENT_NATIVE": "1", **env},
    )
    assert out.returncode == 0, out.stderr
    kernel = next(line.split()[1] for line in out.stdout.splitlines() if line.startswith("KERNEL"))
    warnings = [line for line in out.stderr.splitlines() if line.startswith("WARNING")]
    assert len(out.stderr.strip().splitlines()) == len(warnings), out.stderr  # nothing but warning lines
    return kernel, warnings, time.monotonic() - started


needs_cc = pytest.mark.skipif(
    shutil.which("cc") is None and shutil.which("gcc") is None, reason="no C compiler on this machine"
)


def test_unwritable_cache_directory(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    kernel, warnings, _ = probe({"PRESCIENT_CACHE": str(blocker / "cache")})
    assert kernel == "pytorch"
    assert len(warnings) == 1 and "not writable" in warnings[0] and "PRESCIENT_CACHE" in warnings[0]


def test_hung_compiler_times_out(tmp_path):
    hung = tmp_path / "hung-cc"
    hung.write_text("#!/bin/sh\nsleep 600\n")
    hung.chmod(0o755)
    kernel, warnings, seconds = probe(
        {"PRESCIENT_CACHE": str(tmp_path / "cache"), "CC": str(hung), "PRESCIENT_NATIVE_BUILD_TIMEOUT": "2"}
    )
    assert kernel == "pytorch"
    assert len(warnings) == 1 and "did not finish in 2 s" in warnings[0]
    assert seconds < 60


def test_failing_compiler_is_one_line(tmp_path):
    broken = tmp_path / "broken-cc"
    broken.write_text("#!/bin/sh\necho 'line one' >&2\necho 'x.c:1: error: nothing works' >&2\nexit 1\n")
    broken.chmod(0o755)
    kernel, warnings, _ = probe({"PRESCIENT_CACHE": str(tmp_path / "cache"), "CC": str(broken)})
    assert kernel == "pytorch"
    assert len(warnings) == 1 and "error: nothing works" in warnings[0]


@pytest.fixture(scope="module")
def built_cache(tmp_path_factory):
    """A cache directory holding a good build of the kernel (built once for the module)."""
    cache = tmp_path_factory.mktemp("built")
    kernel, _, _ = probe({"PRESCIENT_CACHE": str(cache)})
    assert kernel == "native"
    return cache


@needs_cc
def test_corrupt_cached_library_is_rebuilt(tmp_path, built_cache):
    cache = tmp_path / "cache"
    shutil.copytree(built_cache, cache)
    target = next((cache / "kernels").glob("*.so"))
    target.write_bytes(b"\x7fELF but truncated garbage")
    kernel, warnings, _ = probe({"PRESCIENT_CACHE": str(cache)})
    assert kernel == "native" and warnings == []
    assert target.stat().st_size > 1000


@needs_cc
def test_corrupt_library_and_no_compiler_fall_back(tmp_path, built_cache):
    cache = tmp_path / "cache"
    shutil.copytree(built_cache, cache)
    next((cache / "kernels").glob("*.so")).write_bytes(b"garbage")
    kernel, warnings, _ = probe(
        {"PRESCIENT_CACHE": str(cache), "CC": "/nonexistent/cc", "PATH": str(tmp_path)}
    )  # no cc, no gcc on this PATH
    assert kernel == "pytorch" and len(warnings) == 1 and "no C compiler" in warnings[0]


def _noexec_mount(path) -> list[str] | None:
    """A command prefix running under a private mount namespace with a noexec tmpfs at path, if allowed."""
    if shutil.which("unshare") is None:
        return None
    check = subprocess.run(
        ["unshare", "-m", "sh", "-c", f"mount -t tmpfs -o noexec,size=16m tmpfs {path}"], capture_output=True
    )
    return ["unshare", "-m", "sh", "-c"] if check.returncode == 0 else None


@needs_cc
def test_noexec_cache_directory(tmp_path):
    mount_point = tmp_path / "noexec"
    mount_point.mkdir()
    prefix = _noexec_mount(mount_point)
    if prefix is None:
        pytest.skip("cannot mount a noexec tmpfs here (needs a private mount namespace)")
    script = PROBE.replace('"', '\\"')
    command = (
        f"mount -t tmpfs -o noexec,size=16m tmpfs {mount_point} && "
        f'PRESCIENT_CACHE={mount_point} PRESCIENT_NATIVE=1 {sys.executable} -c "{script}"'
    )
    out = subprocess.run(prefix + [command], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "KERNEL pytorch" in out.stdout
    warnings = [line for line in out.stderr.splitlines() if line.startswith("WARNING")]
    assert len(warnings) == 1 and "noexec" in warnings[0], out.stderr


def test_engine_starts_and_generates_with_a_hung_compiler(tmp_path):
    hung = tmp_path / "hung-cc"
    hung.write_text("#!/bin/sh\nsleep 600\n")
    hung.chmod(0o755)
    script = PROBE + textwrap.dedent("""
        from runtime import Engine, SamplingParams
        engine = Engine.from_pretrained(dtype="float32", device="cpu", kv_cache_bytes=16 << 20)
        out = engine.generate("Hello", SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))[0]
        assert len(out.token_ids) == 3
        print("GENERATED", engine.runner.decode_backend)
    """)
    kernel, warnings, _ = probe(
        {"PRESCIENT_CACHE": str(tmp_path / "cache"), "CC": str(hung), "PRESCIENT_NATIVE_BUILD_TIMEOUT": "1"},
        script=script,
        timeout=300,
    )
    assert kernel == "pytorch" and len(warnings) == 1
