"""Loader counters as a dict (`DataLoader.stats()`) and as Prometheus metrics.

Counters live in shared memory, one row per process (prefetcher, main, each worker), so
workers report without messages. Every DataLoader registers itself (weakly) with one
collector in prometheus_client's default registry; series are labelled by the loader's `name`
and named `prescient:loader_*`, under the server's prefix. A training script serves them in the
text format (`generate_latest()`, as deploy/examples/train/train.py does): the OpenMetrics output
of prometheus_client 0.26, which its `start_http_server` sends to Prometheus, writes the sample
names with `_` for `:`.
"""

from __future__ import annotations

import threading
import weakref

from loader.cache.ram import (
    DIRECT_READS,
    DISK_HITS,
    PEER_READS,
    RAM_HITS,
    SAMPLES,
    STORAGE_BYTES,
    STORAGE_READS,
    WAIT_NS,
)

PREFIX = "prescient:loader_"
_COUNTERS = {  # stats key -> (counter column, Prometheus help)
    "samples": (SAMPLES, "Samples fetched for the training loop (by workers or the main process)."),
    "storage_reads": (STORAGE_READS, "Samples read from the dataset's storage."),
    "storage_bytes": (STORAGE_BYTES, "Bytes read from the dataset's storage."),
    "ram_hits": (RAM_HITS, "Samples served from shared memory without a storage read."),
    "disk_hits": (DISK_HITS, "Samples served from the local-disk tier."),
    "peer_reads": (PEER_READS, "Samples received from another rank instead of storage."),
    "direct_reads": (DIRECT_READS, "Storage reads made by workers outside the plan."),
}


def collect_stats(engine) -> dict:
    shared = engine.shared
    totals = shared.counters.sum(axis=0) if shared is not None else None
    out = {key: int(totals[column]) if totals is not None else 0 for key, (column, _) in _COUNTERS.items()}
    out["stall_seconds"] = engine.stall_seconds
    out["worker_wait_seconds"] = float(totals[WAIT_NS]) / 1e9 if totals is not None else 0.0
    out["batches"] = engine.batches
    out["epochs"] = engine.epochs_begun
    out["peer_failures"] = engine.prefetcher.peer_failures if engine.prefetcher is not None else 0
    usage = engine.prefetcher.usage() if engine.prefetcher is not None else {}
    for key in (
        "cache_ram_bytes",
        "cache_ram_peak_bytes",
        "cache_ram_samples",
        "staging_bytes",
        "staging_peak_bytes",
        "cache_disk_bytes",
        "cache_disk_peak_bytes",
        "cache_disk_samples",
    ):
        out[key] = usage.get(key, 0)
    out["disk_tier_enabled"] = usage.get("disk_tier_enabled", False)
    lay = shared.layout if shared is not None else None
    out["shared_memory_bytes"] = lay.arena + lay.fill_rings * lay.fill_bytes if lay is not None else 0
    return out


_loaders: weakref.WeakSet = weakref.WeakSet()
_registered = False
_lock = threading.Lock()


class _Collector:
    """Reads every live loader's stats at scrape time."""

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        loaders = list(_loaders)
        families = {
            key: CounterMetricFamily(PREFIX + key, help_, labels=["loader"])
            for key, (_, help_) in _COUNTERS.items()
        }
        families["stall_seconds"] = CounterMetricFamily(
            PREFIX + "stall_seconds", "Seconds the training loop waited for a batch.", labels=["loader"]
        )
        families["batches"] = CounterMetricFamily(
            PREFIX + "batches", "Batches delivered to the training loop.", labels=["loader"]
        )
        families["peer_failures"] = CounterMetricFamily(
            PREFIX + "peer_failures",
            "Times this rank left the peer exchange (a rank died, stopped or fell behind).",
            labels=["loader"],
        )
        families["epochs"] = CounterMetricFamily(
            PREFIX + "epochs", "Epochs begun (per-epoch rates divide by its increase).", labels=["loader"]
        )
        gauges = {
            key: GaugeMetricFamily(PREFIX + key, help_, labels=["loader"])
            for key, help_ in {
                "cache_ram_bytes": "Bytes of samples cached in shared memory.",
                "cache_disk_bytes": "Bytes of samples cached on the local disk tier.",
                "staging_bytes": "Bytes read ahead and not cached.",
            }.items()
        }
        for dl in loaders:
            try:
                stats = dl.stats()
            except Exception:  # noqa: BLE001 - a closed loader must not break the scrape
                continue
            for key, family in families.items():
                family.add_metric([dl.name], stats[key])
            for key, family in gauges.items():
                family.add_metric([dl.name], stats[key])
        yield from families.values()
        yield from gauges.values()


def register_loader(dl, registry=None) -> None:
    """Track `dl` in the Prometheus collector (registered once in the default registry)."""
    global _registered
    _loaders.add(dl)
    with _lock:
        if _registered:
            return
        try:
            from prometheus_client import REGISTRY
        except ImportError:
            return
        (registry or REGISTRY).register(_Collector())
        _registered = True
