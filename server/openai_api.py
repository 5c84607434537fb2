"""POST /v1/completions and /v1/chat/completions, streaming or not.

The handler validates, hands the request to the engine thread, and relays
outputs as they arrive. If the client goes away, the handler is cancelled (or
its write fails) and leaving the `async for` aborts the request in the
engine at once, which frees its KV blocks.
"""
from __future__ import annotations

import asyncio
import logging
import time
import uuid
from contextlib import aclosing

from aiohttp import web

from runtime import EngineDeadError, QueueFullError, RequestAbortedError, RequestFailedError, RequestOutput
from scheduler import InvalidRequestError
from server import sse
from server.auth import Tenant, authenticate, check_key
from server.errors import APIError, bad_request
from server.protocol import GenerationRequest, parse_chat, parse_completion
from server.state import ServerState, read_json

log = logging.getLogger("prescient.server")


async def completions(request: web.Request) -> web.StreamResponse:
    state: ServerState = request.app["state"]
    state.check_accepting()
    keyed = check_key(state.api_keys, request.headers.get("Authorization"))   # before any work on the body
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


def _prompt_ids(state: ServerState, req: GenerationRequest, messages: list[dict] | None) -> list[int]:
    """Render (chat) and tokenize the prompt; whether it fits is the engine client's admission rule."""
    tokenizer = state.client.tokenizer
    if messages is not None:
        try:
            return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        except ValueError as exc:
            raise InvalidRequestError("messages", str(exc)) from exc
    return tokenizer.encode(req.prompt) if isinstance(req.prompt, str) else req.prompt


def _usage(out: RequestOutput) -> dict:
    prompt, completion = len(out.prompt_token_ids), len(out.token_ids)
    usage = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
    if out.num_cached_tokens:
        usage["prompt_tokens_details"] = {"cached_tokens": out.num_cached_tokens}
    return usage


async def _generate(request: web.Request, state: ServerState, req: GenerationRequest, keyed: Tenant | None,
                    messages: list[dict] | None):
    chat = messages is not None
    tenant = keyed or authenticate(None, None, req.user)
    if req.model is not None and req.model not in state.model_names:
        raise APIError(400, f"The model '{req.model}' does not exist; this server serves "
                            f"{', '.join(repr(n) for n in sorted(state.model_names))} (see GET /v1/models).",
                       param="model", code="model_not_found")
    low, high = tenant.priority_range
    if not low <= req.priority <= high:
        raise bad_request(f"'priority' must be in [{low}, {high}] for this caller (lower runs first; a client "
                          f"may only make its own requests less urgent unless its key grants more)", "priority")
    size = sum(len(m["content"]) for m in messages) if chat else \
        (len(req.prompt) if isinstance(req.prompt, str) else 0)
    try:
        if size > OFF_LOOP_CHARS:
            ids = await asyncio.get_running_loop().run_in_executor(None, _prompt_ids, state, req, messages)
        else:
            ids = _prompt_ids(state, req, messages)
    except InvalidRequestError as exc:
        raise bad_request(str(exc), exc.param) from exc

    kind = "chat.completion" if chat else "text_completion"
    request_id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
    created = int(time.time())
    model = state.model_name
    stream = None
    last: RequestOutput | None = None
    sent = 0
    try:
        # The engine client admits the request (one rule: InvalidRequestError names the field); a
        # max_tokens the client did not send is a default, lowered to what fits rather than refused.
        async with aclosing(state.client.generate(ids, req.params, request_id, tenant=tenant.name,
                                                  weight=tenant.weight, priority=req.priority,
                                                  clamp_max_tokens=not req.max_tokens_given,
                                                  cache_salt=tenant.cache_salt)) as outputs:
            async for out in outputs:
                last = out
                if not req.stream:
                    continue
                if stream is None:
                    stream = await sse.open_stream(request)
                    if chat:
                        await sse.send(stream, _chunk(request_id, created, model,
                                                      {"role": "assistant", "content": ""}, None, chat))
                delta = out.text[sent:]
                sent = len(out.text)
                if delta or out.finished:
                    await sse.send(stream, _chunk(request_id, created, model,
                                                  {"content": delta} if chat else delta,
                                                  out.finish_reason if out.finished else None, chat))
    except QueueFullError as exc:
        state.metrics.count_rejected("queue_full")
        raise APIError(429, f"The server is at capacity ({exc}); retry shortly.",
                       code="queue_full", headers={"Retry-After": "1"}) from exc
    except InvalidRequestError as exc:
        raise bad_request(str(exc), exc.param) from exc
    except ValueError as exc:
        raise bad_request(str(exc)) from exc
    except ConnectionError:
        raise   # the client left; leaving the `async with` has already aborted the request
    except Exception as exc:
        # What the client sees names the kind of failure and the request id; the details are in the log.
        if isinstance(exc, RequestFailedError):
            last = exc.output
            log.error("request %s failed in the engine (%s); the engine keeps serving", request_id, exc.cause)
            error = APIError(500, f"The engine failed while generating this request ({exc.cause}); other "
                                  f"requests are unaffected, retry it. Request id {request_id}.",
                             code="engine_error")
        elif isinstance(exc, RequestAbortedError):
            log.warning("request %s aborted: %s", request_id, exc)
            error = APIError(503, f"The server aborted this request: {exc}; retry on another replica. "
                                  f"Request id {request_id}.", code="shutdown", headers={"Retry-After": "1"})
        elif isinstance(exc, EngineDeadError):
            log.error("request %s: the engine has stopped", request_id)
            error = APIError(500, "The engine has stopped after an internal error; retry on another "
                                  f"replica. Request id {request_id}.", code="engine_dead")
        else:
            log.exception("internal error on request %s", request_id)
            error = APIError(500, f"Internal server error; it is logged under request id {request_id}.")
        if stream is None:
            raise error from exc
        await sse.send(stream, error.body())   # headers are sent: end the stream with an error event
        await sse.send_done(stream)
        return stream
    finally:
        state.record(request, req, tenant.name, last)

    if req.stream:
        if req.include_usage:
            await sse.send(stream, {"id": request_id, "object": kind + ("" if not chat else ".chunk"),
                                    "created": created, "model": model, "choices": [], "usage": _usage(last)})
        await sse.send_done(stream)
        return stream
    choice = ({"index": 0, "message": {"role": "assistant", "content": last.text},
               "finish_reason": last.finish_reason, "logprobs": None} if chat else
              {"index": 0, "text": last.text, "finish_reason": last.finish_reason, "logprobs": None})
    if last.stop_reason is not None:
        choice["stop_reason"] = last.stop_reason
    return web.json_response({"id": request_id, "object": kind, "created": created, "model": model,
                              "choices": [choice], "usage": _usage(last)})


def _chunk(request_id: str, created: int, model: str, delta, finish_reason, chat: bool) -> dict:
    if chat:
        choice = {"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": None}
        kind = "chat.completion.chunk"
    else:
        choice = {"index": 0, "text": delta, "finish_reason": finish_reason, "logprobs": None}
        kind = "text_completion"
    return {"id": request_id, "object": kind, "created": created, "model": model, "choices": [choice]}
