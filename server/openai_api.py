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
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass

from aiohttp import web

from runtime import (
    EngineDeadError,
    OutputDelta,
    QueueFullError,
    RequestAbortedError,
    RequestFailedError,
    RequestOutput,
)
from scheduler import InvalidRequestError
from server import sse
from server.auth import Tenant, authenticate, check_key
from server.errors import APIError, bad_request
from server.logprobs_format import chat_logprobs, completion_logprobs, merge_completion_logprobs
from server.protocol import GenerationRequest, parse_chat, parse_completion
from server.state import ServerState, read_json

log = logging.getLogger("prescient.server")


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
            req.prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        except ValueError as exc:
            raise InvalidRequestError("messages", str(exc)) from exc
        req.prompts = [req.prompt]
    return [tokenizer.encode(p) if isinstance(p, str) else p for p in req.prompts]


@dataclass
class _Choice:
    """One returned sequence: prompt i's sample j, assembled from its deltas, and what has been streamed."""

    index: int
    prompt_ids: list[int]
    prompt_text: str
    out: RequestOutput | None = None
    """None until its first delta arrives."""
    sent_offset: int = 0
    """text_offset of the next streamed completion token."""
    started: bool = False
    echo_only: bool = False


def _usage(choices: list[_Choice], outs: list[RequestOutput]) -> dict:
    prompts = {id(c.prompt_ids): c for c in choices}.values()  # each prompt counted once, whatever n is
    prompt = sum(len(c.prompt_ids) for c in prompts)
    completion = sum(len(_generated(c, o)[0]) for c, o in zip(choices, outs))
    usage = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
    cached = sum(o.num_cached_tokens for o in {id(c.prompt_ids): o for c, o in zip(choices, outs)}.values())
    if cached:
        usage["prompt_tokens_details"] = {"cached_tokens": cached}
    return usage


def _generated(choice: _Choice, out: RequestOutput) -> tuple[list[int], str]:
    """Token ids and text the client sees as generated (none when only the prompt is scored)."""
    return ([], "") if choice.echo_only else (out.token_ids, out.text)


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
            400,
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
        raise bad_request(str(exc), exc.param) from exc
    tokenizer = state.client.tokenizer

    kind = "chat.completion" if chat else "text_completion"
    request_id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
    created = int(time.time())
    model = state.model_name
    width = req.best_of
    choices: dict[tuple[int, int], _Choice] = {}
    for i, ids in enumerate(checked):
        prompt = req.prompts[i]
        text = prompt if isinstance(prompt, str) else _decode(tokenizer, ids, i) if req.echo else ""
        for j in range(width):
            choices[i, j] = _Choice(i * width + j, ids, text, echo_only=req.echo_only)
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
        async with aclosing(_merge(sources)) as outputs:
            async for i, delta in outputs:
                choice = _assemble(choices[i, delta.index], delta)
                if not req.stream:
                    continue
                if stream is None:
                    stream = await sse.open_stream(request)
                await _send_delta(stream, state, req, chat, request_id, created, model, choice, delta)
    except QueueFullError as exc:
        state.metrics.count_rejected("queue_full")
        raise APIError(
            429,
            f"The server is at capacity ({exc}); retry shortly.",
            code="queue_full",
            headers={"Retry-After": "1"},
        ) from exc
    except InvalidRequestError as exc:
        raise bad_request(str(exc), exc.param) from exc
    except ValueError as exc:
        raise bad_request(str(exc)) from exc
    except ConnectionError:
        raise  # the client left; leaving the `async with` has already aborted the requests
    except Exception as exc:
        # What the client sees names the kind of failure and the request id; the details are in the log.
        if isinstance(exc, RequestFailedError):
            for (i, j), c in choices.items():  # book the failed sequence with what it produced
                if exc.delta.request_id == f"{request_id}-{i}" and exc.delta.index == j:
                    _assemble(c, exc.delta)
            log.error("request %s failed in the engine (%s); the engine keeps serving", request_id, exc.cause)
            error = APIError(
                500,
                f"The engine failed while generating this request ({exc.cause}); other "
                f"requests are unaffected, retry it. Request id {request_id}.",
                code="engine_error",
            )
        elif isinstance(exc, RequestAbortedError):
            log.warning("request %s aborted: %s", request_id, exc)
            error = APIError(
                503,
                f"The server aborted this request: {exc}; retry on another replica. Request id {request_id}.",
                code="shutdown",
                headers={"Retry-After": "1"},
            )
        elif isinstance(exc, EngineDeadError):
            log.error("request %s: the engine has stopped", request_id)
            error = APIError(
                500,
                "The engine has stopped after an internal error; retry on another "
                f"replica. Request id {request_id}.",
                code="engine_dead",
            )
        else:
            log.exception("internal error on request %s", request_id)
            error = APIError(500, f"Internal server error; it is logged under request id {request_id}.")
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
                    "usage": _usage(ordered, outs),
                },
            )
        await sse.send_done(stream)
        return stream
    returned = _best(ordered, req) if req.best_of > req.n else ordered
    body = [_final_choice(state, req, chat, c, k) for k, c in enumerate(returned)]
    return web.json_response(
        {
            "id": request_id,
            "object": kind,
            "created": created,
            "model": model,
            "choices": body,
            "usage": _usage(ordered, outs),
        }
    )


