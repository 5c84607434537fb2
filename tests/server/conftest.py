"""Real servers on loopback (`python -m server` subprocesses) and the offline engine as the oracle."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MODEL = "SmolLM2-135M-Instruct"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(
        self, *args: str, dtype: str = "float32", kv_cache: str = "256MiB", command: list[str] | None = None
    ):
        """command: what starts the server (default `python -m server`), before the flags."""
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"prescient-server-{self.port}.log")
        self.log = open(self.log_path, "w")
        cmd = [
            *(command or [sys.executable, "-m", "server"]),
            "--port",
            str(self.port),
            "--dtype",
            dtype,
            "--kv-cache-bytes",
            kv_cache,
            *args,
        ]
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.time() + 120
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.output()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=1) as r:
                    if r.status == 200:
                        return
            except OSError:
                time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"server did not become healthy:\n{self.output()}")

    def openai_client(self, api_key: str = "unused", **settings):
        """The official openai client on this server, without retries; settings as OpenAI takes."""
        import openai

        return openai.OpenAI(base_url=self.url + "/v1", api_key=api_key, max_retries=0, **settings)

    def async_openai_client(self, api_key: str = "unused", **settings):
        """The same as openai_client, asynchronous."""
        import openai

        return openai.AsyncOpenAI(base_url=self.url + "/v1", api_key=api_key, max_retries=0, **settings)

    def output(self) -> str:
        self.log.flush()
        with open(self.log_path) as f:
            return f.read()

    def metrics(self) -> dict[str, float]:
        """Samples of /metrics, parsed with prometheus_client's parser: {name{labels}: value}."""
        with urllib.request.urlopen(self.url + "/metrics", timeout=5) as r:
            text = r.read().decode()
        out = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k != "model_name")
                out[f"{s.name}{{{labels}}}"] = s.value
        return out

    def stop(self, sig=None) -> int:
        if self.proc.poll() is None:
            self.proc.terminate() if sig is None else self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        return self.proc.returncode


@contextlib.contextmanager
def running_server(*args: str, **kwargs):
    server = Server(*args, **kwargs)
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def server():
    with running_server("--throughput-log-seconds", "1") as s:
        yield s


@pytest.fixture(scope="session")
def offline_engine():
    from runtime import Engine

    return Engine.from_pretrained(dtype="float32", device="cpu", kv_cache_bytes=128 << 20)


@pytest.fixture
def client(server):
    return server.openai_client(timeout=120)


def wait_idle(server: Server, timeout: float = 30.0) -> dict[str, float]:
    """Metrics once nothing runs or waits (the engine's stats update after each step)."""
    deadline = time.time() + timeout
    while True:
        m = server.metrics()
        if (
            m["prescient:num_requests_running{}"] == 0 and m["prescient:num_requests_waiting{}"] == 0
        ) or time.time() > deadline:
            return m
        time.sleep(0.1)


API_KEY = "sk-apis-test"


@pytest.fixture(scope="session")
def apis_server():
    """One server with an API key, shared by the files that test the APIs beside chat (embeddings,
    Responses, Anthropic Messages, Ollama): a server start is the dearest part of those tests."""
    with running_server("--api-key", API_KEY) as s:
        yield s
