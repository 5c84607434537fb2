"""The README's examples run as shown: each Python block, and the curl command, against a real server; and
what it names exists: server flags, make targets, benchmarks, files, metric names."""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys

import pytest

from tests.server.conftest import ROOT, running_server

README = open(os.path.join(ROOT, "README.md")).read()
BLOCKS = re.findall(r"```(\w+)\n(.*?)```", README, re.S)
PROSE = re.sub(r"```.*?```", "", README, flags=re.S)
SPANS = re.findall(r"`([^`\n]+)`", PROSE)  # inline code outside the fenced blocks


def python_block(marker: str) -> str:
    found = [code for lang, code in BLOCKS if lang == "python" and marker in code]
    assert len(found) == 1, f"README: expected one python block containing {marker!r}, found {len(found)}"
    return found[0]


def run_python(code: str, timeout: float = 300) -> str:
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=timeout
    )
    assert proc.returncode == 0, f"README example failed:\n{code}\n{proc.stderr[-3000:]}"
    return proc.stdout


@pytest.mark.slow
def test_offline_example_generates():
    out = run_python(python_block("Engine.from_pretrained()"))
    words = out.split()
    assert words[-1] in ("stop", "length"), out  # print(out.text, out.finish_reason)
    assert len(words) > 1, f"no text generated: {out!r}"


@pytest.mark.slow
def test_loader_example_reads_storage_once_in_two_epochs():
    out = run_python(python_block("from loader import DataLoader"))
    stats = ast.literal_eval(out.strip().splitlines()[-1])
    assert stats["samples"] == 2000
    assert stats["storage_reads"] == 1000, stats  # epoch 2 is served from the RAM cache
    assert stats["ram_hits"] >= 1000, stats


def test_flags_are_the_servers():
    from server.cli import build_parser

    known = {option for action in build_parser()._actions for option in action.option_strings}
    named = {span.split()[0] for span in SPANS if span.startswith("--")}
    assert named, "README: no flags found"
    assert named <= known, f"README names flags the server does not have: {sorted(named - known)}"


def test_make_targets_and_benchmarks_exist():
    makefile = open(os.path.join(ROOT, "Makefile")).read()
    for target in set(re.findall(r"\bmake ([a-z][a-z-]*)", README)):
        assert re.search(rf"^{re.escape(target)}:", makefile, re.M), f"README: no `make {target}` target"
    benches = set(re.findall(r"python -m tests\.bench (\w+)", README))
    assert benches, "README: no benchmark command found"
    for name in benches:
        assert os.path.exists(os.path.join(ROOT, "tests", "bench", f"bench_{name}.py")), name


def test_named_files_exist():
    links = re.findall(r"\]\(([^)#]+)\)", README)
    paths = [s for s in SPANS if re.fullmatch(r"\w[\w.-]*(/[\w.*-]+)+/?", s)] + links
    assert paths, "README: no file paths found"
    missing = [p for p in paths if not os.path.exists(os.path.join(ROOT, p))]
    assert not missing, f"README names files that do not exist: {missing}"


@pytest.fixture(scope="module")
def server():
    """The server as the README starts it: the default (packed) weights."""
    with running_server(dtype="auto") as s:
        yield s


def test_openai_client_example_streams(server):
    code = python_block("from openai import OpenAI").replace("http://127.0.0.1:8000", server.url)
    assert server.url in code
    assert run_python(code).strip(), "the streamed chat completion printed nothing"


def test_curl_example(server):
    shell = next(code for lang, code in BLOCKS if lang == "sh" and "curl" in code)
    command = shell[shell.index("curl") :].replace("localhost:8000", server.url).replace("\\\n", " ").strip()
    proc = subprocess.run(["bash", "-c", command], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    body = json.loads(proc.stdout)
    assert body["object"] == "chat.completion" and body["choices"][0]["message"]["content"], body


def test_metric_names_are_served(server):
    """Every series the README names (the loader's aside) is on the server's /metrics after a request."""
    import urllib.request

    body = json.dumps({"prompt": "Hi", "max_tokens": 2}).encode()
    request = urllib.request.Request(
        server.url + "/v1/completions", body, {"Content-Type": "application/json"}
    )
    urllib.request.urlopen(request, timeout=120).read()
    with urllib.request.urlopen(server.url + "/metrics", timeout=30) as response:
        exported = response.read().decode()
    named = {
        n for n in re.findall(r"prescient:[a-z][a-z0-9_]*", README) if not n.startswith("prescient:loader_")
    }
    assert len(named) > 10, named
    missing = sorted(n for n in named if not re.search(rf"^(# HELP )?{re.escape(n)}\b", exported, re.M))
    assert not missing, f"README names series /metrics does not export: {missing}"
