"""A real Prometheus scrapes the server and a training loader; the dashboards' queries and the rules run
on what it stored."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import time
import urllib.parse
import urllib.request

import pytest
import torch

from tests.server.conftest import MODEL, ROOT, free_port, wait_idle

DASHBOARDS = os.path.join(ROOT, "deploy", "grafana", "dashboards")
RULES = os.path.join(ROOT, "deploy", "prometheus", "rules.yml")
TRAIN_EXAMPLE = os.path.join(ROOT, "deploy", "examples", "train", "train.py")
GRAFANA_VARIABLES = {
    "$__rate_interval": "1m",
    "$model_name": ".*",
    "$instance": ".*",
    "$tenant": ".*",
    "$loader": ".*",
}  # what Grafana puts in with "All" selected


def api(base: str, path: str, **params) -> dict:
    url = f"{base}{path}?{urllib.parse.urlencode(params)}" if params else base + path
    with urllib.request.urlopen(url, timeout=10) as r:
        return json.loads(r.read())


class Squares(torch.utils.data.Dataset):
    def __len__(self):
        return 64

    def read(self, i):
        return i.to_bytes(8, "little")

    def decode(self, raw, i):
        return torch.tensor(int.from_bytes(raw, "little"))

    def __getitem__(self, i):
        return self.decode(self.read(i), i)


@pytest.fixture(scope="module")
def training_loader():
    """A loader that ran two epochs, its series served by the training example's exporter (text format).

    (prometheus_client 0.26's OpenMetrics output, which its start_http_server sends to a Prometheus, writes
    `prescient:loader_x` samples as `prescient_loader_x`; the text format keeps the names.)
    """
    from loader import DataLoader

    dl = DataLoader(
        Squares(),
        batch_size=8,
        shuffle=True,
        cache_ram="1MiB",
        name="train",
        generator=torch.Generator().manual_seed(0),
    )
    for _ in range(2):
        for _ in dl:
            pass
    spec = importlib.util.spec_from_file_location("train", TRAIN_EXAMPLE)
    train = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(train)
    http = train.serve_metrics(0, host="127.0.0.1")
    yield http.server_address[1]
    http.shutdown()
    dl.close()


@pytest.fixture(scope="module")
def prometheus(server, training_loader, tmp_path_factory):
    binary = shutil.which("prometheus")
    assert binary, "Prometheus is required: `make test` installs Debian's prometheus package"
    work = tmp_path_factory.mktemp("prometheus")
    (work / "prometheus.yml").write_text(
        "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
        f"rule_files: [{RULES}]\n"
        "scrape_configs:\n"
        f"  - job_name: prescient\n    static_configs: [{{targets: ['127.0.0.1:{server.port}']}}]\n"
        "  - job_name: prescient-train\n"
        f"    static_configs: [{{targets: ['127.0.0.1:{training_loader}']}}]\n"
    )
    port = free_port()
    proc = subprocess.Popen(
        [
            binary,
            f"--config.file={work / 'prometheus.yml'}",
            f"--storage.tsdb.path={work / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        stdout=subprocess.DEVNULL,
        stderr=open(work / "log", "w"),
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 60
        while time.time() < deadline:
            try:
                targets = api(base, "/api/v1/targets")["data"]["activeTargets"]
                if len(targets) == 2 and all(t["health"] == "up" for t in targets):
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
        out = client.completions.create(
            model=MODEL, prompt=f"Fact {i}:", max_tokens=6, extra_body={"ignore_eos": True}
        )
        served += out.usage.completion_tokens
    own = wait_idle(server)["prescient:generation_tokens_total{}"]
    assert served == 18 and own >= served
    assert scraped(prometheus, "sum(prescient:generation_tokens_total)", own) == own
    assert scraped(prometheus, "sum(prescient:kv_cache_usage_perc)", 0.0) == 0.0


def grafana(expr: str) -> str:
    for variable, value in GRAFANA_VARIABLES.items():
        expr = expr.replace(variable, value)
    return expr


@pytest.mark.parametrize("name", ["prescient.json", "prescient-loader.json"])
def test_every_dashboard_query_returns_real_data(server, client, prometheus, name):
    with open(os.path.join(DASHBOARDS, name)) as f:
        dashboard = json.load(f)
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    assert len(exprs) >= 10
    client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    time.sleep(2.5)  # two scrapes
    names = set(api(prometheus, "/api/v1/label/__name__/values")["data"])
    for expr in exprs:
        for metric in re.findall(r"prescient:[a-z0-9_:]+", expr):
            assert metric in names, f"{metric} (in {expr!r}) is exported by neither the server nor the loader"
        reply = api(prometheus, "/api/v1/query", query=grafana(expr))
        assert reply["status"] == "success", (expr, reply)
        assert reply["data"]["result"], f"no series for {expr!r}"
    for variable in dashboard["templating"]["list"]:  # label_values(metric{...}, label): the values offered
        metric, label = re.fullmatch(r"label_values\((.+), (\w+)\)", variable["definition"]).groups()
        values = api(prometheus, f"/api/v1/label/{label}/values", **{"match[]": grafana(metric)})["data"]
        assert values, f"template variable {variable['name']} offers nothing"


def test_rules_evaluate_on_real_metrics(server, client, prometheus):
    client.completions.create(model=MODEL, prompt="Rules", max_tokens=4)
    deadline = time.time() + 20
    while True:
        groups = api(prometheus, "/api/v1/rules")["data"]["groups"]
        rules = [r for g in groups for r in g["rules"]]
        evaluated = rules and all(
            r.get("lastEvaluation", "").startswith("2") and r["health"] != "unknown" for r in rules
        )
        if evaluated or time.time() > deadline:
            break
        time.sleep(0.5)
    assert len(rules) >= 15
    assert all(r["health"] == "ok" for r in rules), [(r["name"], r.get("lastError")) for r in rules]
    names = set(api(prometheus, "/api/v1/label/__name__/values")["data"])
    assert "prescient:generation_tokens:rate5m" in names  # recording rules write series
    firing = [
        a["labels"]["alertname"]
        for a in api(prometheus, "/api/v1/alerts")["data"]["alerts"]
        if a["state"] == "firing"
    ]
    assert firing == [], firing  # a healthy idle server and loader raise nothing
