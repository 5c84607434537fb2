"""A Response's output items (a message with output_text, function_call items), built from the text as it
grows and sent as the Responses event stream when one is open (server/responses/responses_api.py)."""

from __future__ import annotations

import uuid

from server.openai import sse
from server.openai.generation import Generation
from server.state import ServerState
from server.tools.tool_call_stream import ArgumentsDelta, CallEnd, CallStart, Text, reply_events
from server.tools.tool_calls import ToolRequest


class ResponseWriter:
    """Output items built from the text as it grows (ToolCallStream events), sent as Responses events when
    a stream is open."""

    def __init__(self, state: ServerState, v: dict, gen: Generation, tools: ToolRequest | None):
        self.state, self.v, self.gen = state, v, gen
        self.events = reply_events(tools)
        self.items: list[dict] = []
        self.stream = None
        self.sequence = 0
        self._message: dict | None = None
        """The output message being written (its text grows), if any."""
        self._calls: dict[int, dict] = {}

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
        for event in self.events.feed(text, final):
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
