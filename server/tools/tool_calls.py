"""Function calling: the request's `tools` and `tool_choice`, and the `tool_calls` read back from the text.

The model writes a call as `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (the syntax the tools
prompt, runtime/model/chat_template.py, asks for). tool_choice:

    none       tools are described to the model; its text is returned as content
    auto       unconstrained; calls found in the text become tool_calls (finish_reason "tool_calls")
    required   the output is constrained to one call of any tool, its arguments by that tool's schema
    {"type": "function", "function": {"name": F}}    the same, for F only
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from runtime.sample.structured_output import JSON_WHITESPACE
from scheduler import StructuredOutput
from server.errors import bad_request
from server.schema.request_fields import MAX_SCHEMA_CHARS
from server.schema.schema_check import _show

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_CALL = re.compile(re.escape(OPEN) + r"\s*(.*?)\s*" + re.escape(CLOSE), re.DOTALL)
_NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")


@dataclass
class ToolRequest:
    tools: list[dict]
    """Each {"type": "function", "function": {"name", "description"?, "parameters"?}}, as sent."""
    choice: str
    """'none', 'auto', 'required', or 'named'."""
    name: str | None = None
    """The function tool_choice names (choice 'named')."""

    @property
    def functions(self) -> list[dict]:
        return [t["function"] for t in self.tools]

    @property
    def constrained(self) -> bool:
        return self.choice in ("required", "named")

    def structured_output(self) -> StructuredOutput | None:
        """required / named: exactly one call, in the tags, its arguments valid for the function's schema."""
        if not self.constrained:
            return None
        calls = [
            {
                "type": "object",
                "properties": {
                    "name": {"const": f["name"]},
                    "arguments": f.get("parameters") or {"type": "object"},
                },
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
            for f in self.functions
            if self.choice == "required" or f["name"] == self.name
        ]
        schema = calls[0] if len(calls) == 1 else {"anyOf": calls}
        text = json.dumps({**schema, "x-guidance": {"whitespace_pattern": JSON_WHITESPACE}})
        if len(text) > MAX_SCHEMA_CHARS:
            raise bad_request(
                f"the schema of the calls 'tool_choice' allows is {len(text):,} characters as JSON, more "
                f"than the {MAX_SCHEMA_CHARS:,} allowed; send fewer or smaller tools, or name one",
                "tools",
            )
        tags = json.dumps(OPEN + "\n"), json.dumps("\n" + CLOSE)
        grammar = f"start: {tags[0]} call {tags[1]}\ncall: %json {text}"
        return StructuredOutput("lark", grammar, source="tools")


def parses_tool_calls(tools: ToolRequest | None) -> bool:
    """Calls in the text become tool_calls unless tool_choice is 'none'."""
    return tools is not None and tools.choice != "none"


def parse_tools(body: dict) -> ToolRequest | None:
    """The request's tools and tool_choice, checked; None when it sends no tools."""
    tools = body.get("tools")
    choice = body.get("tool_choice")
    if tools in (None, []):
        if choice not in (None, "none"):
            raise bad_request(
                "'tool_choice' needs 'tools': send the functions the model may call", "tool_choice"
            )
        return None
    if body.get("functions"):
        raise bad_request("send 'tools' or the deprecated 'functions', not both", "functions")
    if not isinstance(tools, list):
        raise bad_request("'tools' must be an array of function tools", "tools")
    names: set[str] = set()
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if (
            not isinstance(tool, dict)
            or tool.get("type") != "function"
            or not isinstance(tool.get("function"), dict)
        ):
            raise bad_request(f'\'{where}\' must be {{"type": "function", "function": {{...}}}}', where)
        function = tool["function"]
        name = function.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise bad_request(
                f"'{where}.function.name' must be 1-64 letters, digits, '_', '.' or '-', got {_show(name)}",
                f"{where}.function.name",
            )
        if name in names:
            raise bad_request(f"'{where}.function.name' {name!r} is given twice", f"{where}.function.name")
        names.add(name)
        parameters = function.get("parameters")
        if parameters is not None and not isinstance(parameters, dict):
            raise bad_request(
                f"'{where}.function.parameters' must be a JSON schema object", f"{where}.function.parameters"
            )
        if function.get("description") is not None and not isinstance(function["description"], str):
            raise bad_request(
                f"'{where}.function.description' must be a string", f"{where}.function.description"
            )
    if choice is None:
        choice = "auto"
    if isinstance(choice, str):
        if choice not in ("none", "auto", "required"):
            raise bad_request(
                f"'tool_choice' must be 'none', 'auto', 'required' or a named function, got {choice!r}",
                "tool_choice",
            )
        return ToolRequest(tools, choice)
    function = choice.get("function") if isinstance(choice, dict) else None
    named = function.get("name") if isinstance(function, dict) else None
    if not isinstance(choice, dict) or choice.get("type") != "function" or not isinstance(named, str):
        raise bad_request(
            "'tool_choice' must be 'none', 'auto', 'required' or "
            '{"type": "function", "function": {"name": ...}}',
            "tool_choice",
        )
    if named not in names:
        raise bad_request(
            f"'tool_choice' names {_show(named)}, which is not among 'tools' (" + _listed(tools) + ")",
            "tool_choice",
        )
    return ToolRequest(tools, "named", named)


def _listed(tools: list[dict], most: int = 8) -> str:
    """The first few tool names, for an error message (a request may send up to 128)."""
    names = [t["function"]["name"] for t in tools[:most]]
    return ", ".join(names) + (f", ... {len(tools) - most} more" if len(tools) > most else "")


def extract_tool_calls(text: str, tools: ToolRequest) -> tuple[str | None, list[dict]]:
    """(content left outside the calls or None, tool_calls) from the generated text. A block that is
    not a JSON call of a known function stays in the content."""
    known = {f["name"] for f in tools.functions}
    calls, kept, last = [], [], 0
    for match in _CALL.finditer(text):
        try:
            call = json.loads(match.group(1))
        except ValueError:
            continue
        if isinstance(call, list):  # some models write one block holding several calls
            found = call
        else:
            found = [call]
        parsed = [c for c in found if isinstance(c, dict) and c.get("name") in known]
        if not parsed or len(parsed) != len(found):
            continue
        kept.append(text[last : match.start()])
        last = match.end()
        for c in parsed:
            arguments = c.get("arguments", c.get("parameters", {}))
            calls.append(
                {
                    "id": "call_" + uuid.uuid4().hex[:24],
                    "type": "function",
                    "function": {
                        "name": c["name"],
                        "arguments": arguments if isinstance(arguments, str) else json.dumps(arguments),
                    },
                }
            )
    kept.append(text[last:])
    content = "".join(kept).strip()
    return (content or None) if calls else text, calls


def held_back(text: str) -> int:
    """Characters at the end of a streamed text that may begin a tool call: not sent as content yet."""
    start = text.find(OPEN)
    if start >= 0:
        return len(text) - start
    for k in range(min(len(OPEN) - 1, len(text)), 0, -1):
        if OPEN.startswith(text[-k:]):
            return k
    return 0
