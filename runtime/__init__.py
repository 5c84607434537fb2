"""Prescient's model runtime: a Llama-family model on a paged KV cache with continuous batching.

The names below load on first use: a server's front end takes the engine's client, outputs and errors
without importing torch (the engine core process loads the model)."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from runtime.config import CacheConfig, EngineConfig, ModelSettings, ParallelConfig
    from runtime.engine.async_engine import AsyncEngine
    from runtime.engine.client import EngineClient
    from runtime.engine.core_client import EngineCoreClient
    from runtime.engine.engine import Engine
    from runtime.engine.errors import EngineDeadError, QueueFullError, RequestAbortedError, RequestFailedError
    from runtime.engine.outputs import OutputDelta, RequestOutput
    from scheduler import SamplingParams, StructuredOutput

_HOMES = {
    "CacheConfig": "runtime.config",
    "EngineConfig": "runtime.config",
    "ModelSettings": "runtime.config",
    "ParallelConfig": "runtime.config",
    "AsyncEngine": "runtime.engine.async_engine",
    "EngineClient": "runtime.engine.client",
    "EngineCoreClient": "runtime.engine.core_client",
    "Engine": "runtime.engine.engine",
    "EngineDeadError": "runtime.engine.errors",
    "QueueFullError": "runtime.engine.errors",
    "RequestAbortedError": "runtime.engine.errors",
    "RequestFailedError": "runtime.engine.errors",
    "OutputDelta": "runtime.engine.outputs",
    "RequestOutput": "runtime.engine.outputs",
    "SamplingParams": "scheduler",
    "StructuredOutput": "scheduler",
}

__all__ = [
    "AsyncEngine",
    "CacheConfig",
    "Engine",
    "EngineClient",
    "EngineConfig",
    "EngineCoreClient",
    "EngineDeadError",
    "ModelSettings",
    "OutputDelta",
    "ParallelConfig",
    "QueueFullError",
    "RequestAbortedError",
    "RequestFailedError",
    "RequestOutput",
    "SamplingParams",
    "StructuredOutput",
]


def __getattr__(name: str):
    if name not in _HOMES:
        raise AttributeError(f"module 'runtime' has no attribute {name!r}")
    value = getattr(importlib.import_module(_HOMES[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
