"""Ollama's API: /api/chat, /api/generate, /api/embed, /api/tags, /api/show, /api/version.

Chat and generate are translated onto the chat path (server/openai/generation.py; /api/generate with `raw`,
or on a base model, which has no chat template, onto completions): options num_predict, temperature,
top_k, top_p, seed, stop, repeat_penalty and the penalties become SamplingParams (temperature, top_k and
top_p default to Ollama's 0.8, 40 and 0.9), and `format` ("json" or a JSON Schema) becomes structured
output. Replies stream as NDJSON, one object per line, by default, as Ollama does (`"stream": false` for
one object); a tool call goes out whole, in a message of its own, once its arguments are complete.
Embeddings are the same pooled hidden states as /v1/embeddings. Errors are Ollama's {"error": "..."}.
"""

from __future__ import annotations

import json
import time
from contextlib import aclosing
from dataclasses import replace
from datetime import datetime, timezone

from aiohttp import web

from server.auth import Tenant, check_key, user_tenant
from server.engine_errors import engine_failure
from server.errors import APIError, bad_request
from server.openai.embeddings_api import embed, prepare_inputs
from server.openai.generation import Generation, Prepared, check_grammar, check_model, prepare, renamed
from server.openai.utility_api import server_version
from server.schema.compat_fields import OLLAMA_CHAT, OLLAMA_EMBED, OLLAMA_GENERATE, OLLAMA_SHOW
from server.state import ServerState, off_loop, parse_json, read_body
from server.tools.tool_call_stream import CallEnd, Text, ToolCallStream
from server.tools.tool_calls import parses_tool_calls

DEFAULTS = {"temperature": 0.8, "top_k": 40, "top_p": 0.9}
"""Ollama's sampling defaults, where a request's options leave them out."""
NAMES = {
    "max_tokens": "options.num_predict",
    "max_completion_tokens": "options.num_predict",
    "repetition_penalty": "options.repeat_penalty",
    "stop": "options.stop",
    "response_format": "format",
    "response_format.json_schema": "format",
}
NDJSON = "application/x-ndjson"


async def chat(request: web.Request) -> web.StreamResponse:
    return await _serve(request, "chat")


async def generate(request: web.Request) -> web.StreamResponse:
    return await _serve(request, "generate")


async def _serve(request: web.Request, route: str) -> web.StreamResponse:
    state: ServerState = request.app["state"]
    state.check_accepting()
    keyed = check_key(state.api_keys, request.headers.get("Authorization"))
    raw = await read_body(request)
    v, prepared = await off_loop(len(raw), _prepare, state, raw, keyed, route)
    if prepared is None:  # /api/generate without a prompt: Ollama's way to load a model
        return web.json_response({**_head(state), "response": "", "done": True, "done_reason": "load"})
    await check_grammar(prepared)
    gen = Generation(request, state, prepared, "ollama-")
    tools = prepared.req.tools
    calls = ToolCallStream(tools) if route == "chat" and parses_tool_calls(tools) else None
    stream, sent, text, found = None, 0, "", []
    try:
        async with aclosing(gen.deltas()) as outputs:
            async for choice, _ in outputs:
                out = choice.out
                if calls is not None:
                    events = calls.feed(out.text, out.finished)
                else:
                    events, sent = ([Text(out.text[sent:])] if len(out.text) > sent else []), len(out.text)
                for event in events:
                    if isinstance(event, Text):
                        text += event.text
                        if v["stream"]:
                            stream = stream or await _open(request)
                            await _line(stream, _piece(state, route, event.text))
                    elif isinstance(event, CallEnd):
                        call = calls.calls[event.index]
                        found.append(_ollama_call(call))
                        if v["stream"]:
                            stream = stream or await _open(request)
                            await _line(stream, _piece(state, route, "", [found[-1]]))
    except ConnectionError:
        raise
    except Exception as exc:
        error = exc if isinstance(exc, APIError) else engine_failure(exc, gen.request_id)
        if stream is None:
            raise error from exc
        await _line(stream, {"error": error.message})
        await stream.write_eof()
        return stream
    out = gen.ordered[0].out
    last = _piece(state, route, "" if v["stream"] else text, None if v["stream"] else found or None)
    last.update(done=True, done_reason="length" if out.finish_reason == "length" else "stop", **_timings(out))
    if not v["stream"]:
        return web.json_response(last)
    stream = stream or await _open(request)
    await _line(stream, last)
    await stream.write_eof()
    return stream


