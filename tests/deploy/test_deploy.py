"""deploy/ stays consistent without Docker: files parse, paths exist, names and ports agree, promtool accepts
the config.

(Kubernetes: test_kubernetes.py; the Dockerfile against `make serve`: test_dockerfile.py.)

(PyYAML comes with transformers, a test dependency.)
"""

from __future__ import annotations

import glob
import json
import os
import re
import shlex
import shutil
import subprocess

import pytest
import yaml

from server.cli import parse_args
from tests.server.conftest import ROOT

DEPLOY = os.path.join(ROOT, "deploy")


def load(path: str):
    with open(os.path.join(DEPLOY, path)) as f:
        return list(yaml.safe_load_all(f)) if path.startswith("k8s") else yaml.safe_load(f)


def dockerfile() -> list[str]:
    with open(os.path.join(DEPLOY, "Dockerfile")) as f:
        return [line.strip() for line in f if line.strip() and not line.startswith("#")]


def entrypoint_args() -> list[str]:
    line = next(x for x in dockerfile() if x.startswith("ENTRYPOINT"))
    args = json.loads(line[len("ENTRYPOINT") :])
    assert args[:3] == ["python", "-m", "server"]
    return args[3:]


def test_dockerfile_copies_what_exists_and_serves_on_its_exposed_port():
    for line in dockerfile():
        if line.startswith("COPY") and "--from=" not in line:
            for source in shlex.split(line)[1:-1]:
                assert os.path.exists(os.path.join(ROOT, source)), f"COPY {source}: not in the repository"
    exposed = next(int(x.split()[1]) for x in dockerfile() if x.startswith("EXPOSE"))
    args = parse_args(entrypoint_args())
    assert args.host == "0.0.0.0" and args.port == exposed


def test_compose_mounts_exist_and_prometheus_scrapes_the_server():
    compose = load("compose.yaml")
    assert set(compose["services"]) == {"prescient", "prometheus", "grafana"}
    build = compose["services"]["prescient"]["build"]
    assert os.path.exists(os.path.join(DEPLOY, build["context"], build["dockerfile"]))
    for service in compose["services"].values():
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            assert os.path.exists(os.path.join(DEPLOY, source)), f"volume {volume}: {source} does not exist"
    scrape = load("prometheus/prometheus.yml")["scrape_configs"][0]
    assert scrape.get("metrics_path", "/metrics") == "/metrics"
    exposed = parse_args(entrypoint_args()).port
    assert scrape["static_configs"][0]["targets"] == [f"prescient:{exposed}"]
    drain = parse_args(entrypoint_args()).drain_timeout
    grace = compose["services"]["prescient"]["stop_grace_period"]
    assert int(re.fullmatch(r"(\d+)s", grace).group(1)) > drain


_VARIABLE = re.compile(r"\$\{(\w+)(?:(:-|:\?)([^}]*))?\}")


def interpolate(text: str, env: dict[str, str]) -> str:
    """Compose's variable syntax as the compose specification defines it: ${VAR}, ${VAR:-default} (unset
    or empty: the default) and ${VAR:?message} (unset or empty: compose refuses to start, with it)."""

    def value(match: re.Match) -> str:
        name, kind, rest = match.groups()
        if env.get(name):
            return env[name]
        if kind == ":?":
            raise ValueError(f"required variable {name} is missing a value: {rest}")
        return rest if kind == ":-" else ""

    return _VARIABLE.sub(value, text)


def compose_with(env: dict[str, str]) -> dict:
    with open(os.path.join(DEPLOY, "compose.yaml")) as f:
        return yaml.safe_load(interpolate(f.read(), env))


def test_compose_publishes_on_localhost_unless_told_and_grafana_needs_a_password():
    with pytest.raises(ValueError, match="GRAFANA_ADMIN_PASSWORD_FILE to a file holding Grafana's admin"):
        compose_with({})  # no default password: compose refuses to start without one
    password_file = {"GRAFANA_ADMIN_PASSWORD_FILE": "/home/me/grafana-admin-password"}
    for env, host in (
        (password_file, "127.0.0.1"),
        ({**password_file, "PRESCIENT_BIND": "0.0.0.0"}, "0.0.0.0"),
    ):
        compose = compose_with(env)
        published = [port for service in compose["services"].values() for port in service.get("ports", [])]
        assert len(published) == 3 and all(port.split(":")[0] == host for port in published), published
    grafana = compose["services"]["grafana"]
    assert "GF_SECURITY_ADMIN_PASSWORD" not in grafana["environment"]
    (secret,) = grafana["secrets"]
    assert grafana["environment"]["GF_SECURITY_ADMIN_PASSWORD__FILE"] == f"/run/secrets/{secret}"
    assert compose["secrets"][secret]["file"] == password_file["GRAFANA_ADMIN_PASSWORD_FILE"]
    with open(os.path.join(DEPLOY, "compose.yaml")) as f:
        assert "admin/admin" not in f.read().replace("never Grafana's admin/admin", "")


def test_promtool_accepts_the_prometheus_config():
    promtool = shutil.which("promtool")
    assert promtool, "promtool comes with Debian's prometheus package (`make test` installs it)"
    config = os.path.join(DEPLOY, "prometheus", "prometheus.yml")
    result = subprocess.run([promtool, "check", "config", config], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_grafana_provisioning_points_at_the_dashboard_and_datasource():
    compose = load("compose.yaml")
    mounts = dict(v.split(":")[:2] for v in compose["services"]["grafana"]["volumes"])
    provider = load("grafana/provisioning/dashboards/prescient.yaml")["providers"][0]
    assert mounts["./grafana/dashboards"] == provider["options"]["path"]
    datasource = load("grafana/provisioning/datasources/prometheus.yaml")["datasources"][0]
    assert datasource["url"] == "http://prometheus:9090"
    paths = sorted(glob.glob(os.path.join(DEPLOY, "grafana", "dashboards", "*.json")))
    assert [os.path.basename(p) for p in paths] == ["prescient-loader.json", "prescient.json"]
    uids = set()
    for path in paths:
        with open(path) as f:
            dashboard = json.load(f)
        uids.add(dashboard["uid"])
        for panel in dashboard["panels"]:
            assert panel["datasource"]["uid"] == datasource["uid"], panel["title"]
            assert panel["targets"], panel["title"]
            assert all(t["expr"] and t["refId"] for t in panel["targets"]), panel["title"]
            assert all("[$__rate_interval]" in t["expr"] for t in panel["targets"] if "rate(" in t["expr"])
        variables = {v["name"]: v for v in dashboard["templating"]["list"]}
        assert "instance" in variables
        assert all(v["datasource"]["uid"] == datasource["uid"] for v in variables.values())
        for panel in dashboard["panels"]:  # every query honours every variable of its dashboard
            for target in panel["targets"]:
                used = {name for name in variables if f"${name}" in target["expr"]}
                assert used == set(variables) - {"tenant"} or used == set(variables), (panel["title"], used)
    assert len(uids) == len(paths)
    # (test_prometheus runs every expression against a real Prometheus scraping the real server)
