"""The engine core in its own process: a dead core is an error to every client, never a hang; no orphan cores.

Everything is real: `python -m server` on loopback, its core process, signals.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

from tests.server.conftest import ROOT, running_server


def _children(pid: int) -> list[int]:
    out = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{tid}/children") as f:
            out += [int(c) for c in f.read().split()]
    return out


def _core_pid(server) -> int:
    """The core process: the server's child that runs the engine (its command line says spawn_main)."""
    for child in _children(server.proc.pid):
        with open(f"/proc/{child}/cmdline", "rb") as f:
            if b"spawn_main" in f.read():
                return child
    raise AssertionError(f"no engine core process under the server:\n{server.output()}")


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _wait_gone(pid: int, timeout: float) -> bool:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if not _alive(pid):
            return True
        time.sleep(0.1)
    return False


def _post(url: str, body: dict, timeout: float = 60) -> tuple[int, bytes]:
    req = urllib.request.Request(
        url + "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def test_a_killed_core_fails_requests_fast_and_sigterm_leaves_no_orphan():
    with running_server("--engine-process") as server:
        core = _core_pid(server)
        status, body = _post(server.url, {"prompt": "Hello", "max_tokens": 3, "ignore_eos": True})
        assert status == 200 and json.loads(body)["usage"]["completion_tokens"] == 3

        # through the core: batched prompts, logit_bias and min_tokens work; n > 1 and logprobs are a 400
        status, body = _post(
            server.url,
            {"prompt": ["Hello", [1, 2, 3]], "max_tokens": 2, "min_tokens": 2, "logit_bias": {"0": -100}},
        )
        assert status == 200 and [c["index"] for c in json.loads(body)["choices"]] == [0, 1]
        for field, extra in (("n", {"n": 2}), ("logprobs", {"logprobs": 1}), ("n", {"best_of": 2})):
            status, body = _post(server.url, {"prompt": "Hello", "max_tokens": 2, **extra})
            error = json.loads(body)["error"]
            assert status == 400 and error["param"] == field and "--engine-process" in error["message"], body

        # a stream in flight when the core dies ends with an error event and [DONE], not a hang
        req = urllib.request.Request(
            server.url + "/v1/completions",
            json.dumps(
                {"prompt": "Once upon a time", "max_tokens": 4000, "ignore_eos": True, "stream": True}
            ).encode(),
            {"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=60) as stream:
            assert stream.readline().startswith(b"data: ")  # the first token arrived: the request runs
            os.kill(core, signal.SIGKILL)
            events = [line[6:].strip() for line in stream.read().split(b"\n") if line.startswith(b"data: ")]
        assert events[-1] == b"[DONE]"
        assert json.loads(events[-2])["error"]["code"] == "engine_dead"

        started = time.monotonic()
        status, body = _post(server.url, {"prompt": "Hello again", "max_tokens": 3}, timeout=30)
        assert status == 500 and json.loads(body)["error"]["code"] == "engine_dead"
        assert time.monotonic() - started < 10
        try:
            urllib.request.urlopen(server.url + "/health", timeout=10)
            raise AssertionError("/health answered 200 with a dead engine core")
        except urllib.error.HTTPError as exc:
            assert exc.code == 500

    with running_server("--engine-process") as server:
        core = _core_pid(server)
        assert server.stop(signal.SIGTERM) == 0
        assert _wait_gone(core, 10), "the engine core outlived the server's SIGTERM"


def test_a_killed_server_takes_its_core_with_it():
    with running_server("--engine-process") as server:
        core = _core_pid(server)
        server.proc.kill()
        server.proc.wait()
        assert _wait_gone(core, 10), "the engine core outlived its server (SIGKILL)"


def test_a_core_that_cannot_load_is_a_startup_error():
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "server",
            "--model",
            "/nonexistent/model.gguf",
            "--port",
            "1",
            "--engine-process",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert "model" in proc.stderr and "Traceback" not in proc.stderr