def _prepare(
    state: ServerState, raw: bytes, keyed: Tenant | None, route: str
) -> tuple[dict, Prepared | None]:
    fields = OLLAMA_CHAT if route == "chat" else OLLAMA_GENERATE
    v = fields.read(parse_json(raw))
    _check_model(state, v["model"])
    tenant = keyed or user_tenant(state.api_keys, None)
    body = {"model": None, **_sampling(v["options"] or {}), "response_format": _format(v["format"])}
    if route == "chat":
        body["messages"] = [_chat_message(m) for m in v["messages"]]
        if v["tools"]:
            body["tools"] = v["tools"]
        chat = True
    elif not v["prompt"]:
        return v, None
    elif v["raw"] or not state.client.tokenizer.chat_template:
        # raw, or a base model (no chat template): the prompt as it is, as Ollama's own default template
        # ("{{ .Prompt }}") gives it; a base model's system prompt then has no place to go, and is refused
        # rather than dropped (raw asks for the prompt alone)
        if v["system"] and not v["raw"]:
            raise bad_request(
                "system: this model has no chat template (it is a base model), so a system prompt has no "
                "place to go; put its text at the start of the prompt",
                "system",
            )
        body["prompt"] = v["prompt"]
        chat = False
    else:
        system = [{"role": "system", "content": v["system"]}] if v["system"] else []
        body["messages"] = [*system, {"role": "user", "content": v["prompt"]}]
        chat = True
    try:
        prepared = prepare(state, body, tenant, chat)
    except APIError as exc:
        raise renamed(exc, {**NAMES, "messages": "messages" if route == "chat" else "prompt"}) from exc
    if not chat and body.get("max_tokens") is None:  # completions' default of 16 is not Ollama's
        prepared.req.params = replace(prepared.req.params, max_tokens=None)
        prepared.req.max_tokens_given = False
    return v, prepared


def _check_model(state: ServerState, model: str | None) -> None:
    """Ollama names carry a tag (`name:latest`); the served name with or without it is this model."""
    if model is not None and model.endswith(":latest"):
        model = model[: -len(":latest")]
    check_model(state, model)


def _sampling(options: dict) -> dict:
    num_predict = options.get("num_predict")
    if num_predict is not None and num_predict < -2 or num_predict == 0:
        raise bad_request(
            f"'options.num_predict' must be positive, or -1 (until the end) or -2 (fill the context); got "
            f"{num_predict}",
            "options.num_predict",
        )
    body = {k: options[k] if options.get(k) is not None else d for k, d in DEFAULTS.items()}
    body.update(
        max_tokens=num_predict if num_predict is not None and num_predict > 0 else None,
        seed=options.get("seed"),
        stop=options.get("stop") or None,
        repetition_penalty=options.get("repeat_penalty"),
        presence_penalty=options.get("presence_penalty"),
        frequency_penalty=options.get("frequency_penalty"),
    )
    return body


def _format(fmt) -> dict | None:
    if fmt in (None, ""):
        return None
    if fmt == "json":
        return {"type": "json_object"}
    return {"type": "json_schema", "json_schema": {"name": "format", "schema": fmt}}


def _chat_message(message: dict) -> dict:
    """An Ollama message as a chat message: tool_calls' arguments are objects there, JSON text here."""
    out = {"role": message["role"], "content": message.get("content") or ""}
    if message.get("tool_calls"):
        out["tool_calls"] = [
            {
                "id": f"call_{k}",
                "type": "function",
                "function": {
                    "name": call["function"]["name"],
                    "arguments": json.dumps(call["function"].get("arguments") or {}),
                },
            }
            for k, call in enumerate(message["tool_calls"])
        ]
    return out


def _ollama_call(call: dict) -> dict:
    try:
        arguments = json.loads(call["arguments"] or "{}")
    except ValueError:  # cut off by num_predict
        arguments = {}
    return {"function": {"name": call["name"], "arguments": arguments}}


def _head(state: ServerState) -> dict:
    now = datetime.now(timezone.utc).isoformat().replace("+00:00", "Z")
    return {"model": state.model_name, "created_at": now}


def _piece(state: ServerState, route: str, text: str, calls: list[dict] | None = None) -> dict:
    if route == "generate":
        return {**_head(state), "response": text, "done": False}
    message = {"role": "assistant", "content": text}
    if calls:
        message["tool_calls"] = calls
    return {**_head(state), "message": message, "done": False}


