"""The server's front end (HTTP, tokenizer, the engine core's client) runs without torch: torch and the model
load in the engine core process only, so a server start pays for importing torch once, not twice."""

from __future__ import annotations

import subprocess
import sys

from tests.server.conftest import ROOT

FRONT_END = """
import sys
import server.cli, server.app
from runtime import EngineConfig, EngineCoreClient, OutputDelta, RequestOutput, SamplingParams
from runtime.engine.cpu_limits import cpu_limits
from runtime.model.tokenizer import Tokenizer
from runtime.sample.structured_output import check_structured_output
import loader
loader.parse_size("1MiB", "size")
cpu_limits()
print(sorted(m for m in sys.modules if m == "torch" or m.startswith("torch.")))
"""


def test_the_front_end_imports_no_torch():
    out = subprocess.run(
        [sys.executable, "-c", FRONT_END], cwd=ROOT, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "[]", out.stdout


def test_lazy_package_names_still_resolve():
    """`from loader import DataLoader` and `from runtime import Engine` keep working (they load torch then)."""
    import loader
    import runtime

    assert loader.DataLoader.__module__ == "loader.dataloader"
    assert runtime.Engine.__module__ == "runtime.engine.engine"
    assert "DataLoader" in dir(loader) and "Engine" in dir(runtime)