def _assemble(choice: _Choice, delta: OutputDelta) -> _Choice:
    if choice.out is None:
        choice.out = RequestOutput(delta.request_id, choice.prompt_ids, index=delta.index)
    choice.out.append(delta)
    return choice


def _decode(tokenizer, ids: list[int], i: int) -> str:
    """An echoed token prompt's text (before admission, which would name a bad id the same way)."""
    try:
        return tokenizer.decode(ids)
    except Exception as exc:
        raise bad_request(
            f"'prompt' {i}: not token ids of this model's vocabulary ({type(exc).__name__})", "prompt"
        ) from exc


def _best(choices: list[_Choice], req: GenerationRequest) -> list[_Choice]:
    """best_of: per prompt, the n sequences with the highest mean token logprob, in that order."""
    out = []
    for i in range(len(req.prompts)):
        group = [c for c in choices if c.index // req.best_of == i]
        group.sort(key=lambda c: -sum(s.logprob for s in c.out.logprobs) / max(len(c.out.logprobs), 1))
        out.extend(group[: req.n])
    return out


def _final_choice(state: ServerState, req: GenerationRequest, chat: bool, c: _Choice, index: int) -> dict:
    out = c.out
    token_ids, text = _generated(c, out)
    tok = state.client.tokenizer
    logprobs = None
    if chat:
        if req.logprobs_requested:
            logprobs = chat_logprobs(tok, token_ids, out.logprobs[: len(token_ids)])
        choice = {
            "index": index,
            "message": {"role": "assistant", "content": text},
            "finish_reason": out.finish_reason,
            "logprobs": logprobs,
        }
    else:
        if req.logprobs_requested:
            if req.echo:
                logprobs = completion_logprobs(tok, c.prompt_ids, out.prompt_logprobs)
            logprobs = merge_completion_logprobs(
                logprobs,
                completion_logprobs(tok, token_ids, out.logprobs[: len(token_ids)], _end_offset(logprobs)),
            )
        choice = {
            "index": index,
            "text": (c.prompt_text if req.echo else "") + text,
            "finish_reason": out.finish_reason,
            "logprobs": logprobs,
        }
    if out.stop_reason is not None and not req.echo_only:
        choice["stop_reason"] = out.stop_reason
    return choice


def _end_offset(logprobs: dict | None) -> int:
    if not logprobs or not logprobs["tokens"]:
        return 0
    return logprobs["text_offset"][-1] + len(logprobs["tokens"][-1])


async def _send_delta(
    stream,
    state: ServerState,
    req: GenerationRequest,
    chat: bool,
    request_id: str,
    created: int,
    model: str,
    c: _Choice,
    d: OutputDelta,
) -> None:
    """Stream the delta d of choice c (c.out already holds it)."""
    out = c.out
    tok = state.client.tokenizer
    if chat and not c.started:
        await sse.send(
            stream,
            _chunk(request_id, created, model, c.index, {"role": "assistant", "content": ""}, None, chat),
        )
    delta, new_tokens = ("", []) if c.echo_only else (d.new_text, d.new_token_ids)
    logprobs = None
    if req.logprobs_requested:
        scores = (d.new_logprobs or [])[: len(new_tokens)]
        if chat:
            logprobs = chat_logprobs(tok, new_tokens, scores)
        else:
            if req.echo and not c.started:
                logprobs = completion_logprobs(tok, c.prompt_ids, out.prompt_logprobs)
            logprobs = merge_completion_logprobs(
                logprobs,
                completion_logprobs(
                    tok, new_tokens, scores, _end_offset(logprobs) if logprobs else c.sent_offset
                ),
            )
            c.sent_offset = _end_offset(logprobs) or c.sent_offset
    if req.echo and not c.started:
        delta = c.prompt_text + delta
    finish = out.finish_reason if out.finished else None
    if delta or finish or new_tokens and logprobs is not None:
        chunk = _chunk(
            request_id, created, model, c.index, {"content": delta} if chat else delta, finish, chat
        )
        chunk["choices"][0]["logprobs"] = logprobs
        if finish and out.stop_reason is not None and not req.echo_only:
            chunk["choices"][0]["stop_reason"] = out.stop_reason
        await sse.send(stream, chunk)
    c.started = True


async def _merge(sources: list) -> AsyncIterator[tuple[int, OutputDelta]]:
    """(source index, delta) from several engine streams as they arrive; closing this closes them all
    (which aborts their requests)."""
    if len(sources) == 1:
        async with aclosing(sources[0]) as only:
            async for out in only:
                yield 0, out
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(i: int, source) -> None:
        try:
            async with aclosing(source) as outs:
                async for out in outs:
                    await queue.put((i, out))
            await queue.put((i, done))
        except BaseException as exc:  # handed to the consumer, which re-raises it
            await queue.put((i, exc))
            if isinstance(exc, asyncio.CancelledError):
                raise

    tasks = [asyncio.create_task(pump(i, source)) for i, source in enumerate(sources)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _chunk(request_id: str, created: int, model: str, index: int, delta, finish_reason, chat: bool) -> dict:
    if chat:
        choice = {"index": index, "delta": delta, "finish_reason": finish_reason, "logprobs": None}
        kind = "chat.completion.chunk"
    else:
        choice = {"index": index, "text": delta, "finish_reason": finish_reason, "logprobs": None}
        kind = "text_completion"
    return {"id": request_id, "object": kind, "created": created, "model": model, "choices": [choice]}
