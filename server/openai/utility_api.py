"""GET /v1/models, /v1/models/{model}, /health, /metrics, /version and POST /tokenize, /detokenize."""

from __future__ import annotations

import importlib.metadata
import json

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from server.auth import authenticate, check_key
from server.errors import APIError, bad_request
from server.openai.protocol import parse_messages
from server.schema.request_fields import DETOKENIZE, TOKENIZE
from server.state import ServerState, off_loop, parse_json, read_body

JSON = "application/json"


def _model_card(state: ServerState) -> dict:
    return {
        "id": state.model_name,
        "object": "model",
        "created": int(state.started),
        "owned_by": "prescient",
        "max_model_len": state.client.max_model_len,
        **state.client.model_card,  # architecture, quantization, context_length (the file's)
    }


async def models(request: web.Request) -> web.Response:
    state: ServerState = request.app["state"]
    authenticate(state.api_keys, request.headers.get("Authorization"), None)
    return web.json_response({"object": "list", "data": [_model_card(state)]})


async def model(request: web.Request) -> web.Response:
    state: ServerState = request.app["state"]
    authenticate(state.api_keys, request.headers.get("Authorization"), None)
    name = request.match_info["model"]
    if name not in state.model_names:
        raise APIError(
            404,
            f"The model '{name}' does not exist; this server serves '{state.model_name}'.",
            param="model",
            code="model_not_found",
        )
    return web.json_response(_model_card(state))


async def health(request: web.Request) -> web.Response:
    state: ServerState = request.app["state"]
    try:
        state.client.check_health()
    except Exception:  # the cause is in the server log, not for every caller to read
        return web.json_response({"status": "unhealthy"}, status=500)
    if state.draining:
        return web.json_response({"status": "draining"}, status=503)
    return web.json_response({"status": "ok"})


async def metrics(request: web.Request) -> web.Response:
    state: ServerState = request.app["state"]
    if state.metrics_auth:
        check_key(state.api_keys, request.headers.get("Authorization"))
    return web.Response(
        body=generate_latest(state.metrics.registry), headers={"Content-Type": CONTENT_TYPE_LATEST}
    )


async def tokenize(request: web.Request) -> web.Response:
    """{"prompt": str} or {"messages": [...]} -> {"tokens": [...], "count": n, "max_model_len": L}.
    add_special_tokens: the tokenizer's BOS (default true for a prompt, false for messages, whose chat
    template writes its own), as vLLM's /tokenize. A big body is read and tokenized off the loop."""
    state: ServerState = request.app["state"]
    authenticate(state.api_keys, request.headers.get("Authorization"), None)
    raw = await read_body(request)
    return web.Response(body=await off_loop(len(raw), _tokenize_reply, state, raw), content_type=JSON)


def _tokenize_reply(state: ServerState, raw: bytes) -> bytes:
    tokens = _tokenize(state, raw)
    reply = {"tokens": tokens, "count": len(tokens), "max_model_len": state.client.max_model_len}
    return json.dumps(reply).encode()


def _tokenize(state: ServerState, raw: bytes) -> list[int]:
    v = TOKENIZE.read(parse_json(raw))
    tok = state.client.tokenizer
    try:
        if v["messages"] is not None:
            messages = parse_messages(v["messages"])
            return _encode_chat(tok, messages, v["add_generation_prompt"], v["add_special_tokens"])
        if v["prompt"] is not None:
            add = True if v["add_special_tokens"] is None else v["add_special_tokens"]
            return tok.encode(v["prompt"], add_special_tokens=add)
    except ValueError as exc:
        raise bad_request(str(exc), "messages") from exc
    raise bad_request(
        "send 'prompt' (a string) or 'messages' (an array of {role, content})",
        "prompt",
        "missing_required_parameter",
    )


def _encode_chat(tok, messages: list[dict], add_generation_prompt: bool, add_special_tokens: bool | None):
    """The chat template's tokens; add_special_tokens true puts the tokenizer's BOS in front when the
    template did not already."""
    ids = tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=True)
    bos = tok.bos_token_id
    if add_special_tokens and tok.add_bos_token and bos is not None and ids[:1] != [bos]:
        ids = [bos, *ids]
    return ids


async def detokenize(request: web.Request) -> web.Response:
    """{"tokens": [...]} -> {"prompt": text}; a big body is read and decoded off the loop."""
    state: ServerState = request.app["state"]
    authenticate(state.api_keys, request.headers.get("Authorization"), None)
    raw = await read_body(request)
    return web.Response(body=await off_loop(len(raw), _detokenize, state, raw), content_type=JSON)


def _detokenize(state: ServerState, raw: bytes) -> bytes:
    tokens = DETOKENIZE.read(parse_json(raw))["tokens"]
    vocab = state.client.vocab_size
    if tokens and (min(tokens) < 0 or max(tokens) >= vocab):
        bad = [t for t in tokens if not 0 <= t < vocab]
        raise bad_request(f"'tokens' contains ids outside [0, {vocab}): {bad[:5]}", "tokens")
    return json.dumps({"prompt": state.client.tokenizer.decode(tokens)}).encode()


async def version(request: web.Request) -> web.Response:
    """The server's version (the installed package's), as vLLM's GET /version."""
    return web.json_response({"version": server_version()})


def server_version() -> str:
    try:
        return importlib.metadata.version("prescient-runtime")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree that is not installed
        return "0.0.0+unknown"
