"""Prescient's model runtime: a Llama-family model on a paged KV cache with continuous batching."""
from runtime.async_engine import (AsyncEngine, EngineDeadError, QueueFullError, RequestAbortedError,
                                  RequestFailedError)
from runtime.engine import Engine
from runtime.outputs import RequestOutput
from scheduler import SamplingParams

__all__ = ["AsyncEngine", "Engine", "EngineDeadError", "QueueFullError", "RequestAbortedError", "RequestFailedError",
           "RequestOutput", "SamplingParams"]
