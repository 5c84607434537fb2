"""The kernel tests' `kernel_level` fixture: each test runs once per instruction-set level this CPU runs (the
generic level included), through the same wrappers the engine calls (native_kernels.use_level), so a level the
CPU lacks is never skipped: it is simply not one of the parameters."""

from __future__ import annotations

import pytest

from runtime.kernels import library as native_kernels

LEVELS = [level.name for level in native_kernels.cpu_levels()]


@pytest.fixture(params=LEVELS)
def kernel_level(request):
    with native_kernels.use_level(request.param):
        yield request.param
