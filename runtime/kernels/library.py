"""The project's C kernels (csrc/*.c): built ahead once per instruction-set level, one chosen at run time.

A level is one build of the whole kernel set for a class of CPU (LEVELS, lowest first): on x86-64 `generic`
(-march=x86-64: SSE2), `avx2` (x86-64-v3: AVX2, FMA, F16C) and `avx512` (x86-64-v4 with VNNI); on any other
machine (aarch64: NEON) one `generic` build for the compiler's default target. Each kernel writes its vectors
in the level's own register width (csrc/vector_exp.h), so every level compiles in seconds.

`python -m runtime.kernels.build` (run by `make install` and the Docker image's build stage) compiles
every level into BUILD_DIR inside the package, with the sources' hash in its manifest, and says how long each
level took and which one this CPU gets. load() opens the best prebuilt level whose library says this CPU runs
it (each library exports prescient_cpu_supports(), compiled for the baseline, as ggml-cpu scores its backends);
PRESCIENT_ISA=generic|avx2|avx512 caps the level (tests and benchmarks), PRESCIENT_NATIVE=0 turns the kernels
off. Nothing is compiled on the serving path where the build is there. Where it is not (a fresh editable tree
before `make install`, or sources edited since), the best level is built once into the per-user cache
(PRESCIENT_CACHE), each compiler in its own process group, every group killed at the timeout, so no compiler
outlives the build. Whenever no library can be had, the engine keeps the PyTorch paths with one warning line.
Each kernel's wrapper (native_attention, native_matmul, native_layer_ops, native_sampling, native_decode) says
what it does.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import json
import logging
import os
import platform
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache, lru_cache
from pathlib import Path

log = logging.getLogger("prescient.runtime")
CSRC = Path(__file__).parent / "csrc"
SOURCES = [
    CSRC / name
    for name in (
        "paged_attention.c",
        "quantized_matmul.c",
        "layer_ops.c",
        "nucleus_sampling.c",
        "decode_layers.c",
        "compute_threads.c",
        "compute_peak.c",
        "isa_level.c",
        "gguf_relayout.c",
        "gguf_dequantize.c",
    )
]
HEADERS = [
    CSRC / name for name in ("vector_exp.h", "kernels.h", "bf16.h", "f16.h", "gguf_block.h", "check.h")
]
BUILD_DIR = Path(__file__).parent / "native_build"
"""Where the build puts each level's library and manifest.json (git-ignored; PRESCIENT_KERNELS_DIR overrides)."""

BUILD_TIMEOUT_SECONDS = 60.0
"""How long a build at first use may run (PRESCIENT_NATIVE_BUILD_TIMEOUT overrides): a hung compiler must not
hang the server's start."""

CFLAGS = ("-O3", "-fopenmp", "-fPIC", "-Wall")
DEBUG_CFLAGS = ("-DPRESCIENT_KERNEL_DEBUG", "-Og", "-g")
"""The debug build: every exported kernel checks its shape and pointer arguments and aborts naming the bad one
(csrc/check.h); optimized for debugging (-Og, with symbols), it compiles in a third of the release build's time
and gives its results (bit for bit at the generic level; elsewhere within the rounding of the multiply-adds that
-O3 fuses). Never prebuilt nor the default: PRESCIENT_KERNEL_DEBUG=1 makes load() use it, built once into
the cache (`python -m runtime.kernels.build --debug` builds it ahead)."""


def debug_requested() -> bool:
    return os.environ.get("PRESCIENT_KERNEL_DEBUG", "0").strip() not in ("", "0")


@dataclass(frozen=True)
class Level:
    """One build of the kernels: its compiler flags and the /proc/cpuinfo flags a CPU needs to run it."""

    name: str
    cflags: tuple[str, ...]
    cpu_flags: frozenset[str]


_V3 = frozenset({"avx", "avx2", "fma", "f16c", "bmi1", "bmi2", "movbe", "abm"})
X86_LEVELS = (
    Level("generic", ("-march=x86-64", "-mtune=generic"), frozenset()),
    Level("avx2", ("-march=x86-64-v3", "-mtune=generic"), _V3),
    # BF16 is not targeted: no kernel uses its instructions, and an AVX-512 Xeon without it (Cascade Lake,
    # Ice Lake) then still runs this level.
    Level(
        "avx512",
        ("-march=x86-64-v4", "-mavx512vnni", "-mtune=generic"),
        _V3 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl", "avx512_vnni"},
    ),
)
PORTABLE_LEVELS = (Level("generic", (), frozenset()),)
LEVEL_NAMES = tuple(level.name for level in X86_LEVELS)


