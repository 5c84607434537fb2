"""Check a JSON value against the JSON Schema that documents it, with an error naming the field.

The request fields (server/schema/request_fields.py) are declared once, as JSON Schema; /openapi.json publishes
those schemas and this module enforces them, so what is documented and what is accepted cannot drift.
It reads the subset the fields use: type (a name or a list), enum, const, minimum, maximum,
exclusiveMinimum, minLength, maxLength, pattern, minItems, maxItems, items, properties, required,
minProperties, maxProperties, additionalProperties (a schema), propertyNames and oneOf. Counts and
lengths are checked before the items, so an oversized value is refused without walking it. `title`, where
a schema has one, is the phrase an error uses for what the value must be.

A null property counts as absent (clients such as LangChain send `"stop": null`), so a required one that
is null is missing. An integer is a JSON number without a fraction *and* not a boolean, as Python reads it.
"""

from __future__ import annotations

import re

from server.errors import bad_request

_NAMES = {
    "integer": "an integer",
    "number": "a number",
    "string": "a string",
    "boolean": "a boolean",
    "array": "an array",
    "object": "an object",
    "null": "null",
}
_INTEGER = {"type": "integer"}


def check(value, schema: dict, path: str) -> None:
    """Raise a 400 APIError naming `path` (e.g. "messages[0].role") if value does not fit schema."""
    if "oneOf" in schema:
        branches = schema["oneOf"]
        if any(fits(value, b) for b in branches):
            return
        meant = _meant(value, branches)
        if meant is not None and "title" not in schema:  # the branch the client meant: its error is precise
            check(value, meant, path)
        _fail(schema, value, path)
    if not _type_ok(value, schema.get("type")):
        _fail(schema, value, path)
    if "const" in schema and not _equal(value, schema["const"]):
        _fail(schema, value, path)
    if "enum" in schema and not any(_equal(value, e) for e in schema["enum"]):
        _fail(schema, value, path)
    if _is_number(value):
        _check_range(value, schema, path)
    elif isinstance(value, str):
        _check_size(value, schema, path, "Length", "must not be empty", "may be at most {} characters")
        if "pattern" in schema and not re.search(schema["pattern"], value):
            _fail(schema, value, path)
    elif isinstance(value, list):
        _check_size(value, schema, path, "Items", "must be a non-empty array", "may hold at most {} items")
        if "items" in schema and not (schema["items"] == _INTEGER and all(type(v) is int for v in value)):
            for i, item in enumerate(value):  # (an array of token ids is checked at C speed above)
                check(item, schema["items"], f"{path}[{i}]")
    elif isinstance(value, dict):
        check_object(value, schema, path)


def check_object(value: dict, schema: dict, path: str) -> None:
    properties = schema.get("properties", {})
    _check_size(value, schema, path, "Properties", "must not be empty", "may hold at most {} entries")
    prefix = f"{path}." if path else ""
    for name, item in value.items():
        if item is None:
            continue
        if name in properties:
            check(item, properties[name], prefix + name)
            continue
        if "propertyNames" in schema and not fits(name, schema["propertyNames"]):
            raise bad_request(
                f"'{path}' keys must be {describe(schema['propertyNames'])}, got {_show(name)}", path
            )
        if isinstance(schema.get("additionalProperties"), dict):
            check(item, schema["additionalProperties"], prefix + name)
    for name in schema.get("required", ()):
        if value.get(name) is None:
            raise bad_request(f"'{prefix}{name}' is required", prefix + name, "missing_required_parameter")


def _check_size(value, schema: dict, path: str, counted: str, empty: str, at_most: str) -> None:
    """len(value) against the schema's min<counted> and max<counted> (Length, Items, Properties): `empty` is
    the error for a minimum of 1, `at_most` the one for the maximum ({} stands for it)."""
    size = len(value)
    if size < schema.get("min" + counted, 0):
        _fail(schema, value, path, empty if schema["min" + counted] == 1 else None)
    if size > schema.get("max" + counted, size):
        _fail(schema, value, path, f"{at_most.format(schema['max' + counted])}, got {size}")


