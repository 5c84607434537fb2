"""Validate a custom resource against its CustomResourceDefinition, as an API server with strict field
validation would: the version's OpenAPI v3 schema (types, enums, bounds, patterns, required), unknown
fields rejected unless the schema preserves them, and the `x-kubernetes-validations` CEL rules evaluated
with cel-python."""

from __future__ import annotations

import functools

import celpy
import jsonschema
import yaml


def load_crd(path: str) -> dict:
    with open(path) as f:
        return yaml.safe_load(f)


def version_schema(crd: dict, api_version: str) -> dict:
    group, _, version = api_version.partition("/")
    if group != crd["spec"]["group"]:
        raise ValueError(f"{api_version} is not in the CRD's group {crd['spec']['group']}")
    for v in crd["spec"]["versions"]:
        if v["name"] == version:
            if not v.get("served", True):
                raise ValueError(f"{api_version} is not served")
            return v["schema"]["openAPIV3Schema"]
    raise ValueError(f"{api_version}: the CRD has no version {version}")


def errors(doc: dict, crd: dict) -> list[str]:
    """Every violation of the CRD's schema by `doc`, as 'path: message' lines (empty when valid)."""
    if doc.get("kind") != crd["spec"]["names"]["kind"]:
        return [f"kind: {doc.get('kind')} is not {crd['spec']['names']['kind']}"]
    schema = version_schema(crd, doc["apiVersion"])
    found = [
        f"{'.'.join(map(str, e.absolute_path)) or '<root>'}: {e.message}"
        for e in jsonschema.Draft7Validator(schema).iter_errors(doc)
    ]
    _walk(doc, schema, "", found)
    return found


def _walk(value, schema: dict, path: str, found: list[str]) -> None:
    for rule in schema.get("x-kubernetes-validations", []):
        message = rule.get("message", rule["rule"])
        try:
            ok = bool(_program(rule["rule"]).evaluate({"self": celpy.json_to_cel(value)}))
        except Exception as e:  # a rule that cannot be evaluated on this value fails it, as on a server
            ok, message = False, f"{message} ({e})"
        if not ok:
            found.append(f"{path or '<root>'}: {message}")
    if isinstance(value, dict):
        properties = schema.get("properties")
        if properties is not None:
            preserve = schema.get("x-kubernetes-preserve-unknown-fields") or schema.get(
                "additionalProperties"
            )
            for key, item in value.items():
                if key in properties:
                    _walk(item, properties[key], f"{path}.{key}", found)
                elif not preserve:
                    found.append(f"{path or '<root>'}: unknown field {key!r}")
        elif isinstance(schema.get("additionalProperties"), dict):
            for key, item in value.items():
                _walk(item, schema["additionalProperties"], f"{path}.{key}", found)
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        for i, item in enumerate(value):
            _walk(item, schema["items"], f"{path}[{i}]", found)


@functools.cache
def _program(rule: str):
    """A CEL rule compiled once, however many values it is evaluated on."""
    env = celpy.Environment()
    return env.program(env.compile(rule))
