"""API keys: who is calling, which tenant they bill to, and their weight under fair scheduling.

The keys file is a JSON object {"sk-...": {"tenant": "a", "weight": 2}}. Without
keys, the tenant is the request's `user` field, else "default".
"""
from __future__ import annotations

import hmac
import json
from dataclasses import dataclass
from pathlib import Path

from server.errors import APIError


@dataclass(frozen=True)
class Tenant:
    name: str
    weight: float = 1.0


def load_api_keys(path: str | Path) -> dict[str, Tenant]:
    try:
        raw = json.loads(Path(path).read_text())
    except OSError as exc:
        raise ValueError(f"--api-keys: cannot read {str(path)!r}: {exc.strerror}") from exc
    except json.JSONDecodeError as exc:
        raise ValueError(f"--api-keys: {str(path)!r} is not valid JSON: {exc}") from exc
    if not isinstance(raw, dict) or not raw:
        raise ValueError('--api-keys: expected a JSON object {"KEY": {"tenant": "...", "weight": 1}}')
    keys = {}
    for key, entry in raw.items():
        if not isinstance(entry, dict) or not isinstance(entry.get("tenant"), str) or not entry["tenant"]:
            raise ValueError(f"--api-keys: key {key[:6]!r}...: needs a non-empty string 'tenant'")
        weight = entry.get("weight", 1)
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or weight <= 0:
            raise ValueError(f"--api-keys: tenant {entry['tenant']!r}: weight must be a positive number")
        keys[key] = Tenant(entry["tenant"], float(weight))
    return keys


def authenticate(keys: dict[str, Tenant] | None, authorization: str | None, user: str | None) -> Tenant:
    if not keys:
        return Tenant(user if isinstance(user, str) and user else "default")
    if not authorization or not authorization.startswith("Bearer "):
        raise APIError(401, "Missing API key: send 'Authorization: Bearer YOUR_KEY'.", code="invalid_api_key")
    # aiohttp keeps undecodable header bytes as surrogates; encode them back instead of failing on them
    given = authorization[len("Bearer "):].strip().encode("utf-8", "surrogateescape")
    for key, tenant in keys.items():
        if hmac.compare_digest(key.encode(), given):
            return tenant
    raise APIError(401, "Incorrect API key provided.", code="invalid_api_key")
