"""Shared cores: the engine beside busy processes and under a CPU quota (`python -m tests.bench contention`).

Scenarios, each with the cores as they are for every row of it: quiet; 1 and 2 busy processes (a plain
`while True: x += 1` loop each, nice 0) beside the engine; a cgroup CPU quota of 1.5 cores on the engine
(and nothing beside it), where this machine lets the bench create a cgroup (cgroup v2 cpu.max or v1
cpu.cfs_quota_us; otherwise the row says so).

Rows per scenario, the engine with its thread count adapting (the default) and fixed at the cores it may use
(--no-adaptive-threads: how it ran before), measured in the same run:
- offline: the engine in a fresh process, 1 stream and 16 streams of greedy decoding (64-token prompts);
- server: the real server on loopback, 1 stream and 16 concurrent streams;
- llama.cpp built for this CPU (tests/bench/llama_cpp_native.py), 1 stream, same threads, same model, beside
  the same busy processes (not under the quota).
Each figure is the median over repeated requests within BENCH_CONTENTION_SECONDS (default 8) and its ratio to
the same row quiet. Under the quota, the share of the quota periods the cgroup was throttled in (cpu.stat's
nr_throttled over nr_periods).

BENCH_CONTENTION_MODELS: smollm2 (the default model) and/or 1b (the 1B shape's Q4_K_M of the sizes bench,
tests/bench/size_ladder.py); default smollm2. BENCH_CONTENTION_SCENARIOS narrows the scenarios.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from tests.bench import llama_cpp_native
from tests.bench.load_generator import RequestSpec, random_prompts, run_load
from tests.server.conftest import running_server

SECONDS = float(os.environ.get("BENCH_CONTENTION_SECONDS", "8"))
SCENARIOS = ("quiet", "busy1", "busy2", "quota1.5")
PROMPT, OUTPUT, STREAMS = 64, 64, 16
BUSY = "x = 0\nwhile True:\n    x += 1\n"

_OFFLINE = r"""
import json, statistics, sys, time
from runtime import Engine, SamplingParams
from tests.bench.load_generator import random_prompts
model, adaptive, seconds, streams = sys.argv[1] or None, sys.argv[2] == "1", float(sys.argv[3]), int(sys.argv[4])
engine = Engine.from_pretrained(model, dtype="auto", kv_cache_bytes=512 << 20, max_num_seqs=max(streams, 1),
                                adaptive_threads=adaptive)
prompts = random_prompts(streams, int(sys.argv[5]), seed=7)
engine.generate(prompts, SamplingParams(max_tokens=8, ignore_eos=True))
rates, end = [], time.monotonic() + seconds
while time.monotonic() < end or len(rates) < 3:
    start = time.perf_counter()
    engine.generate(prompts, SamplingParams(max_tokens=int(sys.argv[6]), temperature=0, ignore_eos=True))
    rates.append(streams * int(sys.argv[6]) / (time.perf_counter() - start))
s = engine.stats()
print(json.dumps({"rate": statistics.median(rates), "threads": s.cpu_threads, "contention": s.cpu_contention}))
"""


def _model(name: str) -> tuple[str, str | None]:
    """(label, path or None for the default model)."""
    if name == "smollm2":
        return "SmolLM2-135M Q4_1", None
    if name == "1b":
        from tests.bench.size_ladder import model_file

        return "1B shape Q4_K_M", str(model_file("1b", "q4_k_m"))
    return Path(name).name, name


@contextlib.contextmanager
def busy(n: int):
    procs = [subprocess.Popen([sys.executable, "-c", BUSY]) for _ in range(n)]
    try:
        time.sleep(0.5)
        yield
    finally:
        for p in procs:
            p.kill()
            p.wait()


class Quota:
    """A child cgroup of this process's own with a CPU quota; `wrap(cmd)` starts a command inside it."""

    def __init__(self, cores: float, period_us: int = 100_000):
        self.path = None
        self.error = ""
        try:
            self.path, self.v2 = _new_cgroup()
            if self.v2:
                (self.path / "cpu.max").write_text(f"{int(cores * period_us)} {period_us}")
            else:
                (self.path / "cpu.cfs_period_us").write_text(str(period_us))
                (self.path / "cpu.cfs_quota_us").write_text(str(int(cores * period_us)))
        except OSError as exc:
            self.error = f"no cgroup with a CPU quota here ({exc})"
            self.close()

    def wrap(self, cmd: list[str]) -> list[str]:
        return ["sh", "-c", f'echo $$ > {self.path / "cgroup.procs"} && exec "$0" "$@"', *cmd]

    def throttling(self) -> tuple[int, int]:
        """(nr_periods, nr_throttled) so far."""
        fields = dict(
            line.split() for line in (self.path / "cpu.stat").read_text().splitlines() if " " in line
        )
        return int(fields.get("nr_periods", 0)), int(fields.get("nr_throttled", 0))

    def close(self) -> None:
        if self.path is not None:
            with contextlib.suppress(OSError):
                self.path.rmdir()
            self.path = None


def _new_cgroup() -> tuple[Path, bool]:
    lines = Path("/proc/self/cgroup").read_text().splitlines()
    name = f"prescient-bench-{os.getpid()}"
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "" and Path("/sys/fs/cgroup/cgroup.controllers").exists():
            parent = Path("/sys/fs/cgroup") / path.lstrip("/")
            # fails (the bench then says so) where this cgroup holds processes: v2 lets only a leaf hold them
            (parent / "cgroup.subtree_control").write_text("+cpu")
            child = parent / name
            child.mkdir()
            return child, True
        if "cpu" in controllers.split(","):
            base = Path("/sys/fs/cgroup") / controllers
            if not base.exists():
                base = Path("/sys/fs/cgroup/cpu")
            child = base / path.lstrip("/") / name
            child.mkdir()
            return child, False
    raise OSError("no cpu controller in /proc/self/cgroup")


