"""A real Prometheus scrapes the server; the Grafana dashboard's queries run against it."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time
import urllib.parse
import urllib.request

import pytest

from tests.server.conftest import MODEL, ROOT, free_port, wait_idle

DASHBOARD = os.path.join(ROOT, "deploy", "grafana", "dashboards", "prescient.json")


def api(base: str, path: str, **params) -> dict:
    url = f"{base}{path}?{urllib.parse.urlencode(params)}" if params else base + path
    with urllib.request.urlopen(url, timeout=10) as r:
        return json.loads(r.read())


@pytest.fixture(scope="module")
def prometheus(server, tmp_path_factory):
    binary = shutil.which("prometheus")
    assert binary, "Prometheus is required: `make test` installs Debian's prometheus package"
    work = tmp_path_factory.mktemp("prometheus")
    (work / "prometheus.yml").write_text(
        "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
        "scrape_configs:\n"
        f"  - job_name: prescient\n    static_configs: [{{targets: ['127.0.0.1:{server.port}']}}]\n")
    port = free_port()
    proc = subprocess.Popen([binary, f"--config.file={work / 'prometheus.yml'}", f"--storage.tsdb.path={work / 'data'}",
                             f"--web.listen-address=127.0.0.1:{port}"], stdout=subprocess.DEVNULL,
                            stderr=open(work / "log", "w"))
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 60
        while time.time() < deadline:
            try:
                targets = api(base, "/api/v1/targets")["data"]["activeTargets"]
                if targets and targets[0]["health"] == "up":
                    break
            except OSError:
                pass
            time.sleep(0.5)
        else:
            raise RuntimeError("Prometheus never scraped the server:\n" + (work / "log").read_text())
        yield base
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def scraped(base: str, expr: str, want: float, timeout: float = 20) -> float:
    deadline = time.time() + timeout
    value = None
    while time.time() < deadline:
        result = api(base, "/api/v1/query", query=expr)["data"]["result"]
        value = float(result[0]["value"][1]) if result else None
        if value == want:
            return value
        time.sleep(0.5)
    return value


def test_prometheus_sees_what_was_served(server, client, prometheus):
    served = 0
    for i in range(3):
        out = client.completions.create(model=MODEL, prompt=f"Fact {i}:", max_tokens=6, extra_body={"ignore_eos": True})
        served += out.usage.completion_tokens
    own = wait_idle(server)["prescient:generation_tokens_total{}"]
    assert served == 18 and own >= served
    assert scraped(prometheus, "sum(prescient:generation_tokens_total)", own) == own
    assert scraped(prometheus, "sum(prescient:kv_cache_usage_perc)", 0.0) == 0.0


def test_every_dashboard_query_runs_on_real_metrics(server, client, prometheus):
    with open(DASHBOARD) as f:
        dashboard = json.load(f)
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    assert len(exprs) >= 12
    client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    time.sleep(2.5)  # two scrapes
    names = set(api(prometheus, "/api/v1/label/__name__/values")["data"])
    for expr in exprs:
        for metric in re.findall(r"prescient:[a-z0-9_:]+", expr):
            assert metric in names, f"{metric} (in {expr!r}) is not exported by the server"
        reply = api(prometheus, "/api/v1/query", query=expr)
        assert reply["status"] == "success", (expr, reply)
