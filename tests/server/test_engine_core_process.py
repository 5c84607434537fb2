"""The engine core in its own process (the server's default): it serves n, best_of, logprobs and echo as
the engine thread does; a dead core is an error to every client, never a hang; no orphan cores.

Everything is real: `python -m server` on loopback, its core process, signals. The servers that are killed
run the tiny model (SmolLM2's tokenizer, random weights): what they generate is not the point.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import pytest

from tests.processes import children, wait_gone
from tests.server.conftest import MODEL, ROOT, running_server, tiny_server

pytestmark = pytest.mark.slow  # real servers


def _core_pid(server) -> int:
    """The core process: the server's child that runs the engine (its command line says spawn_main)."""
    for child in children(server.proc.pid):
        with open(f"/proc/{child}/cmdline", "rb") as f:
            if b"spawn_main" in f.read():
                return child
    raise AssertionError(f"no engine core process under the server:\n{server.output()}")


def _read(
    url: str, body: dict, started: threading.Event | None = None, timeout: float = 60
) -> tuple[int, list[bytes]]:
    """POST and read the whole answer: (status, SSE data lines, or the body as the one line)."""
    req = urllib.request.Request(
        url + "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            if not body.get("stream"):
                return r.status, [r.read()]
            lines = []
            for line in r:
                if line.startswith(b"data: "):
                    lines.append(line[6:].strip())
                    if started is not None:
                        started.set()
            return r.status, lines
    except urllib.error.HTTPError as exc:
        return exc.code, [exc.read()]


def _post(url: str, body: dict, timeout: float = 60) -> tuple[int, bytes]:
    """POST a request that does not stream: (status, body)."""
    status, (payload,) = _read(url, body, timeout=timeout)
    return status, payload


def _assert_unhealthy(url: str) -> None:
    try:
        urllib.request.urlopen(url + "/health", timeout=10)
        raise AssertionError("/health answered 200 with a dead engine core")
    except urllib.error.HTTPError as exc:
        assert exc.code == 500


def _same_logprobs(a: list, b: list) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert (x is None) == (y is None) and (x is None or abs(x - y) < 1e-4), (a, b)


def test_n_best_of_logprobs_and_echo_match_the_engine_thread(server):
    """The same requests to an engine-thread server (--no-engine-process) and through a core process (the
    session's server: the default): the same choices, the same logprobs; the sequences' forks and logprobs
    cross the process boundary."""
    with running_server("--no-engine-process") as thread_server:
        assert not children(thread_server.proc.pid), "--no-engine-process started a process"
        assert _core_pid(server)  # the default runs a core process
        thread, core = (s.openai_client(timeout=120) for s in (thread_server, server))
        asks = [
            dict(prompt="My favourite fruit is", max_tokens=6, temperature=1.0, seed=7, n=3, logprobs=2),
            dict(prompt="My favourite fruit is", max_tokens=5, temperature=1.0, seed=21, best_of=3),
            dict(prompt="Paris is the capital of France.", max_tokens=0, echo=True, logprobs=1),
        ]
        for ask in asks:
            want, got = (c.completions.create(model=MODEL, **ask) for c in (thread, core))
            assert [(c.index, c.text, c.finish_reason) for c in got.choices] == [
                (c.index, c.text, c.finish_reason) for c in want.choices
            ], ask
            assert got.usage == want.usage
            for w, g in zip(want.choices, got.choices):
                assert (w.logprobs is None) == (g.logprobs is None)
                if w.logprobs is not None:
                    assert (
                        g.logprobs.tokens == w.logprobs.tokens
                        and g.logprobs.text_offset == w.logprobs.text_offset
                    )
                    _same_logprobs(g.logprobs.token_logprobs, w.logprobs.token_logprobs)

        def chat(client) -> tuple[list[str], list[list[float]]]:
            stream = client.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": "Name a fruit."}],
                max_tokens=6,
                temperature=1.0,
                seed=3,
                n=2,
                logprobs=True,
                top_logprobs=2,
                stream=True,
            )
            texts, scores = ["", ""], [[], []]
            for chunk in stream:
                for c in chunk.choices:
                    texts[c.index] += c.delta.content or ""
                    scores[c.index] += [t.logprob for t in (c.logprobs.content if c.logprobs else [])]
            return texts, scores

        (want_texts, want_scores), (got_texts, got_scores) = chat(thread), chat(core)
        assert got_texts == want_texts and all(got_texts)
        for w, g in zip(want_scores, got_scores):
            _same_logprobs(g, w)


def _code(payload: bytes) -> str:
    return json.loads(payload)["error"]["code"]


