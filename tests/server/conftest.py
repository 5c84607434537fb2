"""Real servers on loopback (`python -m server` subprocesses) and the offline engine as the oracle."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

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
    Responses, Anthropic Messages, Ollama): a server start is the dearest part of those tests. It runs the
    packed default weights: those files compare its routes with each other, never with a float32 oracle."""
    with running_server("--api-key", API_KEY, dtype="auto") as s:
        yield s


TINY_SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)
"""The tiny model's widths; its vocabulary, context and special tokens are SmolLM2's."""


def write_tiny_smollm2(path: Path, seed: int = 0) -> Path:
    """A two-layer Llama with random weights and SmolLM2-135M-Instruct's tokenizer, chat template, vocabulary
    size and context (8,192), as a Hugging Face directory: for the tests of the HTTP layer (caps, auth,
    queues, process handling), where what the model computes is not the point and the real one's prefill of
    thousands of tokens would cost tens of seconds. Serve it with --served-model-name MODEL."""
    import numpy as np
    from safetensors.numpy import save_file

    from runtime.model.checkpoint import default_model_path
    from runtime.model.gguf_metadata import read_gguf_metadata
    from runtime.model.gguf_tokenizer import tokenizer_source
    from runtime.model.tokenizer import Tokenizer

    gguf = default_model_path()
    header = read_gguf_metadata(gguf)
    source = tokenizer_source(header, gguf)
    path.mkdir(parents=True, exist_ok=True)
    (path / "tokenizer.json").write_text(Tokenizer(source).tokenizer_json())
    (path / "tokenizer_config.json").write_text(json.dumps({"chat_template": source.chat_template}))
    vocab, hidden, inter = (
        header["llama.vocab_size"],
        TINY_SHAPE["hidden_size"],
        TINY_SHAPE["intermediate_size"],
    )
    heads, kv_heads = TINY_SHAPE["num_attention_heads"], 2
    head_dim = hidden // heads
    config = dict(
        architectures=["LlamaForCausalLM"],
        model_type="llama",
        vocab_size=vocab,
        **TINY_SHAPE,
        num_key_value_heads=kv_heads,
        max_position_embeddings=header["llama.context_length"],
        rope_theta=header["llama.rope.freq_base"],
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        bos_token_id=source.bos_token_id,
        eos_token_id=source.eos_token_id,
        hidden_act="silu",
    )
    (path / "config.json").write_text(json.dumps(config))
    rng = np.random.default_rng(seed)

    def w(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * 0.08).astype(np.float32)

    weights = {
        "model.embed_tokens.weight": w(vocab, hidden),
        "model.norm.weight": np.ones(hidden, np.float32),
    }
    for i in range(TINY_SHAPE["num_hidden_layers"]):
        layer = f"model.layers.{i}."
        weights |= {
            layer + "input_layernorm.weight": np.ones(hidden, np.float32),
            layer + "post_attention_layernorm.weight": np.ones(hidden, np.float32),
            layer + "self_attn.q_proj.weight": w(heads * head_dim, hidden),
            layer + "self_attn.k_proj.weight": w(kv_heads * head_dim, hidden),
            layer + "self_attn.v_proj.weight": w(kv_heads * head_dim, hidden),
            layer + "self_attn.o_proj.weight": w(hidden, heads * head_dim),
            layer + "mlp.gate_proj.weight": w(inter, hidden),
            layer + "mlp.up_proj.weight": w(inter, hidden),
            layer + "mlp.down_proj.weight": w(hidden, inter),
        }
    save_file(weights, str(path / "model.safetensors"))
    return path


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    """write_tiny_smollm2's directory, written once per worker."""
    return write_tiny_smollm2(tmp_path_factory.mktemp("tiny-smollm2"))


def tiny_server(model: Path, *args: str, **kwargs):
    """running_server on the tiny model (write_tiny_smollm2), served as MODEL."""
    return running_server("--model", str(model), "--served-model-name", MODEL, *args, dtype="auto", **kwargs)


@pytest.fixture(scope="session")
def tiny_shared_server(tiny_model):
    """The tiny model served once per worker, for the files that test the HTTP layer with the default
    settings (caps, every documented field, the event loop's stalls). --frontend-nice 0: test_loop_stalls
    times the front end's loop, which at nice 10 would wait behind every other process of a busy machine."""
    with tiny_server(tiny_model, "--frontend-nice", "0") as s:
        yield s
