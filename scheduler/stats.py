"""SchedulerStats: the scheduler's gauges and counters after a step, as one frozen value.

Made every step (Scheduler.stats()), sent with every StepOutput, and read by
the server's metrics and its queue shares. Fields are read as attributes;
`stats["num_running"]` and `stats.get("num_running", 0)` read the same field
by name, for readers that take names from a table (Prometheus collectors).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from operator import attrgetter
from typing import NamedTuple

_GETTERS: dict[type, attrgetter] = {}


def fields_of(obj) -> tuple:
    """A slotted dataclass's field values in order, for __reduce__: one C call instead of a getattr each."""
    cls = type(obj)
    get = _GETTERS.get(cls)
    if get is None:
        get = _GETTERS[cls] = attrgetter(*cls.__slots__) if cls.__slots__ else (lambda _: ())
    values = get(obj)
    return values if len(cls.__slots__) != 1 else (values,)


class _ByName:
    __slots__ = ()

    def __getitem__(self, name: str):
        try:
            return getattr(self, name)
        except AttributeError:
            raise KeyError(name) from None

    def get(self, name: str, default=None):
        return getattr(self, name, default)

    def __reduce__(self):  # rebuilt by its constructor: several times faster than dataclasses' own
        return type(self), fields_of(self)


class TenantStats(NamedTuple):
    """One tenant's tally. A named tuple rather than a dataclass: stats() carries one per tenant (up to
    max_idle_tenants idle ones too) in every step's message, and a tuple pickles several times faster."""

    counter: float = 0.0
    """The fair policy's virtual token counter (0 under policies that keep none)."""
    service_tokens: int = 0
    """Tokens served: prompt tokens at first admission (cache hits included) + generated tokens."""
    waiting: int = 0
    running: int = 0
    since: int = 0
    """Which tally of this scheduler this is: a tenant forgotten and back gets a new one (scheduler/tenants.py)."""
    prefix_hits: int = 0
    """Prompt tokens of this tenant's admissions found in the prefix cache (a recompute counts again)."""
    prefix_queries: int = 0
    """Prompt tokens of this tenant's admissions looked up in the prefix cache."""

    def __getitem__(self, key):  # by name as well as by position
        return getattr(self, key) if isinstance(key, str) else tuple.__getitem__(self, key)

    def get(self, name: str, default=None):
        return getattr(self, name, default)

    def __reduce__(self):
        return TenantStats, tuple(self)


@dataclass(frozen=True, slots=True)
class SchedulerStats(_ByName):
    num_running: int = 0
    num_waiting: int = 0
    """Requests queued, those whose grammar is still compiling included."""
    num_blocks: int = 0
    num_free_blocks: int = 0
    kv_usage: float = 0.0
    """Fraction of KV blocks in use (1 = full)."""
    num_cached_blocks: int = 0
    live_token_slots: int = 0
    """KV slots that hold a computed token of a running request (a shared prefix block counts once)."""
    allocated_token_slots: int = 0
    prefix_cache_queries: int = 0
    """Prompt tokens looked up in the prefix cache at admission."""
    prefix_cache_hits: int = 0
    num_preemptions: int = 0
    """Requests preempted for want of KV blocks."""
    num_displacements: int = 0
    """Requests preempted to give a sparse tenant a slot of a full batch (dlpm)."""
    computed_tokens: int = 0
    """Tokens run through the model (prefill chunks and decodes)."""
    generated_tokens: int = 0
    policy: str = ""
    tenants: dict[str, TenantStats] = field(default_factory=dict)
    """Tenants with a tally: those with requests and at most max_idle_tenants idle ones."""
    retired_service_tokens: int = 0
    """Service of the tenants forgotten after being idle longest (still part of the total)."""
    retired_prefix_hits: int = 0
    """Prefix-cache hits (tokens) of the tenants forgotten after being idle longest."""
    retired_prefix_queries: int = 0
    """Prefix-cache lookups (tokens) of the tenants forgotten after being idle longest."""
    spec_num_drafts: int = 0
    """Speculative decoding: decode steps that verified proposed tokens."""
    spec_num_draft_tokens: int = 0
    """Proposed tokens verified."""
    spec_num_accepted_tokens: int = 0
    """Proposed tokens accepted."""
    spec_accepted_per_pos: tuple[int, ...] = ()
    """Accepted proposals by their position in the proposal (0: the first proposed token)."""
    cpu_threads: int = 0
    """Compute threads the engine runs this step (set by the engine, not the scheduler; 0: not set)."""
    cpu_split: bool = False
    """The engine runs each decode step's rows split between its compute threads, each alone on its rows (set
    by the engine where others share the cores)."""
    cpu_contention: float = 0.0
    """Share of the compute threads' runnable time spent waiting for a core in the engine's last window of
    measurement (set by the engine)."""