def levels() -> tuple[Level, ...]:
    """This machine's architecture's levels, lowest first."""
    return X86_LEVELS if platform.machine().lower() in ("x86_64", "amd64") else PORTABLE_LEVELS


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            line = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return set()
    return set(line.partition(":")[2].split())


def cpu_levels() -> list[Level]:
    """The levels this CPU runs, lowest first, by its /proc/cpuinfo flags (each library checks again)."""
    flags = _cpu_flags()
    return [level for level in levels() if level.cpu_flags <= flags]


class KernelsUnavailable(Exception):
    """Why the kernels cannot be used here; the engine then keeps the PyTorch path."""


# --- Loading ---

_pinned: ctypes.CDLL | None = None


def load() -> ctypes.CDLL | None:
    """The kernels of the chosen level, or None when none can be had here (then PyTorch does the work).

    Nothing about the kernels may stop the server from starting: no compiler, a hung one, an unwritable cache
    directory, a noexec mount or a corrupt library each end here with one warning line."""
    return _pinned if _pinned is not None else _default()


@contextlib.contextmanager
def use_level(name: str) -> Iterator[ctypes.CDLL]:
    """Within the block load() returns this level's kernels (tests and benchmarks compare levels in one
    process); raises RuntimeError when the level cannot be had here."""
    global _pinned
    lib = load_level(name)
    previous, _pinned = _pinned, lib
    try:
        yield lib
    finally:
        _pinned = previous


@cache
def load_level(name: str) -> ctypes.CDLL:
    """One level's kernels: prebuilt, or else built into the cache; RuntimeError when this CPU cannot run it
    or it cannot be built."""
    level = next((level for level in levels() if level.name == name), None)
    if level is None:
        raise RuntimeError(f"no kernel level {name!r} on {platform.machine()}: one of {_names(levels())}")
    try:
        lib = _prebuilt(level) or _open(_build_at_first_use(level))
    except KernelsUnavailable as exc:
        raise RuntimeError(f"kernel level {name}: {exc}") from exc
    if not lib.prescient_cpu_supports():
        raise RuntimeError(f"this CPU cannot run the {name} kernels")
    return lib


@lru_cache(maxsize=1)
def _default() -> ctypes.CDLL | None:
    if os.environ.get("PRESCIENT_NATIVE", "1") == "0":
        return None
    try:
        lib, level, where = _choose()
    except Exception as exc:  # any failure means "use PyTorch", said once
        reason = str(exc) if isinstance(exc, KernelsUnavailable) else f"{type(exc).__name__}: {exc}"
        log.warning(
            "native kernels unavailable (%s); decode attention and quantized matmuls run in PyTorch (slower)",
            " ".join(reason.split())[:300],
        )
        return None
    global _chosen
    _chosen = level.name
    log.info(
        "native kernels: the %s level (%d-float vectors), %s", level.name, lib.prescient_vector_lanes(), where
    )
    return lib


_chosen: str | None = None


def chosen_level() -> str | None:
    """The level load() gives (outside use_level), or None where it gives no kernels."""
    return _chosen if _default() is not None else None


def _allowed() -> list[Level]:
    """The levels load() may choose, best first: those this CPU runs, capped by PRESCIENT_ISA."""
    runnable = cpu_levels() or list(levels()[:1])
    cap = os.environ.get("PRESCIENT_ISA", "").strip().lower()
    if cap:
        names = [level.name for level in levels()]
        if cap not in LEVEL_NAMES:
            raise KernelsUnavailable(f"PRESCIENT_ISA={cap!r} is not one of {', '.join(LEVEL_NAMES)}")
        if cap in names:  # a level of another architecture caps nothing here
            runnable = [level for level in runnable if names.index(level.name) <= names.index(cap)]
    return runnable[::-1]


