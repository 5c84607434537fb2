"""GET /v1/models, /v1/models/{model}, /health, /metrics, /version and POST /tokenize, /detokenize."""

from __future__ import annotations

import asyncio
import importlib.metadata
from functools import partial

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from server.auth import authenticate, check_key
from server.errors import APIError, bad_request
from server.openai_api import OFF_LOOP_CHARS
from server.protocol import parse_messages
from server.request_fields import DETOKENIZE, TOKENIZE
from server.state import ServerState, read_json


def _model_card(state: ServerState) -> dict:
    return {
        "id": state.model_name,
        "object": "model",
        "created": int(state.started),
        "owned_by": "prescient",
        "max_model_len": state.client.max_model_len,
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
    template writes its own), as vLLM's /tokenize."""
    state: ServerState = request.app["state"]
    authenticate(state.api_keys, request.headers.get("Authorization"), None)
    v = TOKENIZE.read(await read_json(request))
    tok = state.client.tokenizer
    if v["messages"] is not None:
        messages = parse_messages(v["messages"])
        work = partial(_encode_chat, tok, messages, v["add_generation_prompt"], v["add_special_tokens"])
    elif v["prompt"] is not None:
        add = True if v["add_special_tokens"] is None else v["add_special_tokens"]
        work = partial(tok.encode, v["prompt"], add_special_tokens=add)
    else:
        raise bad_request(
            "send 'prompt' (a string) or 'messages' (an array of {role, content})",
            "prompt",
            "missing_required_parameter",
        )
    try:  # a big body is tokenized on a worker thread, as for generation
        tokens = (
            await asyncio.get_running_loop().run_in_executor(None, work)
            if (request.content_length or 0) > OFF_LOOP_CHARS
            else work()
        )
    except ValueError as exc:
        raise bad_request(str(exc), "messages") from exc
    return web.json_response(
        {"tokens": tokens, "count": len(tokens), "max_model_len": state.client.max_model_len}
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
    state: ServerState = request.app["state"]
    authenticate(state.api_keys, request.headers.get("Authorization"), None)
    tokens = DETOKENIZE.read(await read_json(request))["tokens"]
    vocab = state.client.vocab_size
    bad = [t for t in tokens if not 0 <= t < vocab]
    if bad:
        raise bad_request(f"'tokens' contains ids outside [0, {vocab}): {bad[:5]}", "tokens")
    return web.json_response({"prompt": state.client.tokenizer.decode(tokens)})


async def version(request: web.Request) -> web.Response:
    """The server's version (the installed package's), as vLLM's GET /version."""
    return web.json_response({"version": server_version()})


def server_version() -> str:
    try:
        return importlib.metadata.version("prescient-runtime")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree that is not installed
        return "0.0.0+unknown"
