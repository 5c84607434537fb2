"""The grammar caches (the server's check and the engine core's compile share runtime/sample/structured_output.py)
hold no client's schema text and stay under their byte bound, however many distinct schemas arrive."""

from __future__ import annotations

import json
import tracemalloc

from runtime.sample import structured_output
from runtime.sample.structured_output import _GrammarCache, check_structured_output
from scheduler import StructuredOutput


def big_schema(i: int) -> str:
    """About 100 kB of schema text that compiles to a small grammar (descriptions are not enforced)."""
    return json.dumps({"type": "object", "description": f"{i} " + "x" * 100_000, "properties": {}})


def test_distinct_schemas_cost_at_most_the_bound(monkeypatch):
    """40 distinct 100 kB schemas (4 MB of text, each grammar as big) through the server's check, with the
    grammar cache bounded at 1 MiB: what stays in memory is about the bound, not the 8 MB of the texts
    and their grammars (before, both caches kept every schema text as a key, 256 of them)."""
    monkeypatch.setattr(structured_output._grammars, "max_bytes", 1 << 20)
    check_structured_output(StructuredOutput("json_schema", big_schema(-1)))  # llguidance's own set-up
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for i in range(40):
            check_structured_output(StructuredOutput("json_schema", big_schema(i)))
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert structured_output._grammars.bytes <= 1 << 20
    assert grown < 2 << 20, f"the caches grew by {grown >> 10} KiB for 40 schemas of 100 kB"


def test_cache_stays_under_its_byte_bound_least_recently_used_first():
    cache = _GrammarCache(max_bytes=10_000)
    made = []

    def make(kind: str, spec: str) -> str:
        made.append(spec)
        return spec * 10  # 1,000 bytes of grammar per 100-character spec

    specs = [f"{i:0100d}" for i in range(30)]
    for spec in specs:
        assert cache.get("lark", spec, make) == spec * 10
        assert cache.bytes <= cache.max_bytes
    assert cache.get("lark", specs[-1], make) and len(made) == 30  # a recent one is still there
    cache.get("lark", specs[0], make)  # the oldest was dropped: made again
    assert len(made) == 31
    assert all(len(key[1]) == 32 for key in cache._values)  # keyed by SHA-256, not by the text
    assert cache.get("json_schema", specs[-1], make) and len(made) == 32  # the kind is part of the key
