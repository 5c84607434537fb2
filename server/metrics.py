"""Prometheus metrics under vLLM's names and buckets, with the prefix `prescient:`.

Per-request histograms and token counters are observed when a request ends,
from the timestamps the engine stamped on its output. Engine-wide numbers
(running/waiting, KV usage, preemptions, prefix cache, per-tenant service) are
read from the engine's stats at scrape time by a collector, so they are never
stale and never double counted.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from runtime import RequestOutput

PREFIX = "prescient:"
SECONDS_1_TO_80 = [1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0]
"""The buckets above a second that vLLM's time-to-first-token and inter-token histograms share."""
TTFT_BUCKETS = [
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    *SECONDS_1_TO_80,
    160.0,
    640.0,
    2560.0,
]
TOKEN_LATENCY_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, *SECONDS_1_TO_80]
REQUEST_LATENCY_BUCKETS = [
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
]
REJECT_REASONS = ("queue_full", "draining")
MAX_TENANT_LABELS = 32
"""Distinct tenant label values; further tenants are reported together as 'other'."""


def token_buckets(max_model_len: int) -> list[float]:
    """1, 2, 5, 10, 20, 50, ... up to the context length (vLLM's 1-2-5 series)."""
    out, exponent = [], 0
    while True:
        for m in (1, 2, 5):
            value = m * 10**exponent
            if value > max_model_len:
                return out
            out.append(value)
        exponent += 1


class TenantLabels:
    """Bounded tenant label values.

    Reserved tenants ("default" and those named in the API keys file, a list the
    operator bounds) always keep their name; of the others (free-form `user`
    fields) the first MAX_TENANT_LABELS seen keep theirs and the rest count as
    "other". A tenant never changes label, so its counters stay monotonic.
    """

    def __init__(self, cap: int = MAX_TENANT_LABELS, reserved: set[str] | frozenset[str] = frozenset()):
        self.cap = cap
        self.reserved = {"default", *reserved}
        self.known: set[str] = set()

    def __call__(self, tenant: str) -> str:
        if tenant in self.known or tenant in self.reserved:
            return tenant
        if len(self.known) < self.cap:
            self.known.add(tenant)
            return tenant
        return "other"


class ServerMetrics:
    def __init__(
        self,
        model_name: str,
        max_model_len: int,
        stats_source,
        reserved_tenants=frozenset(),
        tenant_metrics: bool = True,
    ):
        self.model_name = model_name
        self.registry = CollectorRegistry()
        self.tenant_label = TenantLabels(reserved=set(reserved_tenants))
        r, m = self.registry, ["model_name"]

        def hist(name, doc, buckets):
            return Histogram(PREFIX + name, doc, m, buckets=buckets, registry=r)

        self.ttft = hist("time_to_first_token_seconds", "Time to first token, from arrival.", TTFT_BUCKETS)
        self.itl = hist(
            "inter_token_latency_seconds", "Time between consecutive output tokens.", TOKEN_LATENCY_BUCKETS
        )
        self.tpot = hist(
            "request_time_per_output_token_seconds",
            "Per request: decode time divided by output tokens after the first.",
            TOKEN_LATENCY_BUCKETS,
        )
        self.e2e = hist("e2e_request_latency_seconds", "End-to-end request latency.", REQUEST_LATENCY_BUCKETS)
        self.queue = hist(
            "request_queue_time_seconds", "Time waiting before first scheduled.", REQUEST_LATENCY_BUCKETS
        )
        self.prefill = hist(
            "request_prefill_time_seconds", "First scheduled to first token.", REQUEST_LATENCY_BUCKETS
        )
        self.decode = hist(
            "request_decode_time_seconds", "First token to last token.", REQUEST_LATENCY_BUCKETS
        )
        self.prompt_hist = hist(
            "request_prompt_tokens", "Prompt tokens per request.", token_buckets(max_model_len)
        )
        self.gen_hist = hist(
            "request_generation_tokens", "Generated tokens per request.", token_buckets(max_model_len)
        )
        self.prompt_tokens = Counter(PREFIX + "prompt_tokens", "Prompt tokens processed.", m, registry=r)
        self.generation_tokens = Counter(PREFIX + "generation_tokens", "Tokens generated.", m, registry=r)
        self.success = Counter(
            PREFIX + "request_success",
            "Finished requests by finish reason.",
            m + ["finished_reason"],
            registry=r,
        )
        self.http_responses = Counter(
            PREFIX + "http_responses",
            "HTTP responses by route and status code.",
            m + ["handler", "code"],
            registry=r,
        )
        self.rejected = Counter(
            PREFIX + "requests_rejected",
            "Requests refused before admission: queue_full (429), draining (503).",
            m + ["reason"],
            registry=r,
        )
        for reason in REJECT_REASONS:  # present at 0 from the start, so rate() sees the first rejection
            self.rejected.labels(model_name, reason)
        r.register(_EngineCollector(model_name, stats_source, self.tenant_label if tenant_metrics else None))

    def count_response(self, handler: str, status: int) -> None:
        self.http_responses.labels(self.model_name, handler, str(status)).inc()

    def count_rejected(self, reason: str) -> None:
        self.rejected.labels(self.model_name, reason).inc()

    def observe_finished(self, out: RequestOutput) -> None:
        """Book one request that ended (finished, or aborted with whatever it produced)."""
        name = self.model_name
        n_out = len(out.token_ids)
        self.prompt_tokens.labels(name).inc(len(out.prompt_token_ids))
        self.generation_tokens.labels(name).inc(n_out)
        self.success.labels(name, out.finish_reason or "abort").inc()
        if out.first_scheduled_time is not None:
            self.queue.labels(name).observe(out.first_scheduled_time - out.arrival_time)
        if out.first_token_time is not None:
            # Also for requests the client abandoned after their first token: leaving them out would hide
            # exactly the slow first tokens that made clients give up.
            self.ttft.labels(name).observe(out.first_token_time - out.arrival_time)
        if out.finish_reason == "abort" or out.finished_time is None:
            return
        self.prompt_hist.labels(name).observe(len(out.prompt_token_ids))
        self.gen_hist.labels(name).observe(n_out)
        self.e2e.labels(name).observe(out.finished_time - out.arrival_time)
        if out.first_token_time is not None:
            if out.first_scheduled_time is not None:
                self.prefill.labels(name).observe(out.first_token_time - out.first_scheduled_time)
            last = out.token_times[-1] if out.token_times else out.first_token_time
            self.decode.labels(name).observe(last - out.first_token_time)
            if n_out > 1:
                self.tpot.labels(name).observe((last - out.first_token_time) / (n_out - 1))
        itl = self.itl.labels(name)
        for earlier, later in zip(out.token_times, out.token_times[1:]):
            itl.observe(later - earlier)