def test_a_killed_core_fails_every_client_fast(tiny_model):
    """Item 6 with the core process: requests through the core first work (batched prompts, logit_bias,
    min_tokens, n > 1 with logprobs and echo). Then SIGKILL of the real core with two streams running, more
    requests waiting behind them and more arriving in the instant after: each gets engine_dead within
    seconds, later requests fail fast, /health turns unhealthy, and nothing stays in flight (the drain at
    SIGTERM finds 0 requests)."""
    with tiny_server(tiny_model, "--engine-process", "--max-num-seqs", "2") as server:
        core = _core_pid(server)
        status, body = _post(server.url, {"prompt": "Hello", "max_tokens": 3, "ignore_eos": True})
        assert status == 200 and json.loads(body)["usage"]["completion_tokens"] == 3

        # through the core: batched prompts, logit_bias and min_tokens work
        status, body = _post(
            server.url,
            {"prompt": ["Hello", [1, 2, 3]], "max_tokens": 2, "min_tokens": 2, "logit_bias": {"0": -100}},
        )
        assert status == 200 and [c["index"] for c in json.loads(body)["choices"]] == [0, 1]
        # the core hands over the thread engine's deltas: n > 1, logprobs and echo come through it too
        request = {
            "prompt": "Hello",
            "max_tokens": 3,
            "n": 2,
            "logprobs": 1,
            "echo": True,
            "ignore_eos": True,
        }
        status, body = _post(server.url, request)
        assert status == 200, body
        for choice in json.loads(body)["choices"]:
            assert choice["text"].startswith("Hello") and len(choice["logprobs"]["tokens"]) == 1 + 3

        long = {"prompt": "Once upon a time", "max_tokens": 4000, "ignore_eos": True}
        started = [threading.Event(), threading.Event()]
        with concurrent.futures.ThreadPoolExecutor(16) as pool:
            streams = [pool.submit(_read, server.url, {**long, "stream": True}, e) for e in started]
            assert all(e.wait(60) for e in started), server.output()  # both streams are running...
            waiting = [pool.submit(_read, server.url, long) for _ in range(3)]
            deadline = time.time() + 30
            while server.metrics()["prescient:num_requests_waiting{}"] < 3 and time.time() < deadline:
                time.sleep(0.05)  # ...and three more wait behind them
            killed = time.monotonic()
            os.kill(core, signal.SIGKILL)
            late = [pool.submit(_read, server.url, {**long, "stream": i % 2 == 0}) for i in range(8)]
            for future in streams:  # a stream in flight ends with an error event and [DONE], not a hang
                status, events = future.result(timeout=30)
                assert status == 200 and events[-1] == b"[DONE]" and _code(events[-2]) == "engine_dead"
            for future in waiting:
                status, (body,) = future.result(timeout=30)
                assert status == 500 and _code(body) == "engine_dead", body
            for future in late:  # refused before any stream opens, or the stream ends with the error
                status, lines = future.result(timeout=30)
                assert (status == 500 and _code(lines[0]) == "engine_dead") or (
                    status == 200 and lines[-1] == b"[DONE]" and _code(lines[-2]) == "engine_dead"
                ), (status, lines)
            assert time.monotonic() - killed < 30

        started = time.monotonic()
        status, body = _post(server.url, {"prompt": "Hello again", "max_tokens": 3}, timeout=30)
        assert status == 500 and json.loads(body)["error"]["code"] == "engine_dead"
        assert time.monotonic() - started < 10
        _assert_unhealthy(server.url)
        assert server.stop(signal.SIGTERM) == 0
        with open(server.log_path) as f:
            output = f.read()
        assert "draining: 0 requests in flight" in output, output


def test_a_killed_server_takes_its_core_with_it(tiny_model):
    with tiny_server(tiny_model, "--engine-process") as server:
        core = _core_pid(server)
        server.proc.kill()
        server.proc.wait()
        assert wait_gone([core], 10) == [], "the engine core outlived its server (SIGKILL)"


def _startup_error(*flags: str) -> str:
    """`python -m server FLAGS` must exit 2 without a traceback; returns what it printed on stderr."""
    proc = subprocess.run(
        [sys.executable, "-m", "server", *flags], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    return proc.stderr


def test_a_core_that_cannot_load_is_a_startup_error():
    assert "model" in _startup_error("--model", "/nonexistent/model.gguf", "--port", "1", "--engine-process")


def _nice(pid: int, tid: int) -> int:
    with open(f"/proc/{pid}/task/{tid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[16])  # field 19 of stat: nice


def _thread_nices(pid: int) -> set[int]:
    return {_nice(pid, int(tid)) for tid in os.listdir(f"/proc/{pid}/task")}


def test_the_front_end_runs_nicer_than_its_core(server):
    """Every thread of the server process at nice 10 (the default --frontend-nice), the core's at the nice
    it was started with; requests are served as before."""
    started_at = os.getpriority(os.PRIO_PROCESS, 0)
    status, body = _post(server.url, {"model": MODEL, "prompt": "Hello", "max_tokens": 3})
    assert status == 200, body
    assert _thread_nices(server.proc.pid) == {max(10, started_at)}
    assert _thread_nices(_core_pid(server)) == {started_at}


def test_frontend_nice_zero_keeps_one_priority_then_sigterm_leaves_no_orphan_core(tiny_model):
    """--frontend-nice 0: the front end and the core at the nice they were started with; a bad value is a
    startup error. SIGTERM of the server: it exits 0, and its core with it."""
    started_at = os.getpriority(os.PRIO_PROCESS, 0)
    with tiny_server(tiny_model, "--engine-process", "--frontend-nice", "0") as server:
        status, body = _post(server.url, {"model": MODEL, "prompt": "Hello", "max_tokens": 3})
        assert status == 200, body
        assert _thread_nices(server.proc.pid) == {started_at}
        core = _core_pid(server)
        assert _thread_nices(core) == {started_at}
        assert server.stop(signal.SIGTERM) == 0
        assert wait_gone([core], 10) == [], "the engine core outlived the server's SIGTERM"
    assert "--frontend-nice" in _startup_error("--frontend-nice", "25", "--port", "1")
