"""The native kernels never stop startup: every way they can fail to build or load ends on the next level down
or the PyTorch path with exactly one warning line, and a hung compiler is killed with all its children. Real
processes, a real compiler (a fake one only where it must hang or fail), a real noexec mount where one can be
made. PRESCIENT_KERNELS_DIR points at an empty directory where a test needs the build at first use. The probes
import the kernels' loader alone (tests/runtime/kernels_only.py); one test starts the engine."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import time

import pytest

from runtime.kernels import library as native_kernels
from tests.processes import alive, wait_gone
from tests.runtime import kernels_only

pytestmark = pytest.mark.slow  # builds the C kernels from scratch or loads the real model

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PROBE = textwrap.dedent("""
    import logging, sys
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    from runtime.kernels import library as native_kernels
    lib = native_kernels.load()
    print("KERNEL", "native" if lib is not None else "pytorch")
    print("LEVEL", native_kernels.chosen_level())
""")


def probe(env: dict, script: str | None = None, timeout: float = 180) -> tuple[str, list[str], float]:
    """Runs PROBE (or `script`, with the whole runtime importable) in a fresh process under env."""
    started = time.monotonic()
    out = subprocess.run(
        kernels_only.command(PROBE) if script is None else [sys.executable, "-c", script],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "PRESCIENT_NATIVE": "1", "PRESCIENT_ISA": "", **env},
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
    kernel, warnings, _ = probe(
        {"PRESCIENT_KERNELS_DIR": str(tmp_path / "no-build"), "PRESCIENT_CACHE": str(blocker / "cache")}
    )
    assert kernel == "pytorch"
    assert len(warnings) == 1 and "not writable" in warnings[0] and "PRESCIENT_CACHE" in warnings[0]


def _hung_compiler(tmp_path) -> tuple[os.PathLike, os.PathLike]:
    """A fake compiler (a hung one cannot be had for real) that starts a child, as cc starts cc1, and sleeps;
    each process of it appends "pid pgid" to a file."""
    pids = tmp_path / "compiler-pids"
    hung = tmp_path / "hung-cc"
    hung.write_text(
        "#!/bin/sh\n"
        f"sh -c 'echo $$ $(ps -o pgid= -p $$) >> {pids}; sleep 600' &\n"
        f"echo $$ $(ps -o pgid= -p $$) >> {pids}\n"
        "sleep 600\n"
    )
    hung.chmod(0o755)
    return hung, pids


def test_hung_compiler_is_killed_with_its_children(tmp_path):
    hung, pids = _hung_compiler(tmp_path)
    kernel, warnings, seconds = probe(
        {
            "PRESCIENT_KERNELS_DIR": str(tmp_path / "no-build"),
            "PRESCIENT_CACHE": str(tmp_path / "cache"),
            "CC": str(hung),
            "PRESCIENT_NATIVE_BUILD_TIMEOUT": "2",
        }
    )
    assert kernel == "pytorch"
    assert len(warnings) == 1 and "did not finish in 2 s" in warnings[0]
    assert seconds < 60
    started = [tuple(map(int, line.split())) for line in pids.read_text().splitlines()]
    groups = {pgid for _, pgid in started}
    assert len(started) >= 2 and all(pid != os.getpid() for pid, _ in started)  # compilers and their children
    assert os.getpgid(0) not in groups  # each compiler led a group of its own
    assert wait_gone([pid for pid, _ in started], 5) == [], "a compiler process outlived the build"
    for pgid in groups:  # and no process at all is left in the compilers' groups
        members = [p for p in os.listdir("/proc") if p.isdigit() and alive(int(p)) and _pgid(int(p)) == pgid]
        assert members == [], f"process group {pgid} still has {members}"


def _pgid(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except OSError:
        return None


def test_failing_compiler_is_one_line(tmp_path):
    broken = tmp_path / "broken-cc"
    broken.write_text("#!/bin/sh\necho 'line one' >&2\necho 'x.c:1: error: nothing works' >&2\nexit 1\n")
    broken.chmod(0o755)
    kernel, warnings, _ = probe(
        {
            "PRESCIENT_KERNELS_DIR": str(tmp_path / "no-build"),
            "PRESCIENT_CACHE": str(tmp_path / "cache"),
            "CC": str(broken),
        }
    )
    assert kernel == "pytorch"
    assert len(warnings) == 1 and "error: nothing works" in warnings[0]


# The first-use tests build the lowest level: the cache, its rebuild and its failures are the same code at
# every level, and the lowest compiles fastest (every level's build is checked with `prebuilt` below).
LOWEST = native_kernels.levels()[0]
GENERIC = {"PRESCIENT_ISA": LOWEST.name}


@pytest.fixture(scope="module")
def built_cache(tmp_path_factory, prebuilt):
    """A cache directory holding a good library of the lowest level where a build at first use puts it: the
    prebuilt one, made by build_level with the same flags (a build at first use is tested by
    test_sources_edited_after_the_build_are_built_again_at_first_use)."""
    cache = tmp_path_factory.mktemp("built")
    target = cache / "kernels" / native_kernels.cache_target(LOWEST).name
    target.parent.mkdir()
    shutil.copyfile(prebuilt / native_kernels.library_name(LOWEST), target)
    kernel, _, _ = probe(
        {"PRESCIENT_KERNELS_DIR": str(cache / "no-build"), "PRESCIENT_CACHE": str(cache), **GENERIC}
    )
    assert kernel == "native" and list((cache / "kernels").iterdir()) == [target]  # loaded, nothing built
    return cache


@pytest.fixture(scope="module")
def built_again(tmp_path_factory, built_cache, prebuilt):
    """One build at first use for two reasons at once: the prebuilt directory's manifest names other sources
    (edited since `make install`), and the cache holds a corrupt library of the level. load() must pass over
    the stale build and replace the corrupt one; (cache, the cached library, the probe's kernel and warnings).
    """
    root = tmp_path_factory.mktemp("built-again")
    stale = root / "build"
    shutil.copytree(prebuilt, stale)
    manifest = json.loads((stale / "manifest.json").read_text())
    (stale / "manifest.json").write_text(json.dumps({**manifest, "sources": "0" * 16}))
    cache = root / "cache"
    shutil.copytree(built_cache, cache)
    target = next((cache / "kernels").glob("*.so"))
    target.write_bytes(b"\x7fELF but truncated garbage")
    kernel, warnings, _ = probe(
        {"PRESCIENT_KERNELS_DIR": str(stale), "PRESCIENT_CACHE": str(cache), **GENERIC}
    )
    return cache, target, kernel, warnings


@needs_cc
def test_corrupt_cached_library_is_rebuilt(built_again):
    _, target, kernel, warnings = built_again
    assert kernel == "native" and warnings == []
    assert target.stat().st_size > 1000
    native_kernels._open(target)  # a whole library with every kernel


@needs_cc
def test_corrupt_library_and_no_compiler_fall_back(tmp_path, built_cache):
    cache = tmp_path / "cache"
    shutil.copytree(built_cache, cache)
    next((cache / "kernels").glob("*.so")).write_bytes(b"garbage")
    kernel, warnings, _ = probe(
        {
            "PRESCIENT_KERNELS_DIR": str(tmp_path / "no-build"),
            "PRESCIENT_CACHE": str(cache),
            "CC": "/nonexistent/cc",
            "PATH": str(tmp_path),
            **GENERIC,
        }
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
    script = (kernels_only.PRELUDE + PROBE).replace('"', '\\"')
    command = (
        f"mount -t tmpfs -o noexec,size=16m tmpfs {mount_point} && "
        f"PRESCIENT_KERNELS_DIR={mount_point} PRESCIENT_CACHE={mount_point} PRESCIENT_NATIVE=1 "
        f"PRESCIENT_ISA={LOWEST.name} "
        "PRESCIENT_NATIVE_BUILD_TIMEOUT=600 "
        f'{sys.executable} -c "{script}"'
    )
    out = subprocess.run(prefix + [command], cwd=ROOT, capture_output=True, text=True, timeout=700)
    assert out.returncode == 0, out.stderr
    assert "KERNEL pytorch" in out.stdout
    warnings = [line for line in out.stderr.splitlines() if line.startswith("WARNING")]
    assert len(warnings) == 1 and "noexec" in warnings[0], out.stderr


def test_engine_starts_and_generates_with_a_hung_compiler(tmp_path):
    hung, _ = _hung_compiler(tmp_path)
    script = PROBE + textwrap.dedent("""
        from runtime import Engine, SamplingParams
        engine = Engine.from_pretrained(dtype="float32", device="cpu", kv_cache_bytes=16 << 20)
        out = engine.generate("Hello", SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))[0]
        assert len(out.token_ids) == 3
        print("GENERATED", engine.runner.attention.name)
    """)
    kernel, warnings, _ = probe(
        {
            "PRESCIENT_KERNELS_DIR": str(tmp_path / "no-build"),
            "PRESCIENT_CACHE": str(tmp_path / "cache"),
            "CC": str(hung),
            "PRESCIENT_NATIVE_BUILD_TIMEOUT": "1",
        },
        script=script,
        timeout=300,
    )
    assert kernel == "pytorch" and len(warnings) == 1


@pytest.fixture(scope="module")
def prebuilt(tmp_path_factory):
    """A directory with every level built as `make install` builds it: the package's own when it is current."""
    manifest = native_kernels.build_dir() / "manifest.json"
    if (
        manifest.exists()
        and "warnings" in json.loads(manifest.read_text())
        and all(native_kernels._prebuilt(level) is not None for level in native_kernels.levels())
    ):
        return native_kernels.build_dir()
    out = tmp_path_factory.mktemp("prebuilt")
    native_kernels.build(out, echo=lambda line: None)
    return out