class _PerLabelTotal:
    """One per-tenant tally field (service tokens, prefix hits) as a counter per label, monotonic like
    any Prometheus counter.

    The scheduler forgets long-idle tenants (their tally moves to a retired total) and a tenant that
    comes back starts a new tally at 0. A tenant shown under its own label keeps its series: what it
    had at the last scrape before it was forgotten is carried, and its new tally counts on top. What
    no scrape saw under the tenant's name (counted after the last scrape, then forgotten) and that of
    tenants labelled 'other' are reported under 'other'."""

    def __init__(self, field: str, tenant_label: TenantLabels):
        self.field = field
        self.tenant_label = tenant_label
        self._seen: dict[str, tuple[int, float]] = {}
        """Tenants shown under their own label -> (their tally's `since`, the field at the last scrape)."""
        self._carried: dict[str, float] = {}
        """Label -> the field's total of that label's tenants before the scheduler forgot them."""
        self._carried_total = 0.0

    def __call__(self, tenants: dict, retired: float) -> dict[str, float]:
        out: dict[str, float] = {}
        for tenant, (since, value) in list(self._seen.items()):
            now = tenants.get(tenant)
            if now is None or now.get("since", since) != since:  # forgotten (and perhaps back)
                label = self.tenant_label(tenant)
                self._carried[label] = self._carried.get(label, 0.0) + value
                self._carried_total += value
                del self._seen[tenant]
        for tenant, t in tenants.items():
            label = self.tenant_label(tenant)
            value = t.get(self.field, 0)
            if label == tenant:
                self._seen[tenant] = (t.get("since", 0), value)
            out[label] = out.get(label, 0.0) + value
        for label, value in self._carried.items():
            out[label] = out.get(label, 0.0) + value
        if retired > self._carried_total:
            out["other"] = out.get("other", 0.0) + retired - self._carried_total
        return out


