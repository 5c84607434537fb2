"""The one error a sample can raise: which sample (index and path), what failed, what to do."""

from __future__ import annotations


class SampleError(RuntimeError):
    """A sample could not be read or decoded.

    A RuntimeError with a one-argument constructor, so that torch's worker machinery
    (ExceptionWrapper) re-raises it in the main process with the same type and message.
    """


def sample_error(index: int, where: str, stage: str, cause: BaseException, tried: str = "") -> SampleError:
    hint = (
        "check that the file exists and is readable"
        if stage == "read"
        else "check the bytes and the decode/transform functions"
    )
    return SampleError(
        f"sample {index} ({where}): {stage} failed{tried} with "
        f"{type(cause).__name__}: {cause}; {hint}, or leave index {index} out of the sampler"
    )
