"""The one generation path every API shares: a checked body to prompt ids, then the engine's deltas.

OpenAI's chat and completions (server/openai/openai_api.py) and the APIs translated onto chat (Responses,
Anthropic Messages, Ollama) all come through here: `prepare` checks, renders and tokenizes a request
(server/openai/protocol.py reads the body), `check_grammar` compiles its grammar off the loop, and a Generation
runs it on the engine, yielding each choice as a delta arrives and booking metrics and the log line
however it ends. Only how the output is written differs between APIs.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass

from aiohttp import web

from runtime import OutputDelta, QueueFullError, RequestFailedError
from runtime.sample.structured_output import check_structured_output
from scheduler import InvalidRequestError, StructuredOutput
from server.auth import Tenant, user_tenant
from server.engine_errors import engine_failure
from server.errors import APIError, bad_request
from server.openai import sse
from server.openai.choices import Choice, assemble, decode_prompt, usage
from server.openai.protocol import GenerationRequest, parse_chat, parse_completion
from server.openai.stream_merge import merge
from server.schema.request_fields import MAX_ECHO_LOGPROBS
from server.schema.schema_check import _show
from server.state import ServerState


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


def prepare(state: ServerState, body: dict, keyed: Tenant | None, chat: bool) -> Prepared:
    """Check, render and tokenize an OpenAI body (its time grows with the body: callers run it on a worker
    thread for a big one, state.off_loop). Raises APIError naming the field."""
    if chat:
        req, messages = parse_chat(body)
    else:
        req, messages = parse_completion(body), None
    tenant = keyed or user_tenant(state.api_keys, req.user)
    check_model(state, req.model)
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


def check_model(state: ServerState, model: str | None) -> None:
    """A `model` the client names is one this server serves (404 model_not_found otherwise)."""
    if model is not None and model not in state.model_names:
        raise APIError(
            404,
            f"The model {_show(model)} does not exist; this server serves "
            f"{', '.join(repr(n) for n in sorted(state.model_names))} (see GET /v1/models).",
            param="model",
            code="model_not_found",
        )


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


async def check_grammar(prepared: Prepared) -> None:
    """The request's grammar compiles (llguidance, always on a worker thread: a small schema may still be
    slow to compile; the engine then finds it cached)."""
    structured = prepared.req.params.structured_output
    if structured is not None:
        await asyncio.get_running_loop().run_in_executor(None, _compile, structured)


def _compile(structured: StructuredOutput) -> None:
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


class Generation:
    """One prepared request on the engine: its choices (prompt i, sample j), filled in as deltas arrive."""

    def __init__(self, request: web.Request, state: ServerState, prepared: Prepared, id_prefix: str):
        self.request = request
        self.state = state
        self.prepared = prepared
        self.request_id = id_prefix + uuid.uuid4().hex
        self.created = int(time.time())
        width = prepared.req.best_of
        self.choices: dict[tuple[int, int], Choice] = {}
        for i, ids in enumerate(prepared.prompt_ids):
            for j in range(width):
                self.choices[i, j] = Choice(
                    i * width + j, ids, prepared.echo_texts[i], echo_only=prepared.req.echo_only
                )

    async def deltas(self) -> AsyncIterator[tuple[Choice, OutputDelta]]:
        """Each (choice, delta) as the engine produces it (choice.out already holds the delta). Raises
        APIError: 429 when the queue is full, 400 for a request the engine refuses, 5xx when it fails.
        Leaving early aborts the requests in the engine; the metrics and the log line are booked however
        it ends."""
        state, prepared, req = self.state, self.prepared, self.prepared.req
        tenant = prepared.tenant
        try:
            # The engine client admits each prompt (one rule: InvalidRequestError names the field); a
            # max_tokens the client did not send is a default, lowered to what fits rather than refused.
            sources = [
                state.client.generate(
                    ids,
                    req.params,
                    f"{self.request_id}-{i}",
                    tenant=tenant.name,
                    weight=tenant.weight,
                    priority=req.priority,
                    clamp_max_tokens=not req.max_tokens_given,
                    cache_salt=tenant.cache_salt,
                )
                for i, ids in enumerate(prepared.prompt_ids)
            ]
            async with aclosing(_engine_deltas(sources, self)) as outputs:
                async for item in outputs:
                    yield item
        finally:
            for c in self.choices.values():
                state.record(self.request, req, tenant.name, c.out)

    async def write_events(
        self, streamed: bool, writer, send_error
    ) -> tuple[web.StreamResponse | None, bool]:
        """Run the request for a one-choice API whose writer turns text into events (Responses, Anthropic
        Messages): when `streamed`, the event stream opens at the first delta (writer.start) and each delta's
        text goes to writer.feed. An error before the stream opened raises (the API's own error reply); one
        after it goes to `send_error(stream, error)` and ends the stream. Returns (the stream or None, whether
        it ended on an error)."""
        stream = None
        try:
            async with aclosing(self.deltas()) as outputs:
                async for choice, _ in outputs:
                    if streamed:
                        if stream is None:
                            stream = await sse.open_stream(self.request)
                            await writer.start(stream)
                        await writer.feed(choice.out.text, choice.out.finished)
        except ConnectionError:
            raise
        except Exception as exc:
            error = exc if isinstance(exc, APIError) else engine_failure(exc, self.request_id)
            if stream is None:
                raise error from exc
            await send_error(stream, error)
            await stream.write_eof()
            return stream, True
        return stream, False

    @property
    def ordered(self) -> list[Choice]:
        return sorted(self.choices.values(), key=lambda c: c.index)

    def usage(self) -> dict:
        ordered = self.ordered
        return usage(ordered, [c.out for c in ordered])


async def _engine_deltas(sources: list, gen: Generation) -> AsyncIterator[tuple[Choice, OutputDelta]]:
    """The engine's deltas of every prompt, their failures turned into APIError."""
    try:
        async with aclosing(merge(sources)) as outputs:
            async for i, delta in outputs:
                yield assemble(gen.choices[i, delta.index], delta), delta
    except QueueFullError as exc:
        gen.state.metrics.count_rejected("queue_full")
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
    except (ConnectionError, GeneratorExit, asyncio.CancelledError):
        raise  # the client left; leaving the `async with` has already aborted the requests
    except Exception as exc:
        if isinstance(exc, RequestFailedError):
            for (i, j), c in gen.choices.items():  # book the failed sequence with what it produced
                if exc.delta.request_id == f"{gen.request_id}-{i}" and exc.delta.index == j:
                    assemble(c, exc.delta)
        raise engine_failure(exc, gen.request_id) from exc


def prepare_translated(state: ServerState, chat_body: dict, keyed: Tenant | None, names: dict[str, str]):
    """prepare() for a chat body another API's body was translated into; an error's field is named as the
    client sent it (names: chat field -> the client's, matched as a prefix of the error's param)."""
    try:
        return prepare(state, chat_body, keyed, chat=True)
    except APIError as exc:
        raise renamed(exc, names) from exc


def renamed(exc: APIError, names: dict[str, str]) -> APIError:
    """The error with its param (and the param quoted in its message) in the client's names."""
    param = exc.param
    if param is None:
        return exc
    for ours, theirs in sorted(names.items(), key=lambda kv: -len(kv[0])):
        if param == ours or param.startswith(ours + ".") or param.startswith(ours + "["):
            new = theirs + param[len(ours) :]
            exc.message = exc.message.replace(f"'{param}'", f"'{new}'")
            if exc.message.startswith(f"{param}: "):  # InvalidRequestError's "field: detail"
                exc.message = f"{new}: {exc.message[len(param) + 2 :]}"
            exc.param = new
            break
    return exc