RUNNABLE = [level.name for level in native_kernels.cpu_levels()]


@pytest.mark.parametrize("cap", RUNNABLE)
def test_the_best_prebuilt_level_is_chosen_and_prescient_isa_caps_it(prebuilt, cap, tmp_path):
    kernel, warnings, _ = probe({"PRESCIENT_KERNELS_DIR": str(prebuilt), "PRESCIENT_CACHE": str(tmp_path)})
    assert kernel == "native" and warnings == []
    assert _level(prebuilt, {}) == RUNNABLE[-1]  # the best this CPU runs
    assert _level(prebuilt, {"PRESCIENT_ISA": cap}) == cap
    assert not (tmp_path / "kernels").exists()  # nothing compiled


def _level(prebuilt, env: dict) -> str:
    out = subprocess.run(
        kernels_only.module_command("runtime.kernels.build", "--which"),
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={
            **os.environ,
            "PRESCIENT_NATIVE": "1",
            "PRESCIENT_ISA": "",
            "PRESCIENT_KERNELS_DIR": str(prebuilt),
            **env,
        },
    )
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_a_damaged_level_falls_to_the_next_level_down_with_one_warning(prebuilt, tmp_path):
    damaged = tmp_path / "build"
    shutil.copytree(prebuilt, damaged)
    best = native_kernels.cpu_levels()[-1]
    (damaged / native_kernels.library_name(best)).write_bytes(b"\x7fELF but truncated garbage")
    kernel, warnings, _ = probe(
        {"PRESCIENT_KERNELS_DIR": str(damaged), "PRESCIENT_CACHE": str(tmp_path / "c")}
    )
    assert kernel == "native" and len(warnings) == 1 and native_kernels.library_name(best) in warnings[0]
    below = RUNNABLE[-2] if len(RUNNABLE) > 1 else best.name  # one level only: built here instead
    assert _level(damaged, {"PRESCIENT_CACHE": str(tmp_path / "c")}) == below


