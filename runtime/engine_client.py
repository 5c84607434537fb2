"""EngineClient: everything the server may ask of the engine, and nothing more.

The server holds one EngineClient and never reaches past it (no engine, model,
scheduler or KV cache). AsyncEngine runs the engine on a thread of the
server's process; EngineCoreClient speaks to an engine core in a process of
its own. The surface is small and made of plain values (token ids,
SamplingParams, OutputDelta, SchedulerStats), so the server cannot tell which.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Protocol

from runtime.outputs import OutputDelta
from runtime.tokenizer import Tokenizer
from scheduler import SamplingParams, SchedulerStats


class EngineClient(Protocol):
    @property
    def tokenizer(self) -> Tokenizer:
        """Chat templates, /tokenize and /detokenize run with it on the caller's side."""

    @property
    def model_name(self) -> str:
        """The checkpoint's name."""

    @property
    def max_model_len(self) -> int:
        """Longest prompt + output, in tokens, the engine runs."""

    @property
    def vocab_size(self) -> int:
        """Token ids are in [0, vocab_size)."""

    @property
    def num_in_flight(self) -> int:
        """Requests added and not yet handed their final output."""

    def generate(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        request_id: str | None = None,
        *,
        tenant: str = "default",
        weight: float = 1.0,
        priority: int = 0,
        clamp_max_tokens: bool = False,
        cache_salt: str | None = None,
    ) -> AsyncIterator[OutputDelta]:
        """What is new in one request's output, step by step (several coalesced for a slow reader), the
        last delta with finished=True; the caller assembles what it needs (RequestOutput.append). Raises
        scheduler.InvalidRequestError (with .param) for a request that cannot run, QueueFullError
        when too many wait. Leaving the iteration early aborts the request."""

    def abort(self, request_id: str) -> None:
        """Stop a request now and free its KV blocks (no-op if unknown or finished)."""

    def abort_all(self, reason: str) -> int:
        """Abort every request in flight (each consumer gets RequestAbortedError); returns how many."""

    def stats(self) -> SchedulerStats:
        """Scheduler gauges and counters as of the engine's last step (see Scheduler.stats)."""

    def check_health(self) -> None:
        """Raise if the engine can no longer serve."""

    def start(self) -> None:
        """Start the engine loop (the app's startup)."""

    async def shutdown(self) -> None:
        """Stop the engine loop (the app's cleanup)."""
