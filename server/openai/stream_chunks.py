"""Streamed responses: each SSE chunk carries what is new in one choice: the engine's delta."""

from __future__ import annotations

from runtime import OutputDelta
from server.openai import sse
from server.openai.choices import Choice, choice_finish_reason, end_offset
from server.openai.logprobs_format import chat_logprobs, completion_logprobs, merge_completion_logprobs
from server.openai.protocol import GenerationRequest
from server.state import ServerState
from server.tools.tool_call_stream import ArgumentsDelta, CallStart, Text, ToolCallStream
from server.tools.tool_calls import parses_tool_calls


async def send_delta(
    stream,
    state: ServerState,
    req: GenerationRequest,
    chat: bool,
    request_id: str,
    created: int,
    model: str,
    c: Choice,
    d: OutputDelta,
) -> None:
    """Stream the delta d of choice c (c.out already holds it)."""
    out = c.out
    tok = state.client.tokenizer
    if chat and not c.started:
        await sse.send(
            stream,
            chunk_body(request_id, created, model, c.index, {"role": "assistant", "content": ""}, None, chat),
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
                    tok, new_tokens, scores, end_offset(logprobs) if logprobs else c.sent_offset
                ),
            )
            c.sent_offset = end_offset(logprobs) or c.sent_offset
    if req.echo and not c.started:
        delta = c.prompt_text + delta
    finish = choice_finish_reason(c, out) if out.finished else None
    if chat and parses_tool_calls(req.tools):  # content and calls as the text reveals them
        if c.tool_stream is None:
            c.tool_stream = ToolCallStream(req.tools)
        for event in c.tool_stream.feed(out.text, out.finished):
            if part := _delta(event):
                await sse.send(stream, chunk_body(request_id, created, model, c.index, part, None, chat))
        delta = ""
        if finish == "stop" and c.tool_stream.calls:
            finish = "tool_calls"
    if delta or finish or new_tokens and logprobs is not None:
        chunk = chunk_body(
            request_id, created, model, c.index, {"content": delta} if chat else delta, finish, chat
        )
        chunk["choices"][0]["logprobs"] = logprobs
        if finish and out.stop_reason is not None and not req.echo_only:
            chunk["choices"][0]["stop_reason"] = out.stop_reason
        await sse.send(stream, chunk)
    c.started = True


def _delta(event) -> dict:
    """A chat chunk's delta for a ToolCallStream event: content, or a piece of tool_calls[index]."""
    if isinstance(event, Text):
        return {"content": event.text}
    if isinstance(event, CallStart):
        call = {"id": event.id, "type": "function", "function": {"name": event.name, "arguments": ""}}
        return {"tool_calls": [{"index": event.index, **call}]}
    if isinstance(event, ArgumentsDelta):
        return {"tool_calls": [{"index": event.index, "function": {"arguments": event.text}}]}
    return {}  # CallEnd: the chat API has no event for it


def chunk_body(
    request_id: str, created: int, model: str, index: int, delta, finish_reason, chat: bool
) -> dict:
    if chat:
        choice = {"index": index, "delta": delta, "finish_reason": finish_reason, "logprobs": None}
        kind = "chat.completion.chunk"
    else:
        choice = {"index": index, "text": delta, "finish_reason": finish_reason, "logprobs": None}
        kind = "text_completion"
    return {"id": request_id, "object": kind, "created": created, "model": model, "choices": [choice]}
