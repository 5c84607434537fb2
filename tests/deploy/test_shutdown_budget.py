"""Graceful shutdown fits the time Kubernetes and compose give it.

A pod that is deleted gets terminationGracePeriodSeconds in all: the preStop hook, then SIGTERM, then the
server drains for up to --drain-timeout and cleans up (aborting what is left, stopping the engine thread).
The cleanup part is measured on a real server whose drain window runs out with a long stream in flight.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import threading
import time
import urllib.request

import pytest
import yaml

from server.cli import parse_args
from tests.server.conftest import ROOT, running_server

DEPLOY = os.path.join(ROOT, "deploy")


def measured_cleanup_seconds(drain: float, limit: float) -> float:
    """Seconds from the end of the drain window to the process's exit (inf if it outlives `limit`)."""
    with running_server("--drain-timeout", str(drain)) as server:
        first_chunk = threading.Event()

        def stream():
            request = urllib.request.Request(
                server.url + "/v1/completions",
                data=json.dumps(
                    {"prompt": "Count:", "max_tokens": 4000, "ignore_eos": True, "stream": True}
                ).encode(),
                headers={"Content-Type": "application/json"},
            )
            try:
                with urllib.request.urlopen(request, timeout=120) as response:
                    for _ in response:
                        first_chunk.set()
            except OSError:
                pass

        threading.Thread(target=stream, daemon=True).start()
        assert first_chunk.wait(60), "the stream never started"
        started = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        try:
            code = server.proc.wait(timeout=drain + limit)
        except subprocess.TimeoutExpired:
            server.proc.kill()
            server.proc.wait()
            return float("inf")
        elapsed = time.monotonic() - started
    assert code == 0, f"exit status {code} after SIGTERM"
    return max(0.0, elapsed - drain)


@pytest.mark.slow
def test_prestop_drain_and_cleanup_fit_the_grace_period():
    with open(os.path.join(DEPLOY, "k8s", "prescient.yaml")) as f:
        deployment = next(d for d in yaml.safe_load_all(f) if d["kind"] == "Deployment")
    pod = deployment["spec"]["template"]["spec"]
    container = pod["containers"][0]
    drain = parse_args(container["args"]).drain_timeout
    prestop = float(container["lifecycle"]["preStop"]["exec"]["command"][-1])
    grace = pod["terminationGracePeriodSeconds"]
    with open(os.path.join(DEPLOY, "compose.yaml")) as f:
        compose_grace = yaml.safe_load(f)["services"]["prescient"]["stop_grace_period"]

    cleanup = measured_cleanup_seconds(drain=1.0, limit=grace - prestop - drain)
    assert prestop + drain + cleanup <= grace, (
        f"preStop {prestop} s + drain {drain} s + cleanup {cleanup:.1f} s"
        f" > terminationGracePeriodSeconds {grace}"
    )
    assert drain + cleanup <= int(re.fullmatch(r"(\d+)s", compose_grace).group(1))
