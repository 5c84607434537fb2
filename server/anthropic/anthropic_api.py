"""POST /v1/messages and /v1/messages/count_tokens: Anthropic's Messages API, translated onto the chat path.

system, messages (text, tool_use and tool_result blocks), max_tokens, stop_sequences, temperature, top_p,
top_k, tools (input_schema) and tool_choice (auto, any, tool, none) become a chat body, which the chat
path checks, renders and runs (server/openai/generation.py). The reply is a message of text and tool_use blocks,
whole or as Anthropic's event stream (message_start, content_block_start, content_block_delta with
text_delta / input_json_delta, content_block_stop, message_delta, message_stop). The key is read from
`x-api-key` as well as `Authorization: Bearer`; errors use Anthropic's envelope (server/errors.py).
"""

from __future__ import annotations

import json
import uuid

from aiohttp import web

from server.auth import Tenant, bearer_or_api_key, check_key, user_tenant
from server.errors import bad_request
from server.openai import sse
from server.openai.generation import Generation, Prepared, check_grammar, prepare_translated
from server.schema.compat_fields import COUNT_TOKENS, MESSAGES
from server.state import ServerState, off_loop, parse_json, read_body
from server.tools.tool_call_stream import ArgumentsDelta, CallEnd, CallStart, Text, reply_events

NAMES = {"stop": "stop_sequences", "max_completion_tokens": "max_tokens"}
"""Chat fields -> the Anthropic fields they came from, for errors ('messages', 'tools' keep their names)."""


async def messages(request: web.Request) -> web.StreamResponse:
    state: ServerState = request.app["state"]
    state.check_accepting()
    keyed = check_key(state.api_keys, bearer_or_api_key(request.headers))
    raw = await read_body(request)
    v, prepared = await off_loop(len(raw), _prepare, state, raw, keyed, MESSAGES)
    await check_grammar(prepared)
    gen = Generation(request, state, prepared, "msg_")
    writer = MessageWriter(state, gen, prepared, v["stop_sequences"] or [])
    stream, failed = await gen.write_events(
        v["stream"], writer, lambda stream, error: sse.send_event(stream, "error", error.anthropic_body())
    )
    if failed:
        return stream
    out = gen.ordered[0].out
    if stream is None:
        await writer.feed(out.text, True)
        return web.json_response(writer.message(out))
    stop_reason, stop_sequence = writer.stop(out)
    await writer.send(
        "message_delta",
        {
            "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
            "usage": {"output_tokens": len(out.token_ids)},
        },
    )
    await writer.send("message_stop", {})
    await stream.write_eof()
    return stream


async def count_tokens(request: web.Request) -> web.Response:
    """{"input_tokens": n}: the prompt the same body would be rendered into (system, messages, tools)."""
    state: ServerState = request.app["state"]
    keyed = check_key(state.api_keys, bearer_or_api_key(request.headers))
    raw = await read_body(request)
    _, prepared = await off_loop(len(raw), _prepare, state, raw, keyed, COUNT_TOKENS)
    return web.json_response({"input_tokens": len(prepared.prompt_ids[0])})