def offline(model: str | None, adaptive: bool, streams: int, quota: Quota | None) -> dict:
    cmd = [sys.executable, "-c", _OFFLINE, model or "", "1" if adaptive else "0", str(SECONDS), str(streams)]
    cmd += [str(PROMPT), str(OUTPUT)]
    if quota is not None:
        cmd = quota.wrap(cmd)
    run = subprocess.run(cmd, capture_output=True, text=True)
    if run.returncode != 0:
        raise RuntimeError(f"offline measure failed:\n{run.stderr[-3000:]}")
    return json.loads(run.stdout.strip().splitlines()[-1])


def served(model: str | None, adaptive: bool, quota: Quota | None) -> dict:
    args = ["--no-adaptive-threads"] if not adaptive else []
    if model:
        args += ["--model", model]
    command = quota.wrap([sys.executable, "-m", "server"]) if quota is not None else None
    out = {}
    with running_server(*args, dtype="auto", kv_cache="512MiB", command=command) as srv:
        with urllib.request.urlopen(srv.url + "/v1/models", timeout=10) as r:
            served_name = json.load(r)["data"][0]["id"]
        for streams in (1, STREAMS):
            rates = []
            prompts = random_prompts(streams, PROMPT, seed=11)
            specs = [RequestSpec(prompt=p, max_tokens=OUTPUT) for p in prompts]
            end = time.monotonic() + SECONDS
            while time.monotonic() < end or len(rates) < 3:
                results, wall = asyncio.run(run_load(srv.url, served_name, specs, concurrency=streams))
                failed = [r.error for r in results if not r.ok]
                if failed:
                    raise RuntimeError(f"requests failed: {failed[:3]}")
                rates.append(sum(r.output_tokens for r in results) / wall)
            out[streams] = statistics.median(rates)
        m = srv.metrics()
        out["threads"] = m.get("prescient:cpu_threads{}")
        out["contention"] = m.get("prescient:cpu_contention{}")
    return out


def measure(model: str | None, adaptive: bool, quota: Quota | None) -> dict[str, tuple]:
    """{row: (tok/s, threads at the end, contention at the end)} for one mode."""
    figures = {}
    for streams in (1, STREAMS):
        o = offline(model, adaptive, streams, quota)
        figures[f"offline x{streams}"] = (o["rate"], o["threads"], o["contention"])
    s = served(model, adaptive, quota)
    for streams in (1, STREAMS):
        figures[f"server x{streams}"] = (s[streams], s["threads"], s["contention"])
    return figures


def run() -> dict:
    models = os.environ.get("BENCH_CONTENTION_MODELS", "smollm2").split(",")
    wanted = os.environ.get("BENCH_CONTENTION_SCENARIOS", ",".join(SCENARIOS)).split(",")
    rows, notes = [], [f"CPU: {llama_cpp_native.cpu_description()}"]
    llama = True
    try:
        llama_cpp_native.ensure()
    except Exception as exc:  # the bench still compares our modes
        llama = False
        notes.append(f"llama.cpp unavailable: {exc}")
    for name in models:
        label, model = _model(name)
        quiet: dict[str, float] = {}
        for scenario in [s for s in SCENARIOS if s in wanted]:
            quota = Quota(1.5) if scenario.startswith("quota") else None
            if quota is not None and quota.path is None:
                notes.append(f"{scenario}: {quota.error}")
                continue
            neighbours = int(scenario[4:]) if scenario.startswith("busy") else 0
            try:
                with busy(neighbours):
                    for mode in ("adaptive", "fixed"):
                        before = quota.throttling() if quota else None
                        figures = measure(model, mode == "adaptive", quota)
                        throttled = None
                        if quota is not None:
                            periods, count = quota.throttling()
                            throttled = (count - before[1]) / max(1, periods - before[0])
                        for what, (rate, threads, contention) in figures.items():
                            key = f"{what} {mode}"
                            if scenario == "quiet":
                                quiet[key] = rate
                            rows.append(
                                {
                                    "model": label,
                                    "scenario": scenario,
                                    "row": what,
                                    "threads": mode,
                                    "tok/s": rate,
                                    "of quiet": rate / quiet[key] if key in quiet else None,
                                    "threads at end": threads,
                                    "contention": contention,
                                    "throttled periods": throttled,
                                }
                            )
                    if llama and quota is None:
                        rate = llama_cpp_native.measure(model_path_for_llama(model), threads=2, batch=8)["x1"]
                        if scenario == "quiet":
                            quiet["llama.cpp"] = rate
                        rows.append(
                            {
                                "model": label,
                                "scenario": scenario,
                                "row": "llama.cpp x1",
                                "tok/s": rate,
                                "of quiet": rate / quiet["llama.cpp"] if "llama.cpp" in quiet else None,
                            }
                        )
            finally:
                if quota is not None:
                    quota.close()
    for row in rows:
        if row["row"] in ("offline x1", "server x1"):
            ll = [
                r["tok/s"]
                for r in rows
                if (r["model"], r["scenario"], r["row"]) == (row["model"], row["scenario"], "llama.cpp x1")
            ]
            row["vs llama.cpp x1"] = row["tok/s"] / ll[0] if ll else None
    return {"title": "Shared cores: busy neighbours and a CPU quota", "rows": rows, "notes": notes}


def model_path_for_llama(model: str | None) -> str:
    if model:
        return model
    from runtime.model.checkpoint import default_model_path

    return default_model_path()