def _choose() -> tuple[ctypes.CDLL, Level, str]:
    """The best allowed prebuilt level this CPU runs; else the best allowed level built here now."""
    allowed = _allowed()
    if not allowed:
        raise KernelsUnavailable("no kernel level allowed")
    problems: list[str] = []
    for level in allowed:
        try:
            lib = _prebuilt(level)
        except KernelsUnavailable as exc:  # a damaged build: the next level down
            problems.append(str(exc))
            continue
        if lib is not None and lib.prescient_cpu_supports():
            if problems:
                log.warning("native kernels: %s; using the %s level", "; ".join(problems)[:300], level.name)
            return lib, level, f"prebuilt in {build_dir()}"
    lib = _open(_build_at_first_use(allowed[0]))
    if problems:
        log.warning("native kernels: %s; built the %s level here", "; ".join(problems)[:300], allowed[0].name)
    if not lib.prescient_cpu_supports():
        raise KernelsUnavailable(f"this CPU cannot run the {allowed[0].name} kernels")
    if debug_requested():
        return lib, allowed[0], "the debug build (argument checks, PRESCIENT_KERNEL_DEBUG)"
    return lib, allowed[0], "built at first use (run `make install` to build every level ahead)"


def build_dir() -> Path:
    return Path(os.environ.get("PRESCIENT_KERNELS_DIR") or BUILD_DIR)


def sources_hash() -> str:
    digest = hashlib.sha256()
    for path in SOURCES + HEADERS:
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:16]


def library_name(level: Level) -> str:
    return f"prescient-kernels-{level.name}.so"


def _prebuilt(level: Level) -> ctypes.CDLL | None:
    """The level's library from build_dir() when its manifest matches these sources; None when absent."""
    if debug_requested():  # the debug library lives only in the cache
        return None
    directory = build_dir()
    try:
        manifest = json.loads((directory / "manifest.json").read_text())
    except (OSError, ValueError):
        return None
    path = directory / library_name(level)
    if manifest.get("sources") != sources_hash() or level.name not in manifest.get("levels", {}):
        return None
    if not path.exists():
        return None
    try:
        return _open(path)
    except OSError as exc:
        raise KernelsUnavailable(f"cannot load {path} ({exc}); rebuild it with `make install`") from exc


def _cache_dir() -> Path:
    root = os.environ.get("PRESCIENT_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "prescient"
    )
    return Path(root) / "kernels"


def cache_target(level: Level, debug: bool = False) -> Path:
    """Where a build at first use puts the level's library (keyed by the sources)."""
    return _cache_dir() / f"prescient-kernels-{sources_hash()}-{level.name}{'-debug' if debug else ''}.so"


def _build_at_first_use(level: Level, debug: bool | None = None) -> Path:
    debug = debug_requested() if debug is None else debug
    target = cache_target(level, debug)
    if target.exists():
        try:
            _open(target)
            return target
        except OSError:  # a truncated or corrupt cached build (or an unloadable one): build it again
            target.unlink(missing_ok=True)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = tempfile.TemporaryDirectory(dir=target.parent)
    except OSError as exc:
        raise KernelsUnavailable(
            f"cache directory {target.parent} is not writable ({exc.strerror}); "
            f"set PRESCIENT_CACHE to a writable one"
        ) from exc
    if os.statvfs(target.parent).f_flag & os.ST_NOEXEC:  # a library built there could not be loaded
        tmp.cleanup()
        raise KernelsUnavailable(
            f"cache directory {target.parent} is on a noexec mount; set PRESCIENT_CACHE elsewhere"
        )
    timeout = float(os.environ.get("PRESCIENT_NATIVE_BUILD_TIMEOUT", BUILD_TIMEOUT_SECONDS))
    with tmp:
        built = Path(tmp.name) / target.name
        build_level(level, built, timeout=timeout, debug=debug)
        os.replace(built, target)
    try:
        _open(target)
    except OSError as exc:
        raise KernelsUnavailable(
            f"cannot load {target} ({exc}); a noexec mount? set PRESCIENT_CACHE elsewhere"
        ) from exc
    return target


# --- Building ---


def compiler() -> str:
    found = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if found is None:
        raise KernelsUnavailable("no C compiler found")
    return found