def _prepare(state: ServerState, raw: bytes, keyed: Tenant | None, fields) -> tuple[dict, Prepared]:
    v = fields.read(parse_json(raw))
    user = (v.get("metadata") or {}).get("user_id")
    tenant = keyed or user_tenant(state.api_keys, user)
    chat = [{"role": "system", "content": _text_of(v["system"])}] if v["system"] else []
    for i, message in enumerate(v["messages"]):
        chat += _chat_messages(message, i)
    body = {
        "model": v["model"],
        "messages": chat,
        "max_tokens": v.get("max_tokens"),
        "stop": v.get("stop_sequences"),
        "temperature": v.get("temperature"),
        "top_p": v.get("top_p"),
        "top_k": v.get("top_k"),
        "user": user,
    }
    if v["tools"]:
        body["tools"] = [
            {
                "type": "function",
                "function": {
                    "name": t["name"],
                    **({"description": t["description"]} if t.get("description") else {}),
                    "parameters": t.get("input_schema") or {"type": "object"},
                },
            }
            for t in v["tools"]
        ]
        choice = v["tool_choice"] or {"type": "auto"}
        if choice["type"] == "tool":
            if not choice.get("name"):
                raise bad_request("'tool_choice.name' is required with type 'tool'", "tool_choice.name")
            body["tool_choice"] = {"type": "function", "function": {"name": choice["name"]}}
        else:
            body["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}[choice["type"]]
    return v, prepare_translated(state, body, tenant, NAMES)


def _text_of(content) -> str:
    """A system prompt or tool result: a string, or text blocks joined."""
    if isinstance(content, str):
        return content
    return "".join(block.get("text") or "" for block in content if block.get("type") == "text")


def _chat_messages(message: dict, i: int) -> list[dict]:
    """One Anthropic message as chat messages: tool_use blocks become the assistant's tool_calls, each
    tool_result a tool message (before the user's own text)."""
    role, content = message["role"], message["content"]
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    text, calls, results = "", [], []
    for k, block in enumerate(content):
        where = f"messages[{i}].content[{k}]"
        kind = block["type"]
        if kind == "text":
            text += block.get("text") or ""
        elif kind == "tool_use":
            if role != "assistant" or not block.get("id") or not block.get("name"):
                raise bad_request(
                    f"'{where}': a tool_use block is the assistant's, with an id and a name", where
                )
            arguments = json.dumps(block.get("input") or {}, ensure_ascii=False)
            calls.append(
                {
                    "id": block["id"],
                    "type": "function",
                    "function": {"name": block["name"], "arguments": arguments},
                }
            )
        else:  # tool_result
            if role != "user" or not block.get("tool_use_id"):
                raise bad_request(f"'{where}': a tool_result block is the user's, with a tool_use_id", where)
            output = _text_of(block.get("content") or "")
            results.append({"role": "tool", "tool_call_id": block["tool_use_id"], "content": output})
    if role == "assistant":
        return [{"role": "assistant", "content": text or None, **({"tool_calls": calls} if calls else {})}]
    return results + ([{"role": "user", "content": text}] if text or not results else [])


class MessageWriter:
    """Content blocks built from the text as it grows (ToolCallStream events), sent as Anthropic events when
    a stream is open."""

    def __init__(self, state: ServerState, gen: Generation, prepared: Prepared, stop_sequences: list[str]):
        self.state, self.gen, self.prepared = state, gen, prepared
        tools = prepared.req.tools
        self.events = reply_events(tools)
        self.stop_sequences = stop_sequences
        self.blocks: list[dict] = []
        self.stream = None
        self._open: int | None = None
        """Index of the block being written."""
        self._arguments: dict[int, str] = {}

    async def start(self, stream) -> None:
        self.stream = stream
        head = self._head()
        head["usage"] = {"input_tokens": len(self.prepared.prompt_ids[0]), "output_tokens": 0}
        await self.send("message_start", {"message": head})

    async def send(self, event: str, payload: dict) -> None:
        if self.stream is not None:
            await sse.send_event(self.stream, event, {"type": event, **payload})

    async def feed(self, text: str, final: bool) -> None:
        for event in self.events.feed(text, final):
            if isinstance(event, Text):
                if self._open is None or self.blocks[self._open]["type"] != "text":
                    await self._start_block({"type": "text", "text": ""})
                self.blocks[self._open]["text"] += event.text
                await self.send(
                    "content_block_delta",
                    {"index": self._open, "delta": {"type": "text_delta", "text": event.text}},
                )
            elif isinstance(event, CallStart):
                block = {
                    "type": "tool_use",
                    "id": "toolu_" + uuid.uuid4().hex[:24],
                    "name": event.name,
                    "input": {},
                }
                await self._start_block(block)
                self._arguments[self._open] = ""
            elif isinstance(event, ArgumentsDelta):
                self._arguments[self._open] += event.text
                await self.send(
                    "content_block_delta",
                    {"index": self._open, "delta": {"type": "input_json_delta", "partial_json": event.text}},
                )
            elif isinstance(event, CallEnd):
                await self._stop_block()
        if final:
            await self._stop_block()

    async def _start_block(self, block: dict) -> None:
        await self._stop_block()
        self.blocks.append(block)
        self._open = len(self.blocks) - 1
        shown = dict(block, text="") if block["type"] == "text" else block
        await self.send("content_block_start", {"index": self._open, "content_block": shown})

    async def _stop_block(self) -> None:
        if self._open is None:
            return
        index, self._open = self._open, None
        if index in self._arguments:
            try:
                self.blocks[index]["input"] = json.loads(self._arguments[index] or "{}")
            except ValueError:  # cut off by max_tokens: the pieces streamed are all there is
                self.blocks[index]["input"] = {}
        await self.send("content_block_stop", {"index": index})

    def _head(self) -> dict:
        return {
            "id": self.gen.request_id,
            "type": "message",
            "role": "assistant",
            "model": self.state.model_name,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
        }

    def stop(self, out) -> tuple[str, str | None]:
        """Anthropic's stop_reason (and the stop sequence met) for how the sequence ended."""
        if out.finish_reason == "length":
            return "max_tokens", None
        if any(b["type"] == "tool_use" for b in self.blocks):
            return "tool_use", None
        if isinstance(out.stop_reason, str) and out.stop_reason in self.stop_sequences:
            return "stop_sequence", out.stop_reason
        return "end_turn", None

    def message(self, out) -> dict:
        stop_reason, stop_sequence = self.stop(out)
        usage = self.gen.usage()
        body = self._head()
        body.update(content=self.blocks, stop_reason=stop_reason, stop_sequence=stop_sequence)
        body["usage"] = {
            "input_tokens": usage["prompt_tokens"],
            "output_tokens": usage["completion_tokens"],
            "cache_read_input_tokens": usage.get("prompt_tokens_details", {}).get("cached_tokens", 0),
        }
        return body