def _meant(value, branches: list[dict]) -> dict | None:
    """The one branch of a oneOf the value was meant for: the only one of its JSON type, else (an array)
    the only one whose items take its first item."""
    same_type = [b for b in branches if _type_ok(value, b.get("type"))]
    if len(same_type) > 1 and isinstance(value, list) and value:
        same_type = [b for b in same_type if fits(value[0], b.get("items", {}))]
    return same_type[0] if len(same_type) == 1 else None


def fits(value, schema: dict) -> bool:
    try:
        check(value, schema, "")
    except Exception:
        return False
    return True


def describe(schema: dict) -> str:
    """What a value of this schema is, in words: "a string or an array of strings"."""
    if "title" in schema:
        return schema["title"]
    if "const" in schema:
        return repr(schema["const"])
    if "enum" in schema:
        return "one of " + ", ".join(repr(e) for e in schema["enum"])
    if "oneOf" in schema:
        return " or ".join(describe(b) for b in schema["oneOf"])
    kinds = schema.get("type")
    if kinds is None:
        return "a value"
    kinds = [kinds] if isinstance(kinds, str) else kinds
    words = []
    for kind in kinds:
        if kind == "array" and "items" in schema:
            words.append(f"an array of {_plural(describe(schema['items']))}")
        else:
            words.append(_NAMES[kind])
    return " or ".join(words)


def _plural(phrase: str) -> str:
    for article in ("an ", "a "):
        if phrase.startswith(article) and " or " not in phrase and " of " not in phrase:
            return phrase[len(article) :] + "s"
    return phrase


def _check_range(value, schema: dict, path: str) -> None:
    low, high = schema.get("minimum"), schema.get("maximum")
    open_low = "exclusiveMinimum" in schema
    if open_low:
        low = schema["exclusiveMinimum"]
    if low is None and high is None:
        return
    # `not (inside)` also catches NaN, which compares false with everything
    inside = (low is None or (value > low if open_low else value >= low)) and (high is None or value <= high)
    if inside:
        return
    if low is not None and high is not None:
        words = f"must be in {'(' if open_low else '['}{low}, {high}]"
    elif low is not None:
        words = f"must be greater than {low}" if open_low else f"must be at least {low}"
    else:
        words = f"must be at most {high}"
    _fail(schema, value, path, f"{words}, got {_show(value)}")


def _fail(schema: dict, value, path: str, words: str | None = None):
    if words is None or "title" in schema:
        words = f"must be {describe(schema)}, got {_what(value)}"
    branches = schema.get("oneOf", [schema])
    code = "invalid_value" if any(_type_ok(value, b.get("type")) for b in branches) else "invalid_type"
    raise bad_request(f"'{path or 'body'}' {words}", path or None, code)


def _type_ok(value, kinds) -> bool:
    if kinds is None:
        return True
    kinds = [kinds] if isinstance(kinds, str) else kinds
    return any(_is(value, kind) for kind in kinds)


def _is(value, kind: str) -> bool:
    if kind == "integer":
        return isinstance(value, int) and not isinstance(value, bool)
    if kind == "number":
        return _is_number(value)
    if kind == "boolean":
        return isinstance(value, bool)
    if kind == "string":
        return isinstance(value, str)
    if kind == "array":
        return isinstance(value, list)
    if kind == "object":
        return isinstance(value, dict)
    return value is None  # "null"


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _equal(value, expected) -> bool:
    return type(value) is type(expected) and value == expected


def _what(value) -> str:
    """The client's value for an error: its JSON type, and the value itself when it is short."""
    if isinstance(value, bool):
        return f"a boolean ({'true' if value else 'false'})"
    if isinstance(value, (dict, list)):
        return _NAMES["object" if isinstance(value, dict) else "array"]
    if value is None:
        return "null"
    kind = "a string" if isinstance(value, str) else "an integer" if isinstance(value, int) else "a number"
    return f"{kind} {_show(value)}"


def _show(value) -> str:
    """A client's value for an error message, cut short (an integer may have thousands of digits)."""
    text = repr(value)
    return text if len(text) <= 40 else text[:20] + "..." + text[-8:]


def for_log(text: str) -> str:
    """A client's string (a field name, a `user`) for a log line: as it is when short and printable, else
    escaped and cut short (a newline or a terminal escape in it must not forge or hide log lines)."""
    return text if len(text) <= 40 and text.isprintable() else _show(text)
