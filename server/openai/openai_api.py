"""POST /v1/completions and /v1/chat/completions, streaming or not.

The handler validates, hands the request to the engine client, and relays
outputs as they arrive: whole (server/openai/choices.py) or as SSE chunks
(server/openai/stream_chunks.py). If the client goes away, the handler is cancelled (or
its write fails) and leaving the `async for` aborts the request in the
engine at once, which frees its KV blocks.
"""

from __future__ import annotations

import json
from contextlib import aclosing

from aiohttp import web

from server.auth import Tenant, check_key
from server.engine_errors import engine_failure
from server.errors import APIError
from server.openai import sse
from server.openai.choices import best, final_choice, usage
from server.openai.generation import Generation, Prepared, check_grammar, prepare
from server.openai.stream_chunks import send_delta
from server.state import ServerState, off_loop, parse_json, read_body


async def completions(request: web.Request) -> web.StreamResponse:
    return await _serve(request, chat=False)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _serve(request, chat=True)


async def _serve(request: web.Request, chat: bool) -> web.StreamResponse:
    """Headers, then the body off the loop when it is big (state.OFF_LOOP_BYTES), then the grammar (always
    off the loop: a small schema may still be slow to compile), then the engine."""
    state: ServerState = request.app["state"]
    state.check_accepting()
    keyed = check_key(state.api_keys, request.headers.get("Authorization"))  # before any work on the body
    raw = await read_body(request)
    prepared = await off_loop(len(raw), _prepare, state, raw, keyed, chat)
    await check_grammar(prepared)
    return await _generate(request, state, prepared)


def _prepare(state: ServerState, raw: bytes, keyed: Tenant | None, chat: bool) -> Prepared:
    return prepare(state, parse_json(raw), keyed, chat)


async def _generate(request: web.Request, state: ServerState, prepared: Prepared):
    req, chat = prepared.req, prepared.chat
    gen = Generation(request, state, prepared, "chatcmpl-" if chat else "cmpl-")
    kind = "chat.completion" if chat else "text_completion"
    request_id, created, model = gen.request_id, gen.created, state.model_name
    stream = None
    try:
        async with aclosing(gen.deltas()) as outputs:
            async for choice, delta in outputs:
                if not req.stream:
                    continue
                if stream is None:
                    stream = await sse.open_stream(request)
                await send_delta(stream, state, req, chat, request_id, created, model, choice, delta)
    except ConnectionError:
        raise  # the client left; leaving the `async with` has already aborted the requests
    except Exception as exc:
        error = exc if isinstance(exc, APIError) else engine_failure(exc, request_id)
        if stream is None:
            raise error from exc
        await sse.send(stream, error.body())  # headers are sent: end the stream with an error event
        await sse.send_done(stream)
        return stream

    ordered = gen.ordered
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

    def reply() -> bytes:
        body = [final_choice(state, req, chat, c, k) for k, c in enumerate(returned)]
        head = {"id": request_id, "object": kind, "created": created, "model": model}
        return json.dumps({**head, "choices": body, "usage": usage(ordered, outs)}).encode()

    # a reply with logprobs grows with tokens x alternatives: built on a worker thread when it is big
    tokens = sum(len(c.out.token_ids) + (len(c.prompt_ids) if req.echo else 0) for c in returned)
    entries = tokens * ((1 + (req.params.logprobs or 0)) if req.logprobs_requested else 1)
    text = await off_loop(entries * REPLY_BYTES_PER_ENTRY, reply)
    return web.Response(body=text, content_type="application/json")


REPLY_BYTES_PER_ENTRY = 32
"""About how many bytes of the reply one token (or one logprob alternative) makes, to decide where the
reply is built (state.off_loop)."""
