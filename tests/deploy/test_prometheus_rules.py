"""promtool checks the recording rules and alerts and runs their unit tests
(deploy/prometheus/rules.test.yml).

The rules' queries also run against a real server's metrics in tests/server/test_prometheus.py.
"""

from __future__ import annotations

import os
import shutil
import subprocess

import yaml

from tests.server.conftest import ROOT

RULES_DIR = os.path.join(ROOT, "deploy", "prometheus")


def promtool(*args: str) -> subprocess.CompletedProcess:
    binary = shutil.which("promtool")
    assert binary, "promtool comes with Debian's prometheus package (`make test` installs it)"
    return subprocess.run([binary, *args], capture_output=True, text=True, cwd=RULES_DIR)


def rules() -> list[dict]:
    with open(os.path.join(RULES_DIR, "rules.yml")) as f:
        return [rule for group in yaml.safe_load(f)["groups"] for rule in group["rules"]]


def test_promtool_accepts_the_rules():
    result = promtool("check", "rules", "rules.yml")
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_alert_has_a_unit_test_that_fires_it():
    with open(os.path.join(RULES_DIR, "rules.test.yml")) as f:
        cases = yaml.safe_load(f)["tests"]
    fired = {
        check["alertname"]
        for case in cases
        for check in case.get("alert_rule_test", [])
        if check.get("exp_alerts")
    }
    alerts = {rule["alert"] for rule in rules() if "alert" in rule}
    assert alerts == fired, f"alerts without a firing unit test: {sorted(alerts - fired)}"
    assert all(
        rule["annotations"].get("summary") and rule["annotations"].get("description")
        for rule in rules()
        if "alert" in rule
    )


def test_promtool_unit_tests_pass():
    result = promtool("test", "rules", "rules.test.yml")
    assert result.returncode == 0, result.stdout + result.stderr
