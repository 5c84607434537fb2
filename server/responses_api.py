"""POST /v1/responses: OpenAI's Responses API, translated onto the chat path.

The body becomes a chat body (input items -> messages, instructions -> a system message,
max_output_tokens, text.format -> response_format, flat function tools -> chat tools), which the chat
path checks, renders and runs (server/generation.py): sampling, tool prompts, grammars and tool-call
parsing are the chat path's own. The output is written as Responses output items (a message with
output_text, function_call items), whole or as the Responses event stream (response.created,
response.output_item.added, response.output_text.delta, response.function_call_arguments.delta, ...,
response.completed). A stored response's conversation (server/response_store.py) continues with
previous_response_id.
"""

from __future__ import annotations

import uuid
from contextlib import aclosing

from aiohttp import web

from server import sse
from server.auth import Tenant, check_key, user_tenant
from server.compat_fields import RESPONSES
from server.engine_errors import engine_failure
from server.errors import APIError, bad_request
from server.generation import Generation, Prepared, check_grammar, prepare_translated
from server.state import ServerState, off_loop, parse_json, read_body
from server.tool_call_stream import ArgumentsDelta, CallEnd, CallStart, Text, ToolCallStream
from server.tool_calls import ToolRequest, parses_tool_calls

NAMES = {
    "messages": "input",
    "max_completion_tokens": "max_output_tokens",
    "response_format.json_schema": "text.format",
    "response_format": "text.format",
}
"""Chat fields -> the Responses fields they came from, for errors."""


async def responses(request: web.Request) -> web.StreamResponse:
    state: ServerState = request.app["state"]
    state.check_accepting()
    keyed = check_key(state.api_keys, request.headers.get("Authorization"))
    raw = await read_body(request)
    v, messages, prepared = await off_loop(len(raw), _prepare, state, raw, keyed)
    await check_grammar(prepared)
    gen = Generation(request, state, prepared, "resp_")
    writer = ResponseWriter(state, v, gen, prepared.req.tools)
    stream = None
    try:
        async with aclosing(gen.deltas()) as outputs:
            async for choice, _ in outputs:
                if v["stream"]:
                    if stream is None:
                        stream = await sse.open_stream(request)
                        await writer.start(stream)
                    await writer.feed(choice.out.text, choice.out.finished)
    except ConnectionError:
        raise
    except Exception as exc:
        error = exc if isinstance(exc, APIError) else engine_failure(exc, gen.request_id)
        if stream is None:
            raise error from exc
        body = error.body()["error"]
        await writer.send("error", {"code": body["code"], "message": body["message"], "param": body["param"]})
        await stream.write_eof()
        return stream
    out = gen.ordered[0].out
    if stream is None:
        await writer.feed(out.text, True)
    response = writer.response(out.finish_reason, gen.usage())
    if v["store"]:
        state.responses.put(prepared.tenant.name, gen.request_id, messages + [writer.assistant_message()])
    if stream is None:
        return web.json_response(response)
    await writer.send(f"response.{response['status']}", {"response": response})
    await stream.write_eof()
    return stream


def _prepare(state: ServerState, raw: bytes, keyed: Tenant | None) -> tuple[dict, list[dict], Prepared]:
    """The body read, the conversation it continues (without instructions), and the prepared chat request."""
    v = RESPONSES.read(parse_json(raw))
    tenant = keyed or user_tenant(state.api_keys, v["user"])
    messages = []
    if v["previous_response_id"] is not None:
        messages = state.responses.get(tenant.name, v["previous_response_id"])
        if messages is None:
            raise bad_request(
                f"Previous response with id {v['previous_response_id']!r} not found: responses are kept "
                f"per API key for a while, and only with store: true",
                "previous_response_id",
                "previous_response_not_found",
            )
    messages += _input_messages(v["input"])
    system = [{"role": "system", "content": v["instructions"]}] if v["instructions"] else []
    body = {
        "model": v["model"],
        "messages": system + messages,
        "max_completion_tokens": v["max_output_tokens"],
        "temperature": v["temperature"],
        "top_p": v["top_p"],
        "seed": v["seed"],
        "user": v["user"],
        "response_format": _response_format((v["text"] or {}).get("format")),
    }
    if v["tools"]:
        body["tools"] = [
            {
                "type": "function",
                "function": {k: t[k] for k in ("name", "description", "parameters") if t.get(k) is not None},
            }
            for t in v["tools"]
        ]
        choice = v["tool_choice"]
        if isinstance(choice, dict):
            choice = {"type": "function", "function": {"name": choice["name"]}}
        body["tool_choice"] = choice
    elif v["tool_choice"] not in (None, "none"):
        raise bad_request("'tool_choice' needs 'tools': send the functions the model may call", "tool_choice")
    return v, messages, prepare_translated(state, body, tenant, NAMES)