@needs_cc
def test_sources_edited_after_the_build_are_built_again_at_first_use(built_again):
    cache, target, kernel, warnings = built_again
    assert kernel == "native" and warnings == []
    # the stale prebuilt library was not loaded: the cache's one was built (it held garbage before)
    assert list((cache / "kernels").glob("*-generic.so")) == [target]
    assert target.read_bytes()[:4] == b"\x7fELF" and target.stat().st_size > 1000


def test_prescient_native_0_and_an_unknown_isa(prebuilt):
    kernel, warnings, _ = probe({"PRESCIENT_KERNELS_DIR": str(prebuilt), "PRESCIENT_NATIVE": "0"})
    assert kernel == "pytorch" and warnings == []
    kernel, warnings, _ = probe({"PRESCIENT_KERNELS_DIR": str(prebuilt), "PRESCIENT_ISA": "sse9"})
    assert kernel == "pytorch" and len(warnings) == 1 and "PRESCIENT_ISA" in warnings[0]


# The build command itself (its line per level with the build time, the level this CPU gets, its manifest)
# runs once, as the Docker image's build stage runs it: tests/deploy/test_dockerfile.py::
# test_the_kernel_build_step_works (compiling a level costs ~20 CPU-s).


def test_every_level_compiles_without_warnings(prebuilt):
    """Each level's build at -Wall (CFLAGS) gave no warning: vector types of the level's own width raise no
    -Wpsabi, and no code is left unused by a level's #if paths."""
    manifest = json.loads((prebuilt / "manifest.json").read_text())
    assert set(manifest["warnings"]) == {level.name for level in native_kernels.levels()}
    assert {level: text for level, text in manifest["warnings"].items() if text} == {}
