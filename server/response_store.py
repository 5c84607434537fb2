"""The conversations behind recent Responses, for `previous_response_id`: per tenant, bounded.

A tenant sees only its own responses. Each tenant keeps its most recent MAX_PER_TENANT conversations of
at most MAX_CHARS_PER_TENANT characters in all; the least recently used tenant is forgotten beyond
MAX_TENANTS. What is kept is the chat messages (input and output) the response continued from, so a
follow-up is rendered exactly as if the client had sent the whole history.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict

MAX_PER_TENANT = 256
MAX_CHARS_PER_TENANT = 16 << 20
MAX_TENANTS = 1024


class ResponseStore:
    def __init__(
        self,
        max_per_tenant: int = MAX_PER_TENANT,
        max_chars_per_tenant: int = MAX_CHARS_PER_TENANT,
        max_tenants: int = MAX_TENANTS,
    ):
        self.max_per_tenant = max_per_tenant
        self.max_chars = max_chars_per_tenant
        self.max_tenants = max_tenants
        self._tenants: OrderedDict[str, OrderedDict[str, tuple[list[dict], int]]] = OrderedDict()
        self._chars: dict[str, int] = {}
        self._lock = threading.Lock()  # handlers prepare bodies on worker threads too

    def put(self, tenant: str, response_id: str, messages: list[dict]) -> None:
        size = len(json.dumps(messages))
        if size > self.max_chars:
            return  # one conversation larger than the tenant's whole share is not kept
        with self._lock:
            kept = self._tenants.setdefault(tenant, OrderedDict())
            self._tenants.move_to_end(tenant)
            kept[response_id] = (messages, size)
            self._chars[tenant] = self._chars.get(tenant, 0) + size
            while len(kept) > self.max_per_tenant or self._chars[tenant] > self.max_chars:
                _, (_, dropped) = kept.popitem(last=False)
                self._chars[tenant] -= dropped
            while len(self._tenants) > self.max_tenants:
                gone, _ = self._tenants.popitem(last=False)
                del self._chars[gone]

    def get(self, tenant: str, response_id: str) -> list[dict] | None:
        """A copy of the conversation, or None (unknown, another tenant's, or forgotten)."""
        with self._lock:
            kept = self._tenants.get(tenant)
            if kept is None or response_id not in kept:
                return None
            kept.move_to_end(response_id)
            return [dict(m) for m in kept[response_id][0]]
