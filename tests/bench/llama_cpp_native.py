"""llama.cpp at its best on this CPU, the baseline of the benches that quote it: llama-cpp-python built from
its source distribution with GGML_NATIVE (compiled for the CPU it runs on; no tools, examples or tests),
once per CPU into a cache (`PRESCIENT_CACHE`, default ~/.cache/prescient, folder llama-cpp/<cpu key>), and
installed into the running environment from there. xllamacpp's prebuilt wheel (an AVX2 build with no per-CPU
choice) stays the tests' oracle of ggml's dot products, not a speed baseline.

On a CPU with AVX-512, our forced `avx2` level is also set beside llama.cpp built for AVX2 alone (GGML_NATIVE
off, AVX / AVX2 / FMA / F16C / BMI2 on): what a CPU without AVX-512 (a Zen 3) runs. That build goes into
llama-cpp/<version>-avx2 and is imported from there (PYTHONPATH) by the bench children that ask for it.

    python -m tests.bench.llama_cpp_native     # build where missing (about 10 minutes on 2 cores), install
    python -m tests.bench.llama_cpp_native avx2  # the AVX2 build (a folder of its own)
"""

from __future__ import annotations

import hashlib
import importlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

VERSION = "0.3.36"
_NO_EXTRAS = (
    "-DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=OFF"
)
CMAKE_ARGS = f"-DGGML_NATIVE=ON {_NO_EXTRAS}"
CMAKE_ARGS_AVX2 = (
    "-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON "
    f"-DGGML_AVX512=OFF {_NO_EXTRAS}"
)


def cpu_description() -> str:
    """lscpu's model name, family and model, and flags line: what every figure is recorded beside."""
    name, family, number = (_cpuinfo_field(f) for f in ("model name", "cpu family", "model"))
    return f"{name} (family {family} model {number}); flags: {_cpuinfo_field('flags')}"


def _cpuinfo_field(name: str) -> str:
    try:
        for line in open("/proc/cpuinfo"):
            key, _, value = line.partition(":")
            if key.strip() == name:
                return value.strip()
    except OSError:
        pass
    return "?"


def cpu_key() -> str:
    return hashlib.sha256(cpu_description().encode()).hexdigest()[:16]


def cache_dir(level: str = "native") -> Path:
    """The folder of the build: per CPU for the native one, one for the AVX2 build."""
    root = os.environ.get("PRESCIENT_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "prescient"
    )
    return Path(root) / "llama-cpp" / f"{VERSION}-{cpu_key() if level == 'native' else level}"


def _build_wheel(folder: Path, cmake_args: str, log) -> Path:
    """llama-cpp-python's wheel built from its sdist with `cmake_args` into `folder` (once: kept there). pip's
    own wheel cache stays out of it: it keys a built wheel by the sdist alone, and would hand one CPU's (or
    level's) build to another."""
    wheels = sorted(folder.glob("llama_cpp_python-*.whl"))
    if not wheels:
        folder.mkdir(parents=True, exist_ok=True)
        log(f"building llama-cpp-python {VERSION} into {folder} (about 10 minutes)")
        started = time.time()
        env = dict(os.environ, CMAKE_ARGS=cmake_args, CMAKE_BUILD_PARALLEL_LEVEL=str(os.cpu_count() or 2))
        subprocess.run(
            [sys.executable, "-m", "pip", "wheel", "-q", "--no-cache-dir", "--no-deps", "--no-binary",
             "llama-cpp-python", "-w", str(folder), f"llama-cpp-python=={VERSION}"],
            env=env,
            check=True,
        )  # fmt: skip
        log(f"built in {time.time() - started:.0f} s")
        wheels = sorted(folder.glob("llama_cpp_python-*.whl"))
    return wheels[-1]


def _installed_key() -> str | None:
    try:
        import llama_cpp
    except ImportError:
        return None
    marker = Path(llama_cpp.__file__).parent / "prescient-cpu-key"
    return marker.read_text().strip() if marker.exists() else None


def ensure(log=print, level: str = "native") -> str:
    """Make `import llama_cpp` give the build for this CPU (building it once); returns its system info. level
    "avx2": the AVX2 build, installed into its own folder for the children of measure(level="avx2")."""
    if level == "avx2":
        site = cache_dir("avx2") / "site"
        if not (site / "llama_cpp").is_dir():
            wheel = _build_wheel(cache_dir("avx2"), CMAKE_ARGS_AVX2, log)
            subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "pip",
                    "install",
                    "-q",
                    "--no-deps",
                    "--target",
                    str(site),
                    str(wheel),
                ],
                check=True,
            )
        return system_info("avx2")
    if _installed_key() != cpu_key():
        wheel = _build_wheel(cache_dir(), CMAKE_ARGS, log)
        subprocess.run(
            [sys.executable, "-m", "pip", "install", "-q", "--force-reinstall", "--no-deps", str(wheel)],
            check=True,
        )
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "install",
                "-q",
                "diskcache>=5.6",
                "jinja2>=2.11",
                "typing-extensions",
            ],
            check=True,
        )
        import llama_cpp

        llama_cpp = importlib.reload(llama_cpp)
        (Path(llama_cpp.__file__).parent / "prescient-cpu-key").write_text(cpu_key())
    return system_info()


