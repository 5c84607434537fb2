"""API keys: who is calling, which tenant they bill to, and their weight under fair scheduling.

The keys file is a JSON object {"sk-...": {"tenant": "a", "weight": 2}}; optional per key:
"prefix_cache_group": "g" (tenants naming the same group share prefix-cache blocks; by default each
tenant's cache is its own) and "priority_range": [-10, 100] (the request priorities it may use; by
default [0, 2**20]: a client may only make its own requests less urgent).
Keys given with --api-key (repeatable) authenticate without naming a tenant. Without keys, or with
such a key, the tenant is the request's `user` field, else "default"; beside a key file it is
"user:<user>", so that a `user` never shares a keyed tenant's prefix cache or counter. /health, /version,
/openapi.json and (unless --metrics-auth) /metrics stay open, as in vLLM.
"""

from __future__ import annotations

import hmac
import json
from dataclasses import dataclass
from pathlib import Path

from server.errors import APIError

PRIORITY_MAX = 1 << 20
USER_TENANTS = "user:"
"""Beside a key file, the tenants that callers name with `user` are named with this prefix (which the
file's tenants may not use)."""


@dataclass(frozen=True)
class Tenant:
    name: str
    weight: float = 1.0
    priority_range: tuple[int, int] = (0, PRIORITY_MAX)
    """The request `priority` values this tenant may ask for (lower runs first under --policy priority).
    By default a client may only lower its own urgency (>= 0); a key file entry may grant more."""
    prefix_cache_group: str | None = None
    """Tenants naming the same group share prefix-cache blocks; by default each tenant has its own, so
    cache hits (usage.prompt_tokens_details.cached_tokens) reveal nothing about other tenants' prompts."""

    @property
    def cache_salt(self) -> str:
        return f"group:{self.prefix_cache_group}" if self.prefix_cache_group else f"tenant:{self.name}"


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
        if entry["tenant"].startswith(USER_TENANTS):
            raise ValueError(
                f"--api-keys: tenant {entry['tenant']!r}: names beginning with {USER_TENANTS!r} are the "
                f"tenants callers name with `user` (with a key of --api-key); choose another name"
            )
        weight = entry.get("weight", 1)
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or weight <= 0:
            raise ValueError(f"--api-keys: tenant {entry['tenant']!r}: weight must be a positive number")
        group = entry.get("prefix_cache_group")
        if group is not None and (not isinstance(group, str) or not group):
            raise ValueError(
                f"--api-keys: tenant {entry['tenant']!r}: prefix_cache_group must be a "
                f"non-empty string (tenants naming the same group share cached prompt blocks)"
            )
        keys[key] = Tenant(entry["tenant"], float(weight), _priority_range(entry), group)
    return keys


def api_keys(path: str | Path | None, plain: list[str]) -> dict[str, Tenant | None] | None:
    """The keys the server accepts: the file's (each names its tenant) and each --api-key (None: the
    tenant is the request's `user`, as without keys); None when neither is given (no key needed)."""
    keys: dict[str, Tenant | None] = dict(load_api_keys(path)) if path else {}
    for key in plain:
        if not key.strip():
            raise ValueError("--api-key: a key must not be empty")
        keys.setdefault(key, None)  # a key in the file keeps its tenant
    return keys or None


def _priority_range(entry: dict) -> tuple[int, int]:
    given = entry.get("priority_range", [0, PRIORITY_MAX])
    if not (
        isinstance(given, list)
        and len(given) == 2
        and all(isinstance(v, int) and not isinstance(v, bool) for v in given)
        and given[0] <= given[1]
    ):
        raise ValueError(
            f"--api-keys: tenant {entry['tenant']!r}: priority_range must be [lowest, highest] "
            f"integers (lower runs first)"
        )
    return given[0], given[1]


def authenticate(
    keys: dict[str, Tenant | None] | None, authorization: str | None, user: str | None
) -> Tenant:
    return check_key(keys, authorization) or user_tenant(keys, user)


def user_tenant(keys: dict[str, Tenant | None] | None, user: str | None) -> Tenant:
    """The tenant of a caller whose key names none (no keys, or a key of --api-key): its `user`, else
    "default". Beside a key file such a tenant is "user:<user>", in a namespace of its own: a `user`
    that spells a keyed tenant's name must not share its prefix cache (and learn its prompts from
    cache hits) nor be billed to its counter."""
    name = user if isinstance(user, str) and user else "default"
    if keys and any(tenant is not None for tenant in keys.values()):
        name = USER_TENANTS + name
    return Tenant(name)


def check_key(keys: dict[str, Tenant | None] | None, authorization: str | None) -> Tenant | None:
    """The key's tenant, a 401 if keys are configured and this is not one of them, None without keys
    (or for a key given with --api-key, which names no tenant).

    Needs only the headers: call it before reading or parsing the body, so an unauthenticated
    client costs no work."""
    if not keys:
        return None
    if not authorization or not authorization.startswith("Bearer "):
        raise APIError(401, "Missing API key: send 'Authorization: Bearer YOUR_KEY'.", code="invalid_api_key")
    # aiohttp keeps undecodable header bytes as surrogates; encode them back instead of failing on them
    given = authorization[len("Bearer ") :].strip().encode("utf-8", "surrogateescape")
    for key, tenant in keys.items():
        if hmac.compare_digest(key.encode(), given):
            return tenant
    raise APIError(401, "Incorrect API key provided.", code="invalid_api_key")


def bearer_or_api_key(headers) -> str | None:
    """The Authorization header, or Anthropic's `x-api-key` as if sent as a Bearer token."""
    authorization = headers.get("Authorization")
    if authorization is None and headers.get("x-api-key"):
        return "Bearer " + headers["x-api-key"]
    return authorization
