"""Progress draws on a terminal only: a real pseudo-terminal shows the model load; a pipe, or a process that
configured logging (the server does), shows nothing."""

from __future__ import annotations

import io
import logging
import os
import pty
import subprocess
import sys
import time

import pytest

from runtime.progress import Progress
from tests.server.conftest import ROOT

LOAD = (  # the weights are read as the model takes them (DeferredTensor.load): read them all, as it does
    "from runtime.model.checkpoint import load_checkpoint\n"
    "for w in load_checkpoint(None).weights.values(): w.load()"
)


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def run_on_pty(code: str) -> str:
    """Run `code` with stdout and stderr on a new pseudo-terminal; return what it drew."""
    leader, follower = pty.openpty()
    env = {k: v for k, v in os.environ.items() if k != "PRESCIENT_PROGRESS"}
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=follower, stderr=follower, cwd=ROOT, env=env)
    os.close(follower)
    chunks = []
    while True:
        try:
            chunk = os.read(leader, 4096)
        except OSError:  # EIO: the child closed the terminal
            break
        if not chunk:
            break
        chunks.append(chunk)
    os.close(leader)
    assert proc.wait(timeout=120) == 0
    return b"".join(chunks).decode(errors="replace")


def test_counts_to_the_total_on_a_terminal(monkeypatch):
    monkeypatch.delenv("PRESCIENT_PROGRESS", raising=False)
    monkeypatch.setattr(logging.getLogger(), "handlers", [])
    stream = Terminal()
    with Progress("work", total=3, stream=stream, min_interval=0) as progress:
        for _ in range(3):
            progress.update()
    lines = stream.getvalue().split("\r")
    assert [line.split(": ")[1].split(" s")[0].rsplit(" ", 1)[0] for line in lines if "work:" in line][
        -1
    ] == "3/3 (100%)"
    assert stream.getvalue().endswith("\n")


def test_silent_in_a_pipe_or_with_logging_configured(monkeypatch):
    monkeypatch.delenv("PRESCIENT_PROGRESS", raising=False)
    pipe = io.StringIO()
    with Progress("work", total=2, stream=pipe, min_interval=0) as progress:
        progress.update(2)
    assert pipe.getvalue() == ""
    monkeypatch.setattr(logging.getLogger(), "handlers", [logging.NullHandler()])
    terminal = Terminal()
    with Progress("work", total=2, stream=terminal, min_interval=0) as progress:
        progress.update(2)
    assert terminal.getvalue() == ""


@pytest.mark.slow
def test_model_load_shows_progress_on_a_real_terminal():
    drawn = run_on_pty(LOAD)
    assert "loading SmolLM2-135M-Instruct: " in drawn and "(100%)" in drawn, drawn[-500:]


def test_ticking_redraws_without_steps_and_erases_its_line(monkeypatch):
    monkeypatch.delenv("PRESCIENT_PROGRESS", raising=False)
    monkeypatch.setattr(logging.getLogger(), "handlers", [])
    stream = Terminal()
    progress = Progress("bench serve", stream=stream).ticking(every=0.05)
    deadline = time.monotonic() + 5
    while stream.getvalue().count("bench serve: 0 ") < 2 and time.monotonic() < deadline:
        time.sleep(0.02)
    progress.close(keep=False)
    assert stream.getvalue().count("bench serve: 0 ") >= 2
    assert stream.getvalue().endswith("\r\x1b[2K")
