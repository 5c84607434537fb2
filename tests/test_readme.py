"""The README's examples run as shown: each Python block, and the curl command, against a real server."""

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


def test_offline_example_generates():
    out = run_python(python_block("Engine.from_pretrained()"))
    words = out.split()
    assert words[-1] in ("stop", "length"), out  # print(out.text, out.finish_reason)
    assert len(words) > 1, f"no text generated: {out!r}"


def test_loader_example_reads_storage_once_in_two_epochs():
    out = run_python(python_block("from loader import DataLoader"))
    stats = ast.literal_eval(out.strip().splitlines()[-1])
    assert stats["samples"] == 2000
    assert stats["storage_reads"] == 1000, stats  # epoch 2 is served from the RAM cache
    assert stats["ram_hits"] >= 1000, stats


@pytest.fixture(scope="module")
def server():
    with running_server() as s:
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
