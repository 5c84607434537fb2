"""Tool calls read from a growing text, as the model writes them: what streaming APIs send as it comes.

The model writes `<tool_call>{"name": "f", "arguments": {...}}</tool_call>` (server/tools/tool_calls.py). As soon
as the name of a known function is read, the call starts; its arguments then go out piece by piece as they
are generated (OpenAI's `tool_calls[].function.arguments` deltas, Responses'
`response.function_call_arguments.delta`, Anthropic's `input_json_delta`). Every API renders the same
events:

    Text(text)                      content outside any call
    CallStart(index, id, name)      a call begins
    ArgumentsDelta(index, text)     the next piece of its arguments (JSON text; together: the arguments)
    CallEnd(index)                  its arguments are complete (or the sequence ended inside them)

A block whose head is not `{"name": <known function>, "arguments": {` (another key order, a list of
calls, an unknown name) is held until its closing tag and then read whole by extract_tool_calls: a valid
call becomes one start, one arguments piece and one end; anything else is returned as text, as the
non-streamed reply does.
"""

from __future__ import annotations

import re
import uuid
from dataclasses import dataclass

from server.tools.tool_calls import CLOSE, OPEN, ToolRequest, extract_tool_calls, held_back, parses_tool_calls

_HEAD = re.compile(
    r'\s*\{\s*"name"\s*:\s*"([A-Za-z0-9_.\-]{1,64})"\s*,\s*"(?:arguments|parameters)"\s*:\s*\{'
)
MAX_HEAD_CHARS = 256
"""A call's head not read as `{"name": ..., "arguments": {` within this many characters is held whole."""


@dataclass
class Text:
    text: str


@dataclass
class CallStart:
    index: int
    id: str
    name: str


@dataclass
class ArgumentsDelta:
    index: int
    text: str


@dataclass
class CallEnd:
    index: int


def reply_events(tools: ToolRequest | None) -> ToolCallStream | TextStream:
    """What turns a reply's growing text into events: calls parsed out when the request's tools ask for it,
    its new text alone otherwise."""
    return ToolCallStream(tools) if parses_tool_calls(tools) else TextStream()


class TextStream:
    """Feed it the whole text so far (each time it grows); it returns the new text as one Text event."""

    def __init__(self):
        self._sent = 0

    def feed(self, text: str, final: bool) -> list:
        new = text[self._sent :]
        self._sent = max(self._sent, len(text))
        return [Text(new)] if new else []


class ToolCallStream:
    """Feed it the whole text so far (each time it grows); it returns the events that are new."""

    def __init__(self, tools: ToolRequest):
        self.tools = tools
        self.known = {f["name"] for f in tools.functions}
        self.calls: list[dict] = []
        """Each call started: {"id", "name", "arguments"} (arguments as streamed so far)."""
        self._pos = 0
        """Characters of the text read."""
        self._state = "text"  # text | head | args | after | block
        self._open = 0
        """Where the block being read starts (at its opening tag)."""
        self._depth = 0
        self._in_string = False
        self._escaped = False
        self._spaces = ""
        """Whitespace-only text held back: dropped if the output turns out to hold calls and nothing else."""

    def feed(self, text: str, final: bool) -> list:
        events: list = []
        while True:
            before = (self._state, self._pos)
            getattr(self, "_" + self._state)(text, final, events)
            if (self._state, self._pos) == before:
                break
        if final:
            if self._state in ("args", "after"):
                events.append(CallEnd(len(self.calls) - 1))
            elif self._state in ("head", "block"):
                self._resolve_block(text[self._open :], events)
            self._state = "done"
            if self._spaces and not self.calls:
                events.append(Text(self._spaces))
            self._spaces = ""
        return _merged(events)

    def _emit_text(self, piece: str, events: list) -> None:
        if not piece:
            return
        if not piece.strip():
            self._spaces += piece
            return
        events.append(Text(self._spaces + piece))
        self._spaces = ""

    def _text(self, text: str, final: bool, events: list) -> None:
        start = text.find(OPEN, self._pos)
        if start >= 0:
            self._emit_text(text[self._pos : start], events)
            self._open, self._pos, self._state = start, start + len(OPEN), "head"
            return
        end = len(text) if final else len(text) - held_back(text[self._pos :])
        if end > self._pos:
            self._emit_text(text[self._pos : end], events)
            self._pos = end

    def _head(self, text: str, final: bool, events: list) -> None:
        head = text[self._pos :]
        match = _HEAD.match(head)
        if match and match.group(1) in self.known:
            call = {"id": "call_" + uuid.uuid4().hex[:24], "name": match.group(1), "arguments": ""}
            self.calls.append(call)
            events.append(CallStart(len(self.calls) - 1, call["id"], call["name"]))
            self._pos += match.end() - 1  # the arguments begin at their "{"
            self._state, self._depth, self._in_string, self._escaped = "args", 0, False, False
        elif match or CLOSE in head or len(head) > MAX_HEAD_CHARS:
            self._state = "block"

    def _args(self, text: str, final: bool, events: list) -> None:
        i = self._pos
        while i < len(text):
            ch = text[i]
            i += 1
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif ch == "\\":
                    self._escaped = True
                elif ch == '"':
                    self._in_string = False
            elif ch == '"':
                self._in_string = True
            elif ch in "{[":
                self._depth += 1
            elif ch in "}]":
                self._depth -= 1
                if self._depth == 0:
                    self._state = "after"
                    break
        piece = text[self._pos : i]
        if piece:
            self.calls[-1]["arguments"] += piece
            events.append(ArgumentsDelta(len(self.calls) - 1, piece))
        self._pos = i

    def _after(self, text: str, final: bool, events: list) -> None:
        end = text.find(CLOSE, self._pos)
        if end >= 0:
            events.append(CallEnd(len(self.calls) - 1))
            self._pos, self._state = end + len(CLOSE), "text"

    def _block(self, text: str, final: bool, events: list) -> None:
        end = text.find(CLOSE, self._pos)
        if end >= 0:
            self._pos, self._state = end + len(CLOSE), "text"
            self._resolve_block(text[self._open : self._pos], events)

    def _resolve_block(self, block: str, events: list) -> None:
        """A block read whole: its calls, or its text when it holds none."""
        _, calls = extract_tool_calls(block, self.tools)
        if not calls:
            self._emit_text(block, events)
        for call in calls:
            function = call["function"]
            self.calls.append(
                {"id": call["id"], "name": function["name"], "arguments": function["arguments"]}
            )
            k = len(self.calls) - 1
            events += [CallStart(k, call["id"], function["name"]), ArgumentsDelta(k, function["arguments"])]
            events.append(CallEnd(k))


def _merged(events: list) -> list:
    """Consecutive pieces of the same kind as one (a step that brought several characters)."""
    out: list = []
    for e in events:
        last = out[-1] if out else None
        if isinstance(e, Text) and isinstance(last, Text):
            last.text += e.text
        elif isinstance(e, ArgumentsDelta) and isinstance(last, ArgumentsDelta) and last.index == e.index:
            last.text += e.text
        else:
            out.append(e)
    return out