class _EngineCollector:
    """Reads the engine's own counters and gauges at scrape time."""

    def __init__(self, model_name: str, stats_source, tenant_label: TenantLabels | None):
        """tenant_label None: no per-tenant series (tenant names and their load stay private)."""
        self.model_name = model_name
        self.stats_source = stats_source
        self.tenant_label = tenant_label
        if tenant_label is not None:
            self._service_by_label = _PerLabelTotal("service_tokens", tenant_label)
            self._prefix_hits_by_label = _PerLabelTotal("prefix_hits", tenant_label)
            self._prefix_queries_by_label = _PerLabelTotal("prefix_queries", tenant_label)

    def describe(self):
        return []

    def collect(self):
        stats = self.stats_source()
        m = [self.model_name]

        def gauge(name, doc, value):
            g = GaugeMetricFamily(PREFIX + name, doc, labels=["model_name"])
            g.add_metric(m, value)
            return g

        def counter(name, doc, value):
            c = CounterMetricFamily(PREFIX + name, doc, labels=["model_name"])
            c.add_metric(m, value)
            return c

        yield gauge("num_requests_running", "Requests in the running batch.", stats.get("num_running", 0))
        yield gauge("num_requests_waiting", "Requests waiting to be admitted.", stats.get("num_waiting", 0))
        yield gauge(
            "kv_cache_usage_perc",
            "Fraction of KV cache blocks in use (1 = full).",
            stats.get("kv_usage", 0.0),
        )
        yield counter(
            "num_preemptions",
            "Preemptions (requests evicted to be recomputed).",
            stats.get("num_preemptions", 0),
        )
        yield counter(
            "num_displacements",
            "Running requests sent back to the queue so that a low-rate sender could start in a full batch (dlpm).",
            stats.get("num_displacements", 0),
        )
        yield counter(
            "prefix_cache_queries",
            "Prompt tokens looked up in the prefix cache.",
            stats.get("prefix_cache_queries", 0),
        )
        yield counter(
            "prefix_cache_hits", "Prompt tokens found in the prefix cache.", stats.get("prefix_cache_hits", 0)
        )
        yield counter(
            "spec_decode_num_drafts",
            "Speculative decoding: decode steps that verified proposed tokens.",
            stats.get("spec_num_drafts", 0),
        )
        yield counter(
            "spec_decode_num_draft_tokens",
            "Speculative decoding: proposed tokens verified.",
            stats.get("spec_num_draft_tokens", 0),
        )
        yield counter(
            "spec_decode_num_accepted_tokens",
            "Speculative decoding: proposed tokens accepted.",
            stats.get("spec_num_accepted_tokens", 0),
        )
        per_pos = CounterMetricFamily(
            PREFIX + "spec_decode_num_accepted_tokens_per_pos",
            "Speculative decoding: accepted tokens by their position in the proposal (0: the first).",
            labels=["model_name", "position"],
        )
        for position, accepted in enumerate(stats.get("spec_accepted_per_pos", ())):
            per_pos.add_metric([self.model_name, str(position)], accepted)
        yield per_pos
        yield gauge(
            "cpu_threads",
            "Compute threads the engine runs (fewer while other processes share its cores or a quota throttles it).",
            stats.get("cpu_threads", 0),
        )
        yield gauge(
            "cpu_split",
            "1 while each decode step's rows are split between the compute threads, each thread alone on its rows "
            "(other processes share the cores).",
            int(stats.get("cpu_split", False)),
        )
        yield gauge(
            "cpu_contention",
            "Share of the compute threads' runnable time spent waiting for a core (steal included), last window.",
            stats.get("cpu_contention", 0.0),
        )
        if self.tenant_label is None:
            return
        service = CounterMetricFamily(
            PREFIX + "tenant_service_tokens",
            "Tokens served per tenant (prompt + output).",
            labels=["model_name", "tenant"],
        )
        counter_g = GaugeMetricFamily(
            PREFIX + "tenant_virtual_counter",
            "Fair scheduler's virtual token counter per tenant (a gauge: a tenant back from idle is lifted "
            "to the smallest active counter; one the scheduler has forgotten has no series).",
            labels=["model_name", "tenant"],
        )
        waiting = GaugeMetricFamily(
            PREFIX + "tenant_requests_waiting",
            "Waiting requests per tenant.",
            labels=["model_name", "tenant"],
        )
        hits = CounterMetricFamily(
            PREFIX + "tenant_prefix_cache_hits",
            "Prompt tokens found in the prefix cache per tenant (over tenant_prefix_cache_queries: its hit "
            "rate).",
            labels=["model_name", "tenant"],
        )
        queries = CounterMetricFamily(
            PREFIX + "tenant_prefix_cache_queries",
            "Prompt tokens looked up in the prefix cache per tenant.",
            labels=["model_name", "tenant"],
        )
        tenants = stats.get("tenants", {})
        for label, served in sorted(
            self._service_by_label(tenants, stats.get("retired_service_tokens", 0)).items()
        ):
            service.add_metric(m + [label], served)
        for label, hit in sorted(
            self._prefix_hits_by_label(tenants, stats.get("retired_prefix_hits", 0)).items()
        ):
            hits.add_metric(m + [label], hit)
        for label, asked in sorted(
            self._prefix_queries_by_label(tenants, stats.get("retired_prefix_queries", 0)).items()
        ):
            queries.add_metric(m + [label], asked)
        merged: dict[str, list[float]] = {}  # gauges: only the tenants the scheduler holds now
        for tenant, t in sorted(tenants.items()):
            acc = merged.setdefault(self.tenant_label(tenant), [0.0, 0.0])
            acc[0] = max(acc[0], t.get("counter", 0.0))
            acc[1] += t.get("waiting", 0)
        for label, (vtc, queued) in merged.items():
            counter_g.add_metric(m + [label], vtc)
            waiting.add_metric(m + [label], queued)
        yield service
        yield hits
        yield queries
        yield counter_g
        yield waiting
