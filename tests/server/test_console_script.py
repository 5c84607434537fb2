"""The installed `prescient` console script (pyproject's [project.scripts]) starts a real server with
`prescient serve MODEL` and the flags of `python -m server`; --api-key (repeatable) guards the API with
Bearer keys while /health, /version, /openapi.json and /metrics stay open, as vLLM's --api-key does."""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys
import urllib.error
import urllib.request

import openai
import pytest

from runtime.model.checkpoint import default_model_path
from tests.server.conftest import MODEL, ROOT, running_server

pytestmark = pytest.mark.slow

SCRIPT = os.path.join(os.path.dirname(sys.executable), "prescient")


def _get(url: str, key: str | None = None) -> tuple[int, dict | str]:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=10) as r:
            body = r.read().decode()
            return r.status, json.loads(body) if "json" in r.headers.get("Content-Type", "") else body
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_the_entry_point_is_declared_and_installed():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        assert tomllib.load(f)["project"]["scripts"] == {"prescient": "server.cli:console_main"}
    assert os.access(SCRIPT, os.X_OK), "run `make install` (pip install -e .) to install the script"
    usage = subprocess.run([SCRIPT], capture_output=True, text=True, timeout=60)
    assert usage.returncode == 2 and "prescient serve [MODEL]" in usage.stderr
    both = subprocess.run(
        [SCRIPT, "serve", "a.gguf", "--model", "b.gguf"], capture_output=True, text=True, timeout=60
    )
    assert both.returncode == 2 and "disagree" in both.stderr


def test_prescient_serve_model_with_api_keys():
    command = [SCRIPT, "serve", default_model_path()]
    flags = ("--api-key", "key-one", "--api-key", "key-two", "--served-model-name", MODEL)
    with running_server(*flags, command=command) as server:
        for path in ("/health", "/version", "/openapi.json", "/metrics"):
            status, _ = _get(server.url + path)
            assert status == 200, path
        assert _get(server.url + "/version")[1] == {
            "version": importlib.metadata.version("prescient-runtime")
        }

        status, body = _get(server.url + "/v1/models")
        assert (
            status == 401
            and body["error"]["code"] == "invalid_api_key"
            and "Bearer" in body["error"]["message"]
        )
        for key in ("key-one", "key-two"):
            client = server.openai_client(key, timeout=60)
            assert [m.id for m in client.models.list().data] == [MODEL]
            resp = client.completions.create(model=MODEL, prompt="Hello", max_tokens=2, user="alice")
            assert resp.usage.completion_tokens >= 1
        wrong = server.openai_client("key-three", timeout=60)
        with pytest.raises(openai.AuthenticationError) as info:
            wrong.completions.create(model=MODEL, prompt="Hello", max_tokens=2)
        assert info.value.code == "invalid_api_key" and info.value.status_code == 401
        # a plain --api-key names no tenant: the request's `user` does, as without keys
        assert any('tenant="alice"' in line for line in _get(server.url + "/metrics")[1].splitlines())
        log = server.output()
    assert "key-one" not in log and "key-two" not in log  # keys are never logged
