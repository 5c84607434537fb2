"""ServerConfig: the HTTP server's own settings (the engine's are runtime.EngineConfig).

Like EngineConfig, this is the one place where these defaults live: the CLI
builds a flag from each field, with the field's docstring as its help.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ServerConfig:
    host: str = "127.0.0.1"
    """Address to listen on."""
    port: int = 8000
    """TCP port to listen on."""
    served_model_name: str | None = None
    """Model id reported by /v1/models (default: the checkpoint's name)."""
    api_key: list[str] = field(default_factory=list)
    """A key clients must send as 'Authorization: Bearer KEY' (repeat the flag for several); the tenant is
    then the request's `user` field, as without keys. Beside --api-keys, whose keys name their tenants, it is
    "user:" + `user`, so that no `user` is billed as (or shares the prefix cache of) a key file's tenant."""
    api_keys: str | None = None
    """A JSON file {"KEY": {"tenant": "...", "weight": 1}}; without it (and --api-key) no key is needed."""
    metrics_auth: bool = False
    """/metrics asks for one of the --api-keys (Prometheus: authorization.credentials)."""
    tenant_metrics: bool = True
    """Export per-tenant series (they name tenants and show their load); --no-tenant-metrics: none."""
    engine_process: bool = True
    """Run the engine's step loop as the main thread of a process of its own (runtime/engine/core.py), so
    HTTP, JSON and SSE never share a GIL or the CPU thread team with the model; --no-engine-process runs it
    in a thread of the server's process instead (one process, slower per token)."""
    frontend_nice: int = 10
    """With the engine core in its own process: the server's own threads (HTTP, JSON, SSE) run at this nice
    value (Linux, 0-19; 0: the core's priority). When the core's threads fill every core, the front end's work
    for a token then waits for a free core instead of preempting a core thread mid-step, which the other
    threads of the step then wait for. Measured by `python -m tests.bench serve` (HTTP against the offline
    engine)."""
    max_waiting: int = 256
    """Waiting requests beyond this get 429 with Retry-After."""
    max_body_bytes: int = field(default=4 << 20, metadata={"size": True})
    """Largest request body accepted (bytes, or a size such as 4MiB); larger gets 413."""
    drain_timeout: float = 30.0
    """Seconds to finish in-flight work on SIGTERM before aborting it."""
    throughput_log_seconds: float = 5.0
    """Log a throughput line this often while there is work."""
    log_level: str = "INFO"
    """Python logging level."""
