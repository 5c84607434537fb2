"""ToolCallStream on texts fed a few characters at a time: every split gives the same calls and content as
the whole text read at once (extract_tool_calls), and arguments go out before the call's text ends."""

from __future__ import annotations

import json

import pytest

from server.tools.tool_call_stream import ArgumentsDelta, CallEnd, CallStart, Text, ToolCallStream
from server.tools.tool_calls import ToolRequest, extract_tool_calls

TOOLS = ToolRequest(
    [
        {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}},
        {"type": "function", "function": {"name": "add"}},
    ],
    "auto",
)
ARGUMENTS = '{"city": "Paris", "days": [1, 2], "q": "a\\"}"}'
CALL = '<tool_call>\n{"name": "get_weather", "arguments": ' + ARGUMENTS + "}\n</tool_call>"
TEXTS = [
    CALL,
    "Let me check.\n" + CALL,
    CALL + "\n" + CALL.replace("get_weather", "add"),
    '<tool_call>\n{"arguments": {"a": 1}, "name": "add"}\n</tool_call>',  # another key order: held whole
    '<tool_call>\n[{"name": "add", "arguments": {}}]\n</tool_call>',
    '<tool_call>\n{"name": "unknown", "arguments": {}}\n</tool_call> done',
    "No call here, just <tool_ text.",
    '<tool_call>\n{"name": "add", "arguments": {"a": 1',  # cut off by max_tokens
]


def replay(text: str, step: int) -> list:
    stream = ToolCallStream(TOOLS)
    events = []
    for end in range(step, len(text) + step, step):
        events += stream.feed(text[:end], final=end >= len(text))
    return events


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("step", [1, 3, 7, 1000])
def test_events_rebuild_what_the_whole_text_holds(text, step):
    events = replay(text, step)
    content = "".join(e.text for e in events if isinstance(e, Text))
    calls = {}
    for e in events:
        if isinstance(e, CallStart):
            calls[e.index] = [e.name, ""]
        elif isinstance(e, ArgumentsDelta):
            calls[e.index][1] += e.text
    ends = [e.index for e in events if isinstance(e, CallEnd)]
    assert ends == sorted(calls)
    expected_content, expected = extract_tool_calls(text, TOOLS)
    if text.endswith('{"a": 1'):  # a cut-off call streams as far as it got
        assert calls == {0: ["add", '{"a": 1']} and content == ""
        return
    assert [c[0] for c in calls.values()] == [c["function"]["name"] for c in expected]
    for (_, arguments), call in zip(calls.values(), expected):
        assert json.loads(arguments) == json.loads(call["function"]["arguments"])
    assert content.strip() == (expected_content or "").strip() if expected else content == text


def test_arguments_stream_before_the_call_is_written():
    events = replay(CALL, 2)
    pieces = [i for i, e in enumerate(events) if isinstance(e, ArgumentsDelta)]
    assert len(pieces) >= 10 and pieces[0] == 1 and isinstance(events[0], CallStart)