def _response_format(fmt: dict | None) -> dict | None:
    if fmt is None or fmt["type"] == "text":
        return None
    if fmt["type"] == "json_object":
        return {"type": "json_object"}
    if fmt.get("schema") is None:
        raise bad_request(
            "'text.format.schema' is required with type 'json_schema'",
            "text.format.schema",
            "missing_required_parameter",
        )
    return {
        "type": "json_schema",
        "json_schema": {"name": fmt.get("name") or "output", "schema": fmt["schema"]},
    }


def _input_messages(items) -> list[dict]:
    """Input items as chat messages: a function_call joins the assistant turn before it (or starts one), a
    function_call_output is a tool message."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    messages: list[dict] = []
    for i, item in enumerate(items):
        kind = item.get("type") or "message"
        if kind == "message":
            for name in ("role", "content"):
                if item.get(name) is None:
                    raise bad_request(f"'input[{i}].{name}' is required", f"input[{i}].{name}")
            content = item["content"]
            if isinstance(content, list):
                content = "".join(part.get("text") or "" for part in content)
            messages.append({"role": item["role"], "content": content})
        elif kind == "function_call":
            for name in ("call_id", "name", "arguments"):
                if item.get(name) is None:
                    raise bad_request(f"'input[{i}].{name}' is required", f"input[{i}].{name}")
            call = {
                "id": item["call_id"],
                "type": "function",
                "function": {"name": item["name"], "arguments": item["arguments"]},
            }
            if messages and messages[-1]["role"] == "assistant":
                messages[-1].setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        else:  # function_call_output
            for name in ("call_id", "output"):
                if item.get(name) is None:
                    raise bad_request(f"'input[{i}].{name}' is required", f"input[{i}].{name}")
            messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": item["output"]})
    return messages


class ResponseWriter:
    """Output items built from the text as it grows (ToolCallStream events), sent as Responses events when
    a stream is open."""

    def __init__(self, state: ServerState, v: dict, gen: Generation, tools: ToolRequest | None):
        self.state, self.v, self.gen = state, v, gen
        self.tools = ToolCallStream(tools) if parses_tool_calls(tools) else None
        self.items: list[dict] = []
        self.stream = None
        self.sequence = 0
        self._message: dict | None = None
        """The output message being written (its text grows), if any."""
        self._calls: dict[int, dict] = {}
        self._sent = 0
        """Characters of the text read (without tools)."""

    async def start(self, stream) -> None:
        self.stream = stream
        created = self.response(None, None)
        await self.send("response.created", {"response": created})
        await self.send("response.in_progress", {"response": created})

    async def send(self, event: str, payload: dict) -> None:
        if self.stream is not None:
            await sse.send_event(
                self.stream, event, {"type": event, "sequence_number": self.sequence, **payload}
            )
            self.sequence += 1

    async def feed(self, text: str, final: bool) -> None:
        if self.tools is not None:
            events = self.tools.feed(text, final)
        else:
            events, self._sent = [Text(text[self._sent :])] if len(text) > self._sent else [], len(text)
        for event in events:
            if isinstance(event, Text):
                await self._text(event.text)
            elif isinstance(event, CallStart):
                await self._close_message()
                item = {
                    "type": "function_call",
                    "id": "fc_" + uuid.uuid4().hex,
                    "call_id": event.id,
                    "name": event.name,
                    "arguments": "",
                    "status": "in_progress",
                }
                self._calls[event.index] = item
                self.items.append(item)
                await self.send(
                    "response.output_item.added", {"output_index": len(self.items) - 1, "item": item}
                )
            elif isinstance(event, ArgumentsDelta):
                item = self._calls[event.index]
                item["arguments"] += event.text
                where = {"item_id": item["id"], "output_index": self.items.index(item)}
                await self.send("response.function_call_arguments.delta", {**where, "delta": event.text})
            elif isinstance(event, CallEnd):
                item = self._calls[event.index]
                item["status"] = "completed"
                where = {"item_id": item["id"], "output_index": self.items.index(item)}
                await self.send(
                    "response.function_call_arguments.done", {**where, "arguments": item["arguments"]}
                )
                await self.send(
                    "response.output_item.done", {"output_index": where["output_index"], "item": item}
                )
        if final:
            await self._close_message()

    async def _text(self, text: str) -> None:
        if self._message is None:
            self._message = {
                "type": "message",
                "id": "msg_" + uuid.uuid4().hex,
                "status": "in_progress",
                "role": "assistant",
                "content": [],
            }
            self.items.append(self._message)
            index = len(self.items) - 1
            await self.send("response.output_item.added", {"output_index": index, "item": self._message})
            self._message["content"].append({"type": "output_text", "text": "", "annotations": []})
            await self.send(
                "response.content_part.added",
                {**self._where(), "part": {"type": "output_text", "text": "", "annotations": []}},
            )
        self._message["content"][0]["text"] += text
        await self.send("response.output_text.delta", {**self._where(), "delta": text, "logprobs": []})

    def _where(self) -> dict:
        return {
            "item_id": self._message["id"],
            "output_index": self.items.index(self._message),
            "content_index": 0,
        }

    async def _close_message(self) -> None:
        message = self._message
        if message is None:
            return
        part = message["content"][0]
        await self.send("response.output_text.done", {**self._where(), "text": part["text"], "logprobs": []})
        await self.send("response.content_part.done", {**self._where(), "part": part})
        message["status"] = "completed"
        await self.send(
            "response.output_item.done", {"output_index": self._where()["output_index"], "item": message}
        )
        self._message = None

    def assistant_message(self) -> dict:
        """The output as a chat assistant message, for the conversation kept for a follow-up."""
        text = "".join(i["content"][0]["text"] for i in self.items if i["type"] == "message")
        calls = [
            {
                "id": i["call_id"],
                "type": "function",
                "function": {"name": i["name"], "arguments": i["arguments"]},
            }
            for i in self.items
            if i["type"] == "function_call"
        ]
        return {"role": "assistant", "content": text, **({"tool_calls": calls} if calls else {})}

    def response(self, finish_reason: str | None, usage: dict | None) -> dict:
        """The Response object: in progress (finish_reason None), completed, or incomplete at the limit."""
        v = self.v
        status = (
            "in_progress"
            if finish_reason is None
            else "incomplete"
            if finish_reason == "length"
            else "completed"
        )
        body = {
            "id": self.gen.request_id,
            "object": "response",
            "created_at": self.gen.created,
            "status": status,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": v["instructions"],
            "max_output_tokens": v["max_output_tokens"],
            "model": self.state.model_name,
            "output": self.items if finish_reason is not None else [],
            "parallel_tool_calls": v["parallel_tool_calls"] is not False,
            "previous_response_id": v["previous_response_id"],
            "temperature": v["temperature"],
            "text": v["text"] or {"format": {"type": "text"}},
            "tool_choice": v["tool_choice"] or ("auto" if v["tools"] else "none"),
            "tools": v["tools"] or [],
            "top_p": v["top_p"],
            "metadata": v["metadata"] or {},
            "store": v["store"],
            "usage": None,
        }
        if usage is not None:
            cached = usage.get("prompt_tokens_details", {}).get("cached_tokens", 0)
            body["usage"] = {
                "input_tokens": usage["prompt_tokens"],
                "input_tokens_details": {"cached_tokens": cached},
                "output_tokens": usage["completion_tokens"],
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": usage["total_tokens"],
            }
        return body
