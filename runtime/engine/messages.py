"""The messages between an engine client and its engine core, whichever transport carries them.

A client (runtime/engine/client.py) sends AddRequest, Abort and Stop; the
core (runtime/engine/core.py) answers each loop iteration that did anything
with one StepOutput. In thread mode they go through a queue and a direct call,
in process mode through two pipes (pickled); the types are the same. They are
frozen and slotted: a message is never edited once sent, and a slotted
dataclass pickles as small as a tuple.
"""

from __future__ import annotations

from dataclasses import dataclass

from runtime.engine.outputs import OutputDelta
from scheduler import InvalidRequestError, SamplingParams, SchedulerStats
from scheduler.stats import fields_of


class _Message:
    __slots__ = ()

    def __reduce__(
        self,
    ):  # rebuilt by the constructor: dataclasses' own pickling asks fields() twice a message
        return type(self), fields_of(self)


@dataclass(frozen=True, slots=True)
class AddRequest(_Message):
    """One admitted request (runtime/engine/request_checks.py ran on the client's side)."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    tenant: str = "default"
    weight: float = 1.0
    priority: int = 0
    arrival_time: float | None = None
    cache_salt: str | None = None


@dataclass(frozen=True, slots=True)
class Abort(_Message):
    """Stop a request now and free its blocks (no-op if unknown or finished)."""

    request_id: str


@dataclass(frozen=True, slots=True)
class Stop(_Message):
    """End the core loop after the step it is in."""


@dataclass(frozen=True, slots=True)
class Rejected(_Message):
    """An added request the engine refused (a request id in use, n beyond max_num_seqs ...)."""

    request_id: str
    message: str
    param: str | None = None
    """The request field to change, when the refusal is an InvalidRequestError."""
    code: str = "invalid_value"

    @classmethod
    def of(cls, request_id: str, exc: ValueError) -> Rejected:
        if isinstance(exc, InvalidRequestError):
            return cls(request_id, exc.detail, exc.param, exc.code)
        return cls(request_id, str(exc))

    def error(self) -> ValueError:
        """The refusal as its caller raises it (an InvalidRequestError naming the field when there is one)."""
        if self.param is None:
            return ValueError(self.message)
        return InvalidRequestError(self.param, self.message, self.code)


@dataclass(frozen=True, slots=True)
class StepOutput(_Message):
    """What one core loop iteration produced: the deltas of every sequence that changed, the adds it
    refused, and the scheduler's stats after it."""

    deltas: list[OutputDelta]
    rejected: list[Rejected]
    stats: SchedulerStats


@dataclass(frozen=True, slots=True)
class CoreFailed(_Message):
    """The core process could not load its engine (it exits)."""

    message: str
    kind: str
    """The exception's class name: "ValueError" for a bad setting or path."""


@dataclass(frozen=True, slots=True)
class CoreDead(_Message):
    """The core loop itself failed (it exits); every request in flight is lost."""

    message: str
