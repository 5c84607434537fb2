"""The NetworkPolicies let in exactly who must reach the pods, on the ports the pods serve.

kubernetes-validate checks their schema (test_kubernetes.py validates every manifest). Here each
policy is applied, with the NetworkPolicy rules of the Kubernetes documentation (a policy selecting a
pod denies it every ingress not listed; a `from` entry with only podSelector means the policy's own
namespace, with namespaceSelector and podSelector both must match; named ports resolve through the
pod's containers), to the pods the manifests themselves define: the gateway's proxy for the
HTTPRoute's parent Gateway, the endpoint picker, Prometheus, the other training ranks, and pods that
must be kept out.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from tests.deploy.test_kubernetes import DEPLOY, by_kind, documents, selects

NAMESPACE = "prescient"  # where the manifests are applied (they name none)
MONITORING = "monitoring"


@dataclass
class Pod:
    labels: dict
    namespace: str = NAMESPACE
    ports: dict = field(default_factory=dict)  # container port name -> number
    namespace_labels: dict = field(default_factory=dict)

    def __post_init__(self):
        self.namespace_labels = {"kubernetes.io/metadata.name": self.namespace, **self.namespace_labels}


def pod_of(template: dict) -> Pod:
    ports = {
        p["name"]: p["containerPort"] for c in template["spec"]["containers"] for p in c.get("ports", [])
    }
    return Pod(template["metadata"]["labels"], ports=ports)


def peer_matches(peer: dict, source: Pod) -> bool:
    if "ipBlock" in peer:
        return False  # pods are not matched by address here
    in_namespace = (
        selects(peer["namespaceSelector"].get("matchLabels", {}), source.namespace_labels)
        if "namespaceSelector" in peer
        else source.namespace == NAMESPACE
    )
    return in_namespace and selects(peer.get("podSelector", {}).get("matchLabels", {}), source.labels)


def port_matches(rule_ports: list | None, target: Pod, port: int) -> bool:
    if not rule_ports:
        return True  # no ports: every port
    for entry in rule_ports:
        if entry.get("protocol", "TCP") != "TCP":
            continue
        wanted = entry["port"]
        number = target.ports.get(wanted) if isinstance(wanted, str) else wanted
        assert number is not None, f"port {wanted!r} is no container port of the pods it selects"
        if number == port:
            return True
    return False


def admits(policies: list[dict], source: Pod, target: Pod, port: int) -> bool:
    """Whether TCP from `source` to `target`:`port` is allowed by the policies in NAMESPACE."""
    applying = [
        p
        for p in policies
        if target.namespace == NAMESPACE
        and selects(p["spec"]["podSelector"].get("matchLabels", {}), target.labels)
        and "Ingress" in p["spec"].get("policyTypes", ["Ingress"])
    ]
    if not applying:
        return True
    return any(
        any(peer_matches(peer, source) for peer in rule.get("from", [{"podSelector": {}}]))
        and port_matches(rule.get("ports"), target, port)
        for policy in applying
        for rule in policy["spec"].get("ingress", [])
    )


def policies_in(*paths: str) -> list[dict]:
    return [
        d for path in paths for d in documents(os.path.join(DEPLOY, path)) if d["kind"] == "NetworkPolicy"
    ]


PROMETHEUS = Pod({"app.kubernetes.io/name": "prometheus"}, namespace=MONITORING)  # the Operator's labels
STRANGER = Pod({"app": "something-else"})
PROMETHEUS_LOOKALIKE = Pod({"app.kubernetes.io/name": "prometheus"}, namespace="team-b")


def test_only_the_gateway_its_picker_and_prometheus_reach_the_server():
    policies = policies_in("k8s/network-policy.yaml")
    assert [p["metadata"]["name"] for p in policies] == ["prescient"]
    server = pod_of(by_kind("prescient.yaml")[("Deployment", "prescient")]["spec"]["template"])
    pool_docs = by_kind("inference-pool.yaml")
    (port,) = [p["number"] for p in pool_docs[("InferencePool", "prescient")]["spec"]["targetPorts"]]
    service = by_kind("prescient.yaml")[("Service", "prescient")]
    assert server.ports[service["spec"]["ports"][0]["targetPort"]] == port, "the Service's port is the pool's"

    gateway_name = pool_docs[("HTTPRoute", "prescient")]["spec"]["parentRefs"][0]["name"]
    gateway = Pod({"gateway.networking.k8s.io/gateway-name": gateway_name, "istio.io/gateway-name": "x"})
    picker = pod_of(pool_docs[("Deployment", "prescient-epp")]["spec"]["template"])
    for source in (gateway, picker, PROMETHEUS):
        assert admits(policies, source, server, port), source
    other_gateway = Pod({"gateway.networking.k8s.io/gateway-name": "another-gateway"})
    training = pod_of(documents(os.path.join(DEPLOY, "examples", "train", "job.yaml"))[1]["spec"]["template"])
    for source in (STRANGER, other_gateway, PROMETHEUS_LOOKALIKE, training):
        assert not admits(policies, source, server, port), source
    assert not admits(policies, gateway, server, 9090), "only the server's port"
    # the picker and Prometheus scrape /metrics on the port the ServiceMonitor names
    monitor = by_kind("monitoring.yaml")[("ServiceMonitor", "prescient")]
    named = next(p for p in service["spec"]["ports"] if p["name"] == monitor["spec"]["endpoints"][0]["port"])
    assert server.ports[named["targetPort"]] == port


def test_training_ranks_reach_each_other_and_prometheus_only_the_metrics_port():
    job_docs = documents(os.path.join(DEPLOY, "examples", "train", "job.yaml"))
    policies = [d for d in job_docs if d["kind"] == "NetworkPolicy"]
    assert [p["metadata"]["name"] for p in policies] == ["prescient-train"]
    job = next(d for d in job_docs if d["kind"] == "Job")
    rank = pod_of(job["spec"]["template"])
    container = job["spec"]["template"]["spec"]["containers"][0]
    master_port = int(next(a for a in container["args"] if a.startswith("--master-port=")).split("=")[1])
    assert rank.ports["rendezvous"] == master_port
    other_rank = pod_of(job["spec"]["template"])
    assert admits(policies, other_rank, rank, master_port)
    assert admits(policies, other_rank, rank, 41234), "gloo's rank-to-rank ports are the kernel's choice"
    monitor = next(d for d in job_docs if d["kind"] == "PodMonitor")
    metrics = rank.ports[monitor["spec"]["podMetricsEndpoints"][0]["port"]]
    assert admits(policies, PROMETHEUS, rank, metrics)
    assert not admits(policies, PROMETHEUS, rank, master_port)
    server = pod_of(by_kind("prescient.yaml")[("Deployment", "prescient")]["spec"]["template"])
    for source in (STRANGER, PROMETHEUS_LOOKALIKE, server):
        assert not admits(policies, source, rank, master_port) and not admits(policies, source, rank, metrics)


def test_prometheus_is_the_same_peer_in_every_policy():
    peers = [
        peer
        for policy in policies_in("k8s/network-policy.yaml", "examples/train/job.yaml")
        for rule in policy["spec"]["ingress"]
        for peer in rule["from"]
        if "namespaceSelector" in peer
    ]
    assert len(peers) == 2 and peers[0] == peers[1]
