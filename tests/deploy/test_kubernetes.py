"""The Kubernetes manifests: schema-valid for a pinned Kubernetes, and consistent with the server they run.

Built-in kinds are validated with kubernetes-validate (strict: unknown fields fail). HTTPRoute,
ServiceMonitor, PodMonitor and PrometheusRule are validated under Node.js against the schemas that npm's
@kubernetes-models packages generate from their CRDs (types and patterns; unknown fields pass, as on an
API server that prunes them). No package index ships the Inference Extension's CRDs: the InferencePool CRD
of the release the manifest's picker runs is kept as test data (tests/deploy/crds/, with its licence) and
the pool is validated against its schema and CEL rules; the pool, its picker and the server must also
agree on names, labels, ports, flags and metric names.
"""

from __future__ import annotations

import copy
import glob
import importlib.util
import json
import os
import re
import shutil
import subprocess

import kubernetes_validate
import pytest
import tomllib
import yaml
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from server.cli import parse_args
from server.metrics import ServerMetrics
from tests.deploy.crd_schema import errors as crd_errors
from tests.deploy.crd_schema import load_crd
from tests.server.conftest import ROOT

KUBERNETES = "1.33.0"
DEPLOY = os.path.join(ROOT, "deploy")
MANIFESTS = sorted(
    glob.glob(os.path.join(DEPLOY, "k8s", "*.yaml"))
    + glob.glob(os.path.join(DEPLOY, "examples", "*", "*.yaml"))
)
CUSTOM = {"ServiceMonitor", "PodMonitor", "PrometheusRule", "InferencePool", "HTTPRoute"}
INFERENCE_EXTENSION = os.path.join(ROOT, "tests", "deploy", "crds", "gateway-api-inference-extension")
# The flags the endpoint picker of that release defines (its pkg/epp/server/options.go); an unknown flag
# makes it exit at start.
EPP_FLAGS = {
    "cache-info-metric", "cert-path", "config-file", "config-text", "disable-endpoint-subset-filter",
    "enable-cert-reload", "enable-pprof", "endpoint-selector", "endpoint-target-ports", "grpc-health-port",
    "grpc-port", "ha-enable-leader-election", "health-checking", "kv-cache-usage-percentage-metric",
    "lora-info-metric", "metrics-endpoint-auth", "metrics-port", "metrics-staleness-threshold",
    "model-server-metrics-https-insecure-skip-verify", "model-server-metrics-path",
    "model-server-metrics-port", "model-server-metrics-scheme", "pool-group", "pool-name", "pool-namespace",
    "refresh-metrics-interval", "refresh-prometheus-metrics-interval", "secure-serving", "test",
    "total-queued-requests-metric", "total-running-requests-metric", "tracing",
}  # fmt: skip


def documents(path: str) -> list[dict]:
    with open(path) as f:
        return [d for d in yaml.safe_load_all(f) if d]


def by_kind(name: str) -> dict[tuple[str, str], dict]:
    return {(d["kind"], d["metadata"]["name"]): d for d in documents(os.path.join(DEPLOY, "k8s", name))}


def server_metric_names() -> set[str]:
    """Series the server's /metrics exposes (its real registry, fed the stats of an idle engine)."""
    stats = {"num_running": 0, "num_waiting": 0, "kv_usage": 0.0, "tenants": {"default": {}}}
    text = generate_latest(ServerMetrics("m", 2048, lambda: stats).registry).decode()
    return {s.name for family in text_string_to_metric_families(text) for s in family.samples}


def selects(selector: dict, labels: dict) -> bool:
    return selector.items() <= labels.items()


