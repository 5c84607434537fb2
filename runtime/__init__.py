"""Prescient's model runtime: a Llama-family model on a paged KV cache with continuous batching."""

from runtime.config import CacheConfig, EngineConfig, ModelSettings, ParallelConfig
from runtime.engine.async_engine import AsyncEngine
from runtime.engine.client import EngineClient
from runtime.engine.core_client import EngineCoreClient
from runtime.engine.engine import Engine
from runtime.engine.errors import EngineDeadError, QueueFullError, RequestAbortedError, RequestFailedError
from runtime.engine.outputs import OutputDelta, RequestOutput
from scheduler import SamplingParams, StructuredOutput

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