def build_level(
    level: Level, out: Path, *, timeout: float, jobs: int | None = None, debug: bool = False
) -> str:
    """Compiles every source for the level (in parallel, `jobs` compilers at once) and links them into out.
    Returns the compiler's warnings. Raises KernelsUnavailable when a compiler fails or the whole build takes longer
    than timeout seconds; every compiler runs in its own process group, and every group is killed before this
    returns, so no compiler process outlives the build. `debug` adds the argument checks (DEBUG_CFLAGS)."""
    cc = compiler()
    objects = [out.parent / f"{out.stem}.{source.stem}.o" for source in SOURCES]
    compiles = [
        [cc, *CFLAGS, *(DEBUG_CFLAGS if debug else ()), *level.cflags, "-c", str(source), "-o", str(obj)]
        for source, obj in zip(SOURCES, objects, strict=True)
    ]
    deadline = time.monotonic() + timeout
    try:
        warnings = _run_all(compiles, deadline, timeout, jobs or os.cpu_count() or 1)
        warnings += _run_all(
            [[cc, "-shared", "-fopenmp", *map(str, objects), "-o", str(out), "-lm"]], deadline, timeout, 1
        )
    finally:
        for obj in objects:
            obj.unlink(missing_ok=True)
    return warnings


def _run_all(commands: list[list[str]], deadline: float, timeout: float, jobs: int) -> str:
    pending, running, warnings = list(commands), [], []
    try:
        while pending or running:
            while pending and len(running) < jobs:
                err = tempfile.TemporaryFile(mode="w+")
                process = subprocess.Popen(
                    pending.pop(0), stdin=subprocess.DEVNULL, stdout=err, stderr=err, start_new_session=True
                )
                running.append((process, err))
            for process, err in list(running):
                if process.poll() is None:
                    continue
                running.remove((process, err))
                _kill_group(process)  # anything it left behind
                err.seek(0)
                text = err.read()
                err.close()
                if process.returncode != 0:
                    lines = text.splitlines()
                    first = next((line for line in lines if "error" in line), text[:200])
                    raise KernelsUnavailable(f"building the kernels failed: {first.strip()}")
                warnings.append(text)
            if time.monotonic() > deadline:
                raise KernelsUnavailable(f"the C compiler did not finish in {timeout:g} s")
            time.sleep(0.01)
    finally:
        for process, err in running:
            _kill_group(process)
            err.close()
    return "".join(warnings)


