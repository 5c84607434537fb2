"""POST /v1/completions and /v1/chat/completions, streaming or not.

The handler validates, hands the request to the engine client, and relays
outputs as they arrive: whole (server/choices.py) or as SSE chunks
(server/stream_chunks.py). If the client goes away, the handler is cancelled (or
its write fails) and leaving the `async for` aborts the request in the
engine at once, which frees its KV blocks.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from contextlib import aclosing
from dataclasses import dataclass

from aiohttp import web

from runtime import QueueFullError, RequestFailedError
from runtime.sample.structured_output import check_structured_output
from scheduler import InvalidRequestError, StructuredOutput
from server import sse
from server.auth import Tenant, check_key, user_tenant
from server.choices import Choice, assemble, best, decode_prompt, final_choice, usage
from server.engine_errors import engine_failure
from server.errors import APIError, bad_request
from server.protocol import GenerationRequest, parse_chat, parse_completion
from server.request_fields import MAX_ECHO_LOGPROBS
from server.schema_check import _show
from server.state import ServerState, off_loop, parse_json, read_body
from server.stream_chunks import send_delta
from server.stream_merge import merge


async def completions(request: web.Request) -> web.StreamResponse:
    return await _serve(request, chat=False)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _serve(request, chat=True)


@dataclass
class Prepared:
    """A request checked, rendered and tokenized: what the engine is asked for."""

    req: GenerationRequest
    tenant: Tenant
    prompt_ids: list[list[int]]
    """Each prompt's token ids."""
    echo_texts: list[str]
    """Each prompt's text as echo returns it ('' without echo)."""
    chat: bool


async def _serve(request: web.Request, chat: bool) -> web.StreamResponse:
    """Headers, then the body off the loop when it is big (state.OFF_LOOP_BYTES), then the grammar (always
    off the loop: a small schema may still be slow to compile), then the engine."""
    state: ServerState = request.app["state"]
    state.check_accepting()
    keyed = check_key(state.api_keys, request.headers.get("Authorization"))  # before any work on the body
    raw = await read_body(request)
    prepared = await off_loop(len(raw), _prepare, state, raw, keyed, chat)
    structured = prepared.req.params.structured_output
    if structured is not None:
        await asyncio.get_running_loop().run_in_executor(None, _check_grammar, structured)
    return await _generate(request, state, prepared)


def _prepare(state: ServerState, raw: bytes, keyed: Tenant | None, chat: bool) -> Prepared:
    """Decode, check, render and tokenize a body (its time grows with the body: server._serve runs it on a
    worker thread for a big one). Raises APIError naming the field."""
    body = parse_json(raw)
    if chat:
        req, messages = parse_chat(body)
    else:
        req, messages = parse_completion(body), None
    tenant = keyed or user_tenant(state.api_keys, req.user)
    if req.model is not None and req.model not in state.model_names:
        raise APIError(
            404,
            f"The model {_show(req.model)} does not exist; this server serves "
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
    _check_token_ids(state, req)
    try:
        ids = _prompt_ids(state, req, messages)
    except InvalidRequestError as exc:
        raise bad_request(str(exc), exc.param, exc.code) from exc
    _check_echo_size(req, ids)
    tokenizer = state.client.tokenizer
    texts = [
        p if isinstance(p, str) else decode_prompt(tokenizer, ids[i], i) if req.echo else ""
        for i, p in enumerate(req.prompts)
    ]
    return Prepared(req, tenant, ids, texts, chat)


def _check_token_ids(state: ServerState, req: GenerationRequest) -> None:
    """Token-id prompts hold at most the context and logit_bias only ids of the vocabulary (400 naming the
    field, as vLLM's); the engine's admission checks each prompt id against the vocabulary."""
    context = state.client.max_model_len
    for i, prompt in enumerate(req.prompts):
        if not isinstance(prompt, str) and len(prompt) > context:
            where = "prompt" if len(req.prompts) == 1 else f"prompt[{i}]"
            raise bad_request(
                f"'{where}' holds {len(prompt)} token ids, more than this model's context of {context} "
                f"tokens",
                where,
                "context_length_exceeded",
            )
    vocab = state.client.vocab_size
    outside = [t for t in req.params.logit_bias if not 0 <= t < vocab]
    if outside:
        raise bad_request(
            f"'logit_bias' names token ids outside this model's vocabulary [0, {vocab}): "
            f"{', '.join(str(t) for t in outside[:5])}",
            "logit_bias",
        )


def _check_echo_size(req: GenerationRequest, ids: list[list[int]]) -> None:
    """echo with logprobs returns (1 + logprobs) entries per prompt token and choice: at most
    MAX_ECHO_LOGPROBS, so that a small request cannot ask for a reply a hundred times its size."""
    k = req.params.prompt_logprobs
    if k is None:
        return
    entries = sum(len(p) for p in ids) * (1 + k) * req.n
    if entries > MAX_ECHO_LOGPROBS:
        raise bad_request(
            f"'echo' with 'logprobs' {k} would return {entries:,} prompt logprob entries (prompt tokens x "
            f"(1 + logprobs) x n), more than the {MAX_ECHO_LOGPROBS:,} allowed; ask for fewer "
            f"alternatives, fewer choices or a shorter prompt",
            "logprobs",
        )


def _check_grammar(structured: StructuredOutput) -> None:
    """The request's grammar compiles (llguidance, on a worker thread; the engine then finds it cached)."""
    try:
        check_structured_output(structured)
    except InvalidRequestError as exc:
        raise bad_request(str(exc), exc.param, exc.code) from exc


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


async def _generate(request: web.Request, state: ServerState, prepared: Prepared):
    req, tenant, chat = prepared.req, prepared.tenant, prepared.chat
    checked = prepared.prompt_ids
    kind = "chat.completion" if chat else "text_completion"
    request_id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
    created = int(time.time())
    model = state.model_name
    width = req.best_of
    choices: dict[tuple[int, int], Choice] = {}
    for i, ids in enumerate(checked):
        for j in range(width):
            choices[i, j] = Choice(i * width + j, ids, prepared.echo_texts[i], echo_only=req.echo_only)
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
