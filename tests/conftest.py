"""The two lanes of the suite: `make test` runs every test, `make test-fast` (`-m "not slow"`) leaves out
the tests marked `slow`: those that load the real model, start a server, torchrun ranks, spawned
(not forked) worker processes, a program in a fresh interpreter, or a build of the C kernels.

A test that asks for one of the fixtures below is marked `slow` here, whichever file it is in; a test
that does one of the others by itself carries the mark, on its module (`pytestmark`) where every test
of the module does.
"""

from __future__ import annotations

import os
import sys

import pytest

# The suite runs two workers on the machine's cores, and each runs multi-threaded kernels (torch's and the
# C kernels' OpenMP teams). OpenMP threads that spin while they wait for work take the cores the other
# worker's threads need: the whole suite ran about 3x slower. Waiting threads sleep instead; the servers,
# torchrun ranks and interpreters the tests start inherit the setting. It must be set before torch loads.
if "OMP_WAIT_POLICY" not in os.environ:
    assert "torch" not in sys.modules, "torch loaded before tests/conftest.py: set OMP_WAIT_POLICY=PASSIVE"
    os.environ["OMP_WAIT_POLICY"] = "PASSIVE"

# The fixtures that load the real model (the engine, transformers' reference) or start a real server.
SLOW_FIXTURES = frozenset({"engine_fp32", "reference", "offline_engine", "server", "client"})


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if SLOW_FIXTURES.intersection(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)