def _kill_group(process: subprocess.Popen) -> None:
    """SIGKILL to the process's group (it leads its own session): the compiler driver and all its children."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signal.SIGKILL)
    process.wait()


def build(out_dir: Path | None = None, names: list[str] | None = None, echo=print) -> dict[str, float]:
    """Builds the levels (all of this architecture's by default) into out_dir (build_dir()) and writes its
    manifest; says per level how long it took and which level this CPU gets. Returns seconds per level."""
    out_dir = out_dir or build_dir()
    chosen = [level for level in levels() if names is None or level.name in names]
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "manifest.json").unlink(missing_ok=True)
    seconds: dict[str, float] = {}
    warned: dict[str, str] = {}
    for level in chosen:
        started = time.monotonic()
        with tempfile.TemporaryDirectory(dir=out_dir) as tmp:
            built = Path(tmp) / library_name(level)
            warnings = build_level(level, built, timeout=float("inf"))
            os.replace(built, out_dir / library_name(level))
        seconds[level.name] = time.monotonic() - started
        echo(
            f"kernels {level.name:8s} {' '.join(level.cflags) or '(default target)':45s} {seconds[level.name]:6.1f} s"
        )
        warned[level.name] = warnings.strip()
        if warnings.strip():
            echo(warnings.rstrip())
    manifest = {
        "sources": sources_hash(),
        "levels": {name: round(s, 1) for name, s in seconds.items()},
        "warnings": warned,  # the compiler's -Wall output per level: empty (tested)
    }
    (out_dir / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    runnable = [level.name for level in cpu_levels() if level.name in seconds]
    echo(
        f"this CPU ({platform.machine()}) gets the {runnable[-1] if runnable else 'PyTorch (no level)'} level"
    )
    return seconds


def build_debug(names: list[str] | None = None, echo=print) -> list[Path]:
    """Builds the debug library (DEBUG_CFLAGS) of the levels this CPU runs (those named) into the cache, where
    load() finds it under PRESCIENT_KERNEL_DEBUG=1; says where each went and any compiler warning."""
    built = []
    for level in cpu_levels():
        if names is None or level.name in names:
            target = cache_target(level, debug=True)
            target.unlink(missing_ok=True)
            with tempfile.TemporaryDirectory(dir=_mkdir(target.parent)) as tmp:
                warnings = build_level(level, Path(tmp) / target.name, timeout=float("inf"), debug=True)
                os.replace(Path(tmp) / target.name, target)
            echo(f"kernels {level.name:8s} debug build: {target}")
            if warnings.strip():
                echo(warnings.rstrip())
            built.append(target)
    return built


def _mkdir(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    return path


def _names(items) -> str:
    return ", ".join(level.name for level in items)


# --- The exported functions' signatures (each declared once in csrc/kernels.h; a test compares the two) ---

_i64, _ptr, _int, _float = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int, ctypes.c_float
_LIMITS = [_float, _i64, _float, _int]  # scale, window, softcap, num_threads
_ATTENTION = [_ptr, _ptr, _ptr, _ptr, _ptr, _ptr, _i64, _i64, _i64, _i64, _i64, _i64, *_LIMITS]
_PREFILL = [_ptr, _ptr, _ptr, _ptr, _i64, _ptr, _i64, _ptr, _int, _i64, _i64, _i64, _i64, *_LIMITS]
SIGNATURES: dict[str, tuple[type | None, list[type]]] = {
    "paged_decode_attention_f32": (None, _ATTENTION),
    "paged_decode_attention_bf16": (None, _ATTENTION),
    "paged_prefill_attention_f32": (None, _PREFILL),
    "paged_prefill_attention_bf16": (None, _PREFILL),
    "quantized_matmul": (
        None,
        [_ptr, _int, _i64, _i64, _ptr, _ptr, _ptr, _i64, _int, _ptr, _int, _int, _int],
    ),
    "quantized_gemm": (
        None,
        [_ptr, _int, _i64, _i64, _ptr, _ptr, _ptr, _i64, _int, _ptr, _i64, _int, _int, _int, _int],
    ),
    "quantized_matmul_vectorized": (_int, []),
    "quantized_tiles_rows": (None, [_ptr, _ptr, _ptr, _i64, _int, _ptr, _i64, _ptr, _int]),
    "gguf_relayout": (_i64, [_int, _ptr, _i64, _ptr, _i64, _i64, _ptr, _ptr, _ptr, _int]),
    "gguf_dequantize": (_int, [_int, _ptr, _i64, _ptr, _i64, _i64, _ptr, _int]),
    "add_rms_norm": (None, [_ptr, _ptr, _ptr, _ptr, _i64, _i64, _float, _int, _int]),
    "silu_mul": (None, [_ptr, _ptr, _i64, _i64, _int, _int]),
    "gelu_mul": (None, [_ptr, _ptr, _i64, _i64, _int, _int]),
    "rope_write_kv": (
        None,
        [_ptr, _ptr, _ptr, _ptr, _float, _ptr, _ptr, _ptr, _ptr, _ptr, _ptr, _ptr]
        + [_i64, _i64, _i64, _i64, _int, _int, _int],
    ),
    "nucleus_sample": (None, [_ptr, _i64, _i64, _i64, _ptr, _ptr, _ptr, _ptr, _ptr, _int]),
    "greedy_sample": (None, [_ptr, _i64, _i64, _i64, _ptr, _int]),
    "decode_layers": (None, [_ptr, _ptr, _i64, _ptr, _int]),
    "decode_layers_rows": (None, [_ptr, _ptr, _i64, _ptr, _i64, _i64]),
    "compute_thread_ids": (_int, [_int, _ptr]),
    "int8_dot_peak": (_i64, [_i64, _int]),
    "prescient_cpu_supports": (_int, []),
    "prescient_vector_lanes": (_int, []),
}


def _open(path: Path) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(path))
    for name, (restype, argtypes) in SIGNATURES.items():
        try:
            fn = getattr(lib, name)
        except AttributeError as exc:  # some other library under our name, or an older build
            raise OSError(f"{path} lacks the kernels' symbol {name}") from exc
        fn.argtypes, fn.restype = argtypes, restype
    return lib
