"""Over HTTP, a request that cannot fit is a 400 whose envelope names the field in `param`, and the
largest max_tokens the server says fits is admitted."""

from __future__ import annotations

import json
import re
import urllib.request

from tests.server.test_bad_inputs import COMP, call

PROMPT = list(range(100, 110))


def admitted(url: str, max_tokens: int) -> bool:
    """Stream the request and leave after its first chunk (the abort frees its blocks)."""
    body = json.dumps({"prompt": PROMPT, "max_tokens": max_tokens, "stream": True, "ignore_eos": True})
    req = urllib.request.Request(url + COMP, data=body.encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status == 200 and r.readline().startswith(b"data: ")
    except urllib.error.HTTPError as e:
        assert e.code == 400, e.read()
        return False


def test_one_token_past_the_boundary_names_max_tokens(server):
    code, payload, _ = call(server.url, "POST", COMP, {"prompt": PROMPT, "max_tokens": 10**6})
    assert code == 400 and payload["error"]["param"] == "max_tokens", payload
    largest = int(re.search(r"at most (\d+)", payload["error"]["message"]).group(1))
    assert admitted(server.url, largest)
    code, payload, _ = call(server.url, "POST", COMP, {"prompt": PROMPT, "max_tokens": largest + 1})
    assert code == 400 and payload["error"]["param"] == "max_tokens", payload


def test_prompt_beyond_the_context_names_prompt(server):
    code, payload, _ = call(server.url, "GET", "/v1/models", None)
    context = payload["data"][0]["max_model_len"]
    code, payload, _ = call(server.url, "POST", COMP, {"prompt": [100] * context})
    assert code == 400 and payload["error"]["param"] == "prompt", payload


def test_models_reports_the_architecture_quantization_and_context_of_the_file(server):
    """Against the GGUF header as gguf-py reads it: the default SmolLM2 file is a Llama-architecture
    Q4_1 (mostly) file."""
    import gguf

    from runtime.model.checkpoint import default_model_path

    reader = gguf.GGUFReader(str(default_model_path()))
    meta = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("tokenizer.")}
    code, payload, _ = call(server.url, "GET", "/v1/models", None)
    card = payload["data"][0]
    assert code == 200 and card["architecture"] == meta["general.architecture"] == "llama", card
    assert card["context_length"] == meta["llama.context_length"], card
    assert card["quantization"] == "Q4_1" and meta["general.file_type"] == gguf.LlamaFileType.MOSTLY_Q4_1, (
        card
    )
