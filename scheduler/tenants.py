"""Per-tenant tallies (service, waiting, running) and the forgetting of long-idle tenants.

Tenants named by the free-form `user` field come and go. A tenant with no
waiting or running request is idle; beyond max_idle_tenants idle ones, the one
idle longest is forgotten: its tally goes, and its service joins
retired_service_tokens so the total is kept. Memory and stats() then stay
bounded however many names were ever seen.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from scheduler.stats import TenantStats


@dataclass
class TenantTally:
    service_tokens: int = 0
    """Tokens served: prompt tokens at first admission (cache hits included) + generated tokens."""
    prefix_hits: int = 0
    """Prompt tokens of this tenant's admissions found in the prefix cache."""
    prefix_queries: int = 0
    """Prompt tokens of this tenant's admissions looked up in the prefix cache."""
    waiting: int = 0
    running: int = 0
    since: int = 0
    """Which tally of this scheduler this is (a count): a tenant forgotten and back gets a new one, so a
    reader of stats() can tell its service restarted from 0 even when it has grown past the old value."""


class Tenants:
    def __init__(self, max_idle_tenants: int):
        self.max_idle_tenants = max_idle_tenants
        self._tallies: dict[str, TenantTally] = {}
        self._idle: OrderedDict[str, None] = OrderedDict()
        """Tenants with a tally but no waiting or running request, longest idle first."""
        self._made = 0
        self.retired_service_tokens = 0
        """Service of the tenants forgotten after being idle longest (still part of the total)."""
        self.retired_prefix_hits = 0
        """Prefix-cache hits and lookups (tokens) of the tenants forgotten (still part of the totals)."""
        self.retired_prefix_queries = 0

    def __getitem__(self, tenant: str) -> TenantTally:
        return self._tallies[tenant]

    def get(self, tenant: str) -> TenantTally | None:
        return self._tallies.get(tenant)

    def busy(self, tenant: str) -> TenantTally:
        """The tally of a tenant that has a request now (a new one if it had none)."""
        tally = self._tallies.get(tenant)
        if tally is None:
            self._made += 1
            tally = self._tallies[tenant] = TenantTally(since=self._made)
        self._idle.pop(tenant, None)
        return tally

    def settle(self, tenant: str) -> str | None:
        """Note that one of the tenant's requests ended; returns a tenant forgotten now, if any."""
        tally = self._tallies[tenant]
        if tally.waiting or tally.running:
            return None
        self._idle[tenant] = None
        if len(self._idle) <= self.max_idle_tenants:
            return None
        forgotten = self._idle.popitem(last=False)[0]
        tally = self._tallies.pop(forgotten)
        self.retired_service_tokens += tally.service_tokens
        self.retired_prefix_hits += tally.prefix_hits
        self.retired_prefix_queries += tally.prefix_queries
        return forgotten

    def stats(self, counters: dict[str, float]) -> dict[str, TenantStats]:
        return {
            t: TenantStats(
                counters.get(t, 0.0),
                tally.service_tokens,
                tally.waiting,
                tally.running,
                tally.since,
                tally.prefix_hits,
                tally.prefix_queries,
            )
            for t, tally in self._tallies.items()
        }