def test_custom_resources_match_their_published_schemas():
    """HTTPRoute, ServiceMonitor and PrometheusRule against the npm packages' CRD schemas (`make test`
    installs them); the InferencePool has none published, see below."""
    node, modules = shutil.which("node"), os.path.join(ROOT, ".venv", "node", "node_modules")
    assert node and os.path.isdir(modules), "run `make crd-schemas` (make test does): Node.js and the schemas"
    docs = [d for path in MANIFESTS for d in documents(path) if d["kind"] in CUSTOM]
    result = subprocess.run(
        [node, os.path.join(ROOT, "tests", "deploy", "crd_schemas.mjs"), modules],
        input=json.dumps(docs),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    checked = {line.split()[1] for line in result.stdout.splitlines() if line.startswith("ok ")}
    expected = {
        "HTTPRoute/prescient",
        "ServiceMonitor/prescient",
        "PrometheusRule/prescient",
        "PodMonitor/prescient-train",
    }
    assert checked == expected, result.stdout
    broken = copy.deepcopy(next(d for d in docs if d["kind"] == "PrometheusRule"))
    broken["spec"]["groups"][1]["rules"][0]["for"] = "ten minutes"
    result = subprocess.run(
        [node, os.path.join(ROOT, "tests", "deploy", "crd_schemas.mjs"), modules],
        input=json.dumps([broken]),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 1 and "FAIL PrometheusRule/prescient" in result.stdout


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: os.path.relpath(p, DEPLOY))
def test_manifests_are_valid_for_the_pinned_kubernetes(path):
    for doc in documents(path):
        if doc["kind"] in CUSTOM:
            continue
        kubernetes_validate.validate(doc, KUBERNETES, strict=True)


def test_the_validator_rejects_a_misspelt_field():
    deployment = copy.deepcopy(by_kind("prescient.yaml")[("Deployment", "prescient")])
    deployment["spec"]["template"]["spec"]["containers"][0]["readinessprobe"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, KUBERNETES, strict=True)


def test_deployment_probes_security_resources_and_secret():
    docs = by_kind("prescient.yaml")
    pod = docs[("Deployment", "prescient")]["spec"]["template"]
    container = pod["spec"]["containers"][0]
    args = parse_args(["--host", "0.0.0.0"] + container["args"])
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"]["path"] == "/health", probe
        assert ports[container[probe]["httpGet"]["port"]] == args.port, probe
    # readiness drops at the first 503 of a drain; liveness never fires within a whole shutdown
    assert container["readinessProbe"]["failureThreshold"] == 1
    live = container["livenessProbe"]
    assert live["periodSeconds"] * live["failureThreshold"] > pod["spec"]["terminationGracePeriodSeconds"]
    start = container["startupProbe"]
    assert start["periodSeconds"] * start["failureThreshold"] >= 120, "model load: minutes when cold"

    assert pod["spec"]["securityContext"]["runAsNonRoot"] is True
    assert pod["spec"]["securityContext"]["runAsUser"] != 0
    security = container["securityContext"]
    assert security["readOnlyRootFilesystem"] is True and security["allowPrivilegeEscalation"] is False
    assert security["capabilities"]["drop"] == ["ALL"]
    assert "/tmp" in {m["mountPath"] for m in container["volumeMounts"]}, "writable /tmp, read-only root"
    assert container["resources"]["requests"]["cpu"] and container["resources"]["limits"]["memory"]

    # a locally built image: no registry host, a version tag, and never pulled when present
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        version = tomllib.load(f)["project"]["version"]
    assert container["image"] == f"prescient:{version}"
    assert container["imagePullPolicy"] in ("IfNotPresent", "Never")

    # API keys come from a Secret mounted where --api-keys reads them
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    mount = next(m for m in container["volumeMounts"] if os.path.dirname(args.api_keys) == m["mountPath"])
    assert volumes[mount["name"]]["secret"]["secretName"]


def test_service_pdb_and_hpa_select_the_deployment():
    docs = by_kind("prescient.yaml")
    deployment = docs[("Deployment", "prescient")]
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert selects(deployment["spec"]["selector"]["matchLabels"], labels)
    service = docs[("Service", "prescient")]
    assert selects(service["spec"]["selector"], labels)
    ports = {p["name"] for p in deployment["spec"]["template"]["spec"]["containers"][0]["ports"]}
    assert service["spec"]["ports"][0]["targetPort"] in ports
    pdb = docs[("PodDisruptionBudget", "prescient")]
    assert selects(pdb["spec"]["selector"]["matchLabels"], labels)
    assert pdb["spec"]["minAvailable"] < deployment["spec"]["replicas"], "a node drain can evict a pod"

    hpa = docs[("HorizontalPodAutoscaler", "prescient")]
    target = {"apiVersion": "apps/v1", "kind": "Deployment", "name": "prescient"}
    assert hpa["spec"]["scaleTargetRef"] == target
    assert hpa["spec"]["minReplicas"] >= pdb["spec"]["minAvailable"] + 1
    # the adapter rule turns a series the server exports into the metric the HPA asks for
    rule = yaml.safe_load(docs[("ConfigMap", "prescient-adapter-rules")]["data"]["config.yaml"])["rules"][0]
    series = re.match(r"[a-z_:]+", rule["seriesQuery"]).group(0)
    assert series in server_metric_names()
    renamed = re.sub(rule["name"]["matches"], rule["name"]["as"].replace("${1}", r"\1"), series)
    assert hpa["spec"]["metrics"][0]["pods"]["metric"]["name"] == renamed
    assert ":" not in renamed


def test_service_monitor_and_prometheus_rule_match_the_service_and_the_rules_file():
    service = by_kind("prescient.yaml")[("Service", "prescient")]
    monitoring = by_kind("monitoring.yaml")
    monitor = monitoring[("ServiceMonitor", "prescient")]
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert selects(monitor["spec"]["selector"]["matchLabels"], service["metadata"]["labels"])
    assert monitor["spec"]["endpoints"][0]["port"] in {p["name"] for p in service["spec"]["ports"]}
    assert monitor["spec"]["endpoints"][0]["path"] == "/metrics"
    with open(os.path.join(DEPLOY, "prometheus", "rules.yml")) as f:
        rules = yaml.safe_load(f)
    assert monitoring[("PrometheusRule", "prescient")]["spec"]["groups"] == rules["groups"]
    target_down = next(
        r for g in rules["groups"] for r in g["rules"] if r.get("alert") == "PrescientTargetDown"
    )
    job_pattern = re.search(r'job=~"([^"]+)"', target_down["expr"]).group(1)
    assert re.fullmatch(job_pattern, service["metadata"]["name"]), "a job is named after its Service"


def inference_pool_crd() -> dict:
    return load_crd(os.path.join(INFERENCE_EXTENSION, "inference.networking.k8s.io_inferencepools.yaml"))


def test_inference_pool_is_valid_against_the_extensions_crd():
    crd = inference_pool_crd()
    pool = by_kind("inference-pool.yaml")[("InferencePool", "prescient")]
    assert crd_errors(pool, crd) == []

    def broken(change) -> list[str]:
        doc = copy.deepcopy(pool)
        change(doc["spec"])
        return crd_errors(doc, crd)

    # what the schema's types, enums and bounds reject
    assert any(
        "failureMode" in e for e in broken(lambda s: s["endpointPickerRef"].update(failureMode="Open"))
    )
    assert any("targetPorts" in e for e in broken(lambda s: s.update(targetPorts=[{"number": 70000}])))
    # what its CEL rules reject: a repeated port, a Service picker without a port
    assert any("unique" in e for e in broken(lambda s: s.update(targetPorts=[{"number": 8000}] * 2)))
    assert any("port is required" in e for e in broken(lambda s: s["endpointPickerRef"].pop("port")))
    # and strict field validation: a misspelt field
    assert any("unknown field 'targetport'" in e for e in broken(lambda s: s.update(targetport=[])))


def test_inference_pool_routes_to_the_server_pods_and_its_picker_reads_our_metrics():
    """What the pool, its picker and the server must agree on, which no schema can see."""
    server = by_kind("prescient.yaml")[("Deployment", "prescient")]["spec"]["template"]
    docs = by_kind("inference-pool.yaml")
    pool = docs[("InferencePool", "prescient")]
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1"
    assert selects(pool["spec"]["selector"]["matchLabels"], server["metadata"]["labels"])
    container = server["spec"]["containers"][0]
    container_ports = [p["containerPort"] for p in container["ports"]]
    assert [p["number"] for p in pool["spec"]["targetPorts"]] == container_ports

    picker = docs[("Deployment", pool["spec"]["endpointPickerRef"]["name"])]["spec"]["template"]
    picker_service = docs[("Service", pool["spec"]["endpointPickerRef"]["name"])]
    assert selects(picker_service["spec"]["selector"], picker["metadata"]["labels"])
    grpc = {p["port"] for p in picker_service["spec"]["ports"]}
    assert pool["spec"]["endpointPickerRef"]["port"]["number"] in grpc
    flags = dict(a[2:].split("=", 1) for a in picker["spec"]["containers"][0]["args"])
    assert set(flags) <= EPP_FLAGS, f"flags the picker does not define: {set(flags) - EPP_FLAGS}"
    release = inference_pool_crd()["metadata"]["annotations"]["inference.networking.k8s.io/bundle-version"]
    assert picker["spec"]["containers"][0]["image"].endswith(f"/epp:{release}"), "picker and CRD releases"
    assert flags["pool-name"] == pool["metadata"]["name"]
    assert int(flags["grpc-port"]) == pool["spec"]["endpointPickerRef"]["port"]["number"]
    assert flags["model-server-metrics-path"] == "/metrics"
    exported = server_metric_names()
    for flag in (
        "total-queued-requests-metric",
        "total-running-requests-metric",
        "kv-cache-usage-percentage-metric",
    ):
        assert flags[flag] in exported, f"--{flag}={flags[flag]} is not a series the server exports"
    assert flags["lora-info-metric"] == "" and flags["cache-info-metric"] == "", "the server has neither"
    config = yaml.safe_load(docs[("ConfigMap", "prescient-epp")]["data"]["config.yaml"])
    mount = picker["spec"]["containers"][0]["volumeMounts"][0]["mountPath"]
    assert flags["config-file"] == f"{mount}/config.yaml"
    defined = {p["type"] for p in config["plugins"]}
    used = {p["pluginRef"] for profile in config["schedulingProfiles"] for p in profile["plugins"]}
    assert used <= defined and {"prefix-cache-scorer", "queue-scorer", "kv-cache-utilization-scorer"} <= used

    route = docs[("HTTPRoute", "prescient")]
    backend = route["spec"]["rules"][0]["backendRefs"][0]
    assert (backend["group"], backend["kind"], backend["name"]) == (
        "inference.networking.k8s.io",
        "InferencePool",
        pool["metadata"]["name"],
    )


def test_training_job_runs_the_example_on_every_pod_with_a_reachable_rendezvous():
    script = os.path.join(DEPLOY, "examples", "train", "train.py")
    spec = importlib.util.spec_from_file_location("train", script)
    train = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(train)
    docs = {
        (d["kind"], d["metadata"]["name"]): d
        for d in documents(os.path.join(DEPLOY, "examples", "train", "job.yaml"))
    }
    job = docs[("Job", "prescient-train")]
    pod = job["spec"]["template"]
    container = pod["spec"]["containers"][0]
    assert container["command"] == ["torchrun"]
    flags = dict(a[2:].split("=", 1) for a in container["args"] if a.startswith("--") and "=" in a)
    script = next(a for a in container["args"] if a.endswith(".py"))
    script_args = container["args"][container["args"].index(script) + 1 :]
    args = train.parse_args(script_args)  # the script accepts what the Job passes
    assert job["spec"]["completionMode"] == "Indexed"
    assert int(flags["nnodes"]) == job["spec"]["completions"] == job["spec"]["parallelism"]
    assert flags["node-rank"] == "$(JOB_COMPLETION_INDEX)"
    assert "JOB_COMPLETION_INDEX" in {e["name"] for e in container["env"]}
    service = docs[("Service", pod["spec"]["subdomain"])]
    assert service["spec"]["clusterIP"] == "None"
    assert selects(service["spec"]["selector"], pod["metadata"]["labels"])
    assert flags["master-addr"] == f"{job['metadata']['name']}-0.{pod['spec']['subdomain']}"
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports["rendezvous"] == int(flags["master-port"]) and ports["metrics"] == args.metrics_port
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    assert volumes[mounts[os.path.dirname(script)]]["configMap"]["name"]
    assert volumes[mounts["/dev/shm"]]["emptyDir"]["medium"] == "Memory"
    monitor = docs[("PodMonitor", "prescient-train")]
    assert selects(monitor["spec"]["selector"]["matchLabels"], pod["metadata"]["labels"])
    assert monitor["spec"]["podMetricsEndpoints"][0]["port"] in ports
    job_name = pod["metadata"]["labels"][monitor["spec"]["jobLabel"]]
    with open(os.path.join(DEPLOY, "prometheus", "rules.yml")) as f:
        target_down = next(
            r
            for g in yaml.safe_load(f)["groups"]
            for r in g["rules"]
            if r.get("alert") == "PrescientTargetDown"
        )
    assert re.fullmatch(re.search(r'job=~"([^"]+)"', target_down["expr"]).group(1), job_name)
    assert (
        container["image"]
        == by_kind("prescient.yaml")[("Deployment", "prescient")]["spec"]["template"]["spec"]["containers"][
            0
        ]["image"]
    )
