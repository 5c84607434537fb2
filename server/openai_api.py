"""POST /v1/completions and /v1/chat/completions, streaming or not.

The handler validates, hands the request to the engine client, and relays
outputs as they arrive: whole (server/choices.py) or as SSE chunks
(server/stream_chunks.py). If the client goes away, the handler is cancelled (or
its write fails) and leaving the `async for` aborts the request in the
engine at once, which frees its KV blocks.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from contextlib import aclosing

from aiohttp import web

from runtime import QueueFullError, RequestFailedError
from scheduler import InvalidRequestError
from server import sse
from server.auth import Tenant, authenticate, check_key
from server.choices import Choice, assemble, best, decode_prompt, final_choice, usage
from server.engine_errors import engine_failure
from server.errors import APIError, bad_request
from server.protocol import GenerationRequest, parse_chat, parse_completion
from server.state import ServerState, read_json
from server.stream_chunks import send_delta
from server.stream_merge import merge


async def completions(request: web.Request) -> web.StreamResponse:
    state: ServerState = request.app["state"]
    state.check_accepting()
    keyed = check_key(state.api_keys, request.headers.get("Authorization"))  # before any work on the body
    body = await read_json(request)
    req = parse_completion(body)
    return await _generate(request, state, req, keyed, None)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    state: ServerState = request.app["state"]
    state.check_accepting()
    keyed = check_key(state.api_keys, request.headers.get("Authorization"))
    body = await read_json(request)
    req, messages = parse_chat(body)
    return await _generate(request, state, req, keyed, messages)


OFF_LOOP_CHARS = 16_384
"""Prompts longer than this (characters of text) are rendered and tokenized on a worker thread, so a big
body never stalls the event loop (other streams, /health) while it is tokenized."""


def _prompt_ids(state: ServerState, req: GenerationRequest, messages: list[dict] | None) -> list[list[int]]:
    """Render (chat) and tokenize each prompt; whether it fits is the engine client's admission rule."""
    tokenizer = state.client.tokenizer
    if messages is not None:
        try:
            tools = req.tools.tools if req.tools is not None else None
            req.prompt = tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=True, tools=tools
            )
        except ValueError as exc:
            raise InvalidRequestError("messages", str(exc)) from exc
        req.prompts = [req.prompt]
    return [tokenizer.encode(p) if isinstance(p, str) else p for p in req.prompts]


async def _generate(
    request: web.Request,
    state: ServerState,
    req: GenerationRequest,
    keyed: Tenant | None,
    messages: list[dict] | None,
):
    chat = messages is not None
    tenant = keyed or authenticate(None, None, req.user)
    if req.model is not None and req.model not in state.model_names:
        raise APIError(
            404,
            f"The model '{req.model}' does not exist; this server serves "
            f"{', '.join(repr(n) for n in sorted(state.model_names))} (see GET /v1/models).",
            param="model",
            code="model_not_found",
        )
    low, high = tenant.priority_range
    if not low <= req.priority <= high:
        raise bad_request(
            f"'priority' must be in [{low}, {high}] for this caller (lower runs first; a client "
            f"may only make its own requests less urgent unless its key grants more)",
            "priority",
        )
    size = (
        sum(len(m["content"]) for m in messages)
        if chat
        else sum(len(p) for p in req.prompts if isinstance(p, str))
    )
    try:
        if size > OFF_LOOP_CHARS:
            checked = await asyncio.get_running_loop().run_in_executor(
                None, _prompt_ids, state, req, messages
            )
        else:
            checked = _prompt_ids(state, req, messages)
    except InvalidRequestError as exc:
        raise bad_request(str(exc), exc.param, exc.code) from exc
    tokenizer = state.client.tokenizer

    kind = "chat.completion" if chat else "text_completion"
    request_id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
    created = int(time.time())
    model = state.model_name
    width = req.best_of
    choices: dict[tuple[int, int], Choice] = {}
    for i, ids in enumerate(checked):
        prompt = req.prompts[i]
        text = prompt if isinstance(prompt, str) else decode_prompt(tokenizer, ids, i) if req.echo else ""
        for j in range(width):
            choices[i, j] = Choice(i * width + j, ids, text, echo_only=req.echo_only)
    stream = None
    try:
        # The engine client admits each prompt (one rule: InvalidRequestError names the field); a
        # max_tokens the client did not send is a default, lowered to what fits rather than refused.
        sources = [
            state.client.generate(
                ids,
                req.params,
                f"{request_id}-{i}",
                tenant=tenant.name,
                weight=tenant.weight,
                priority=req.priority,
                clamp_max_tokens=not req.max_tokens_given,
                cache_salt=tenant.cache_salt,
            )
            for i, ids in enumerate(checked)
        ]
        async with aclosing(merge(sources)) as outputs:
            async for i, delta in outputs:
                choice = assemble(choices[i, delta.index], delta)
                if not req.stream:
                    continue
                if stream is None:
                    stream = await sse.open_stream(request)
                await send_delta(stream, state, req, chat, request_id, created, model, choice, delta)
    except QueueFullError as exc:
        state.metrics.count_rejected("queue_full")
        raise APIError(
            429,
            f"The server is at capacity ({exc}); retry shortly.",
            code="rate_limit_exceeded",
            headers={"Retry-After": "1"},
        ) from exc
    except InvalidRequestError as exc:
        raise bad_request(str(exc), exc.param, exc.code) from exc
    except ValueError as exc:
        raise bad_request(str(exc)) from exc
    except ConnectionError:
        raise  # the client left; leaving the `async with` has already aborted the requests
    except Exception as exc:
        if isinstance(exc, RequestFailedError):
            for (i, j), c in choices.items():  # book the failed sequence with what it produced
                if exc.delta.request_id == f"{request_id}-{i}" and exc.delta.index == j:
                    assemble(c, exc.delta)
        error = engine_failure(exc, request_id)
        if stream is None:
            raise error from exc
        await sse.send(stream, error.body())  # headers are sent: end the stream with an error event
        await sse.send_done(stream)
        return stream
    finally:
        for c in choices.values():
            state.record(request, req, tenant.name, c.out)

    ordered = sorted(choices.values(), key=lambda c: c.index)
    outs = [c.out for c in ordered]
    if req.stream:
        if req.include_usage:
            await sse.send(
                stream,
                {
                    "id": request_id,
                    "object": kind + ("" if not chat else ".chunk"),
                    "created": created,
                    "model": model,
                    "choices": [],
                    "usage": usage(ordered, outs),
                },
            )
        await sse.send_done(stream)
        return stream
    returned = best(ordered, req) if req.best_of > req.n else ordered
    body = [final_choice(state, req, chat, c, k) for k, c in enumerate(returned)]
    return web.json_response(
        {
            "id": request_id,
            "object": kind,
            "created": created,
            "model": model,
            "choices": body,
            "usage": usage(ordered, outs),
        }
    )