def _timings(out) -> dict:
    """Ollama's counts and durations (nanoseconds) from the sequence's times."""
    ns = 1e9
    end = out.finished_time or time.monotonic()
    first = out.first_token_time or end
    return {
        "total_duration": int((end - out.arrival_time) * ns),
        "load_duration": 0,
        "prompt_eval_count": len(out.prompt_token_ids),
        "prompt_eval_duration": int((first - out.arrival_time) * ns),
        "eval_count": len(out.token_ids),
        "eval_duration": int((end - first) * ns),
    }


async def _open(request: web.Request) -> web.StreamResponse:
    response = web.StreamResponse(status=200, headers={"Content-Type": NDJSON, "Cache-Control": "no-cache"})
    await response.prepare(request)
    return response


async def _line(stream: web.StreamResponse, payload: dict) -> None:
    await stream.write(json.dumps(payload, separators=(",", ":")).encode() + b"\n")


async def embed_route(request: web.Request) -> web.Response:
    """POST /api/embed: {"embeddings": [[...], ...]}, inputs longer than the context cut to it unless
    truncate is false."""
    state: ServerState = request.app["state"]
    state.check_accepting()
    keyed = check_key(state.api_keys, request.headers.get("Authorization"))
    raw = await read_body(request)
    started = time.monotonic()
    prepared = await off_loop(len(raw), _prepare_embed, state, raw, keyed)
    vectors = await embed(request, state, prepared)
    return web.json_response(
        {
            "model": state.model_name,
            "embeddings": vectors,
            "total_duration": int((time.monotonic() - started) * 1e9),
            "load_duration": 0,
            "prompt_eval_count": sum(len(ids) for ids in prepared.prompt_ids),
        }
    )


def _prepare_embed(state: ServerState, raw: bytes, keyed: Tenant | None) -> Prepared:
    v = OLLAMA_EMBED.read(parse_json(raw))
    _check_model(state, v["model"])
    hidden = state.client.model_card.get("hidden_size")
    if v["dimensions"] is not None and v["dimensions"] != hidden:
        raise bad_request(
            f"'dimensions' must be this model's {hidden} (vectors are not shortened)", "dimensions"
        )
    tenant = keyed or user_tenant(state.api_keys, None)
    return prepare_inputs(state, v["input"], v["pooling"], tenant, "input", truncate=v["truncate"])


def _details(state: ServerState) -> dict:
    card = state.client.model_card
    return {
        "parent_model": "",
        "format": "gguf",
        "family": card.get("architecture", "llama"),
        "families": [card.get("architecture", "llama")],
        "parameter_size": "",
        "quantization_level": str(card.get("quantization", "")),
    }


async def tags(request: web.Request) -> web.Response:
    state: ServerState = request.app["state"]
    check_key(state.api_keys, request.headers.get("Authorization"))
    model = {
        "name": state.model_name,
        "model": state.model_name,
        "modified_at": datetime.fromtimestamp(state.started, timezone.utc).isoformat(),
        "size": 0,
        "digest": "",
        "details": _details(state),
    }
    return web.json_response({"models": [model]})


async def show(request: web.Request) -> web.Response:
    state: ServerState = request.app["state"]
    check_key(state.api_keys, request.headers.get("Authorization"))
    v = OLLAMA_SHOW.read(await _body(request))
    model = v["model"] or v["name"]
    if model is None:
        raise bad_request("'model' is required", "model", "missing_required_parameter")
    _check_model(state, model)
    card = state.client.model_card
    arch = card.get("architecture", "llama")
    return web.json_response(
        {
            "modelfile": f"FROM {state.model_name}\n",
            "parameters": "\n".join(f"{k} {v}" for k, v in DEFAULTS.items()),
            "template": "",
            "details": _details(state),
            "model_info": {
                "general.architecture": arch,
                f"{arch}.context_length": state.client.max_model_len,
                f"{arch}.embedding_length": card.get("hidden_size"),
            },
            "capabilities": ["completion", "tools", "embedding"],
            "modified_at": datetime.fromtimestamp(state.started, timezone.utc).isoformat(),
        }
    )


async def _body(request: web.Request) -> dict:
    raw = await read_body(request)
    return parse_json(raw)


async def version(request: web.Request) -> web.Response:
    """The server's version (Ollama clients only show it)."""
    return web.json_response({"version": server_version()})
