"""POST /tokenize honours add_special_tokens, as vLLM's does: the tokenizer's BOS in front when true
(default for a prompt), none when false (default for messages, whose chat template writes its own).

SmolLM2 adds no BOS, so the check runs on the tiny model's directory (SmolLM2's tokenizer, random weights:
only the tokenizer matters here) with a BOS and add_bos_token in its tokenizer_config, and on SmolLM2 that
both settings give the same tokens."""

from __future__ import annotations

import json

import pytest

from tests.server.conftest import running_server, write_tiny_smollm2
from tests.server.test_bad_inputs import call

pytestmark = pytest.mark.slow

BOS = 0  # <|endoftext|>; SmolLM2 gives id 1 to <|im_start|>, with which its chat template opens
MSG = [{"role": "user", "content": "Hi there"}]


@pytest.fixture(scope="module")
def bos_model_dir(tmp_path_factory):
    """The tiny model (SmolLM2's tokenizer, random weights), its BOS set to <|endoftext|> and added."""
    path = write_tiny_smollm2(tmp_path_factory.mktemp("bos-llama"))
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "bos_token_id": BOS}))
    settings = json.loads((path / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(json.dumps({**settings, "add_bos_token": True}))
    return path


def _tokens(url: str, body: dict) -> list[int]:
    status, payload, _ = call(url, "POST", "/tokenize", body)
    assert status == 200, payload
    return payload["tokens"]


def test_add_special_tokens_puts_the_bos_in_front_or_not(bos_model_dir):
    with running_server("--model", str(bos_model_dir), kv_cache="16MiB") as server:
        plain = _tokens(server.url, {"prompt": "Hello world", "add_special_tokens": False})
        assert plain and plain[0] != BOS
        assert _tokens(server.url, {"prompt": "Hello world"}) == [BOS, *plain]  # default: true
        assert _tokens(server.url, {"prompt": "Hello world", "add_special_tokens": True}) == [BOS, *plain]

        chat = _tokens(server.url, {"messages": MSG})  # default: false, the template's own tokens
        assert chat[0] != BOS and chat == _tokens(server.url, {"messages": MSG, "add_special_tokens": False})
        assert _tokens(server.url, {"messages": MSG, "add_special_tokens": True}) == [BOS, *chat]


def test_a_model_without_bos_gives_the_same_tokens_either_way(server):
    for body in ({"prompt": "Hello world"}, {"messages": MSG}):
        assert _tokens(server.url, {**body, "add_special_tokens": True}) == _tokens(
            server.url, {**body, "add_special_tokens": False}
        )
