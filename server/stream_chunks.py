"""Streamed responses: each SSE chunk carries what is new in one choice: the engine's delta."""

from __future__ import annotations

from runtime import OutputDelta
from server import sse
from server.choices import Choice, choice_finish_reason, end_offset
from server.logprobs_format import chat_logprobs, completion_logprobs, merge_completion_logprobs
from server.protocol import GenerationRequest
from server.state import ServerState
from server.tool_calls import extract_tool_calls, held_back, parses_tool_calls


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
    tools = chat and parses_tool_calls(req.tools)
    if tools:  # text that may be a call is held until the sequence ends: what is sent is counted in chars
        text = out.text
        delta = text[c.sent_text :]
        if not out.finished:
            delta = delta[: max(len(delta) - held_back(text), 0)]
            text = text[: c.sent_text + len(delta)]
        else:
            content, calls = extract_tool_calls(text, req.tools)
            if calls:
                sent = text[: c.sent_text]
                # what the client has not seen of the content, the calls taken out of it
                delta = content[len(sent) :] if content and content.startswith(sent) else ""
                for k, call in enumerate(calls):
                    part = {"tool_calls": [dict(call, index=k)]}
                    await sse.send(stream, chunk_body(request_id, created, model, c.index, part, None, chat))
                finish = "tool_calls" if finish == "stop" else finish
    if delta or finish or new_tokens and logprobs is not None:
        chunk = chunk_body(
            request_id, created, model, c.index, {"content": delta} if chat else delta, finish, chat
        )
        chunk["choices"][0]["logprobs"] = logprobs
        if finish and out.stop_reason is not None and not req.echo_only:
            chunk["choices"][0]["stop_reason"] = out.stop_reason
        await sse.send(stream, chunk)
        if tools:
            c.sent_text = len(text)
    c.started = True


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