def _env(level: str) -> dict:
    """The environment of a child that imports llama_cpp at `level` (the AVX2 build ahead of the native one)."""
    if level == "native":
        return dict(os.environ)
    path = os.environ.get("PYTHONPATH")
    site = str(cache_dir(level) / "site")
    return dict(os.environ, PYTHONPATH=f"{site}{os.pathsep}{path}" if path else site)


MEMORY_STATUS = """
def status(field):
    for line in open("/proc/self/status"):
        if line.startswith(field):
            return int(line.split()[1]) * 1024

def resident(ptr, nbytes):
    import ctypes, mmap
    page = mmap.PAGESIZE
    start = ptr // page * page
    pages = -(-(ptr + nbytes - start) // page)
    vec = (ctypes.c_ubyte * pages)()
    if ctypes.CDLL(None).mincore(ctypes.c_void_p(start), ctypes.c_size_t(pages * page), vec) != 0:
        return nbytes
    return min(nbytes, sum(b & 1 for b in bytes(vec)) * page)
"""
"""A bench child's bytes of a /proc/self/status field (VmRSS, VmHWM), and the resident bytes of a buffer
(mincore: a KV pool on fresh anonymous pages holds only the pages written), as source for its script."""

_MEASURE = (
    MEMORY_STATUS
    + """
import json, statistics, sys, time
import numpy as np
import llama_cpp as L

path, threads, batch_seqs, vocab_cap = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
L.llama_backend_init()
rss0 = status("VmRSS")
start = time.perf_counter()
model = L.llama_model_load_from_file(path.encode(), L.llama_model_default_params())
cp = L.llama_context_default_params()
cp.n_ctx, cp.n_batch, cp.n_ubatch, cp.n_seq_max = 4096, 512, 512, max(1, batch_seqs)
cp.n_threads = cp.n_threads_batch = threads
ctx = L.llama_init_from_model(model, cp)
load = time.perf_counter() - start
n_vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(model))
high = min(n_vocab, vocab_cap) if vocab_cap > 0 else n_vocab
rng = np.random.default_rng(0)
batch = L.llama_batch_init(512, 0, max(1, batch_seqs))

def submit(tokens, seqs, positions):
    seqs = list(seqs)
    batch.n_tokens = len(tokens)
    for i, (t, s, p) in enumerate(zip(tokens, seqs, positions)):
        batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.seq_id[i][0] = int(t), int(p), 1, int(s)
        batch.logits[i] = 1 if i == len(tokens) - 1 or seqs[i + 1] != s else 0
    assert L.llama_decode(ctx, batch) == 0

def clear():
    L.llama_memory_clear(L.llama_get_memory(ctx), True)

def prefill():
    clear()
    start = time.perf_counter()
    submit(rng.integers(100, high, 512), [0] * 512, range(512))
    return 512 / (time.perf_counter() - start)

def decode(n_seqs, steps=48):
    clear()
    prompt = rng.integers(100, high, 64)
    submit(np.tile(prompt, n_seqs), np.repeat(np.arange(n_seqs), 64), np.tile(np.arange(64), n_seqs))
    tok = [int(prompt[-1])] * n_seqs
    start = time.perf_counter()
    for step in range(steps):
        submit(tok, range(n_seqs), [64 + step] * n_seqs)
        for s in range(n_seqs):  # greedy, as the engine benches sample
            logits = np.ctypeslib.as_array(L.llama_get_logits_ith(ctx, s if n_seqs > 1 else 0), (n_vocab,))
            tok[s] = int(logits.argmax())
    return n_seqs * steps / (time.perf_counter() - start)

decode(1, 4)  # warm-up
out = {"load_s": load, "rss": status("VmRSS") - rss0, "peak": status("VmHWM") - rss0}
out["prefills"] = [prefill() for _ in range(3)]
out["decodes"] = [decode(1) for _ in range(3)]
out["prefill"], out["x1"] = statistics.median(out["prefills"]), statistics.median(out["decodes"])
if batch_seqs > 1:
    out[f"x{batch_seqs}"] = decode(batch_seqs)
print(json.dumps(out))
"""
)


def measure(path, threads: int = 2, batch: int = 8, vocab: int = 0, level: str = "native") -> dict:
    """llama.cpp (this CPU's build, ensure() first) on the GGUF at `path` with `threads` threads, in a fresh
    process: load seconds, resident memory after load and peak (bytes over the process's own before it),
    prefill of a 512-token prompt (one llama_decode; 3 runs), one stream's decode (48 greedy tokens after a
    64-token prompt, wall time of llama_decode and the argmax; 3 runs) and `batch` streams decoding together
    (one llama_decode a step), tokens/s. Prompt ids below `vocab` where it is > 0. level "avx2": the AVX2 build
    (ensure(level="avx2") first)."""
    run = subprocess.run(
        [sys.executable, "-c", _MEASURE, str(path), str(threads), str(batch), str(vocab)],
        capture_output=True,
        text=True,
        env=_env(level),
    )
    if run.returncode != 0:
        raise RuntimeError(f"llama.cpp on {path} failed:\n{run.stderr[-3000:]}")
    return json.loads(run.stdout.strip().splitlines()[-1])


def system_info(level: str = "native") -> str:
    out = subprocess.run(
        [sys.executable, "-c", "import llama_cpp; print(llama_cpp.llama_print_system_info().decode())"],
        capture_output=True,
        text=True,
        check=True,
        env=_env(level),
    )
    return out.stdout.strip()


if __name__ == "__main__":
    print(ensure(level=sys.argv[1] if len(sys.argv) > 1 else "native"))
