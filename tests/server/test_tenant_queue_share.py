"""Each tenant has its share of the waiting queue: one caller flooding it gets the 429s, not another tenant.

A real server on loopback with `--max-waiting 4 --max-num-seqs 2`, keyed tenants beside plain-key callers,
on the tiny model (SmolLM2's tokenizer, random weights): the queue is the point, and its steps are cheap.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request

import pytest

from tests.server.conftest import tiny_server

pytestmark = pytest.mark.slow  # starts a server

KEYS = {"sk-keyed": {"tenant": "keyed"}}


def post(url: str, body: dict, key: str) -> tuple[int, dict]:
    headers = {"Content-Type": "application/json", "Authorization": f"Bearer {key}"}
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(), headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=300) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_a_plain_key_batch_filling_the_queue_does_not_429_a_keyed_tenant(tmp_path, tiny_model):
    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps(KEYS))
    flags = ["--api-keys", str(keys), "--api-key", "sk-plain", "--max-waiting", "4", "--max-num-seqs", "2"]
    with tiny_server(tiny_model, *flags) as server:
        batch: dict = {}
        body = {"prompt": [f"Story {i}:" for i in range(6)], "max_tokens": 150, "ignore_eos": True}
        flood = threading.Thread(target=lambda: batch.update(result=post(server.url, body, "sk-plain")))
        flood.start()
        deadline = time.monotonic() + 60
        while server.metrics()["prescient:num_requests_waiting{}"] < 4:  # the batch fills the queue
            assert time.monotonic() < deadline and flood.is_alive(), batch
            time.sleep(0.02)
        code, reply = post(server.url, {"prompt": "Hello", "max_tokens": 4, "ignore_eos": True}, "sk-keyed")
        assert code == 200, reply
        assert reply["usage"]["completion_tokens"] == 4
        flood.join(timeout=300)
        assert batch["result"][0] == 200, batch  # its own 6 fit: 2 running + its 4 waiting
