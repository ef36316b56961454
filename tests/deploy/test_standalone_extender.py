"""No single point of failure in default-scheduler mode: the chart's standalone HTTPS extender runs replicas with
leader election (the Lease holder answers and binds, and labels its own pod leader, which the HTTPS Service
selects), probes and a metrics Service on the plain-HTTP metrics port of every replica, a PodDisruptionBudget that
lets a drain through, replicas spread over nodes, and the RBAC of the election in the chart's namespace only."""

from __future__ import annotations

import copy
from typing import Any

import helm_python
import pytest

from extender.cli import serve
from extender.config import SETTINGS
from tests.deploy.rendering import (
    CHART_VARIANTS,
    ChartVariant,
    find,
    generated_masked,
    render_chart,
    render_chart_files,
)

DEFAULT = {"scheduler": {"mode": "default-scheduler"}}
ROLE = "gpu-topology.io/extender-role"


def _render(values: dict[str, Any], release: str = "gpu-topology") -> list[dict[str, Any]]:
    return render_chart(ChartVariant(release, "gpu-topology", copy.deepcopy(values)))


def _extender(objects: list[dict[str, Any]]) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    (deployment,) = find(objects, "Deployment", "gpu-topology-extender")
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    return deployment, pod, container


def test_two_leader_elected_replicas_with_the_election_arguments() -> None:
    deployment, pod, container = _extender(_render(DEFAULT))
    assert deployment["spec"]["replicas"] == 2
    assert deployment["spec"]["strategy"] == {"type": "RollingUpdate",
                                              "rollingUpdate": {"maxUnavailable": 1, "maxSurge": 0}}
    args = container["args"]
    for arg in ("--leader-elect", "--leader-elect-lease-name=gpu-topology-extender",
                "--leader-elect-namespace=gpu-topology", "--leader-elect-lease-duration=15",
                "--leader-elect-renew-deadline=10", "--leader-elect-retry-period=2", "--metrics-port=8889"):
        assert arg in args
    env = {e["name"]: e for e in container["env"]}
    assert env["POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    assert env["POD_NAMESPACE"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.namespace"
    assert pod["enableServiceLinks"] is False


def test_election_arguments_resolve_in_the_extender_cli() -> None:
    """The arguments are flags `gpu-extender serve` takes, resolving to the values given."""
    _, _, container = _extender(_render({**DEFAULT, "standaloneExtender": {"leaderElection": {
        "leaseName": "my-lease", "leaseDuration": 20, "renewDeadline": 12, "retryPeriod": 3}}}))
    args = [a for a in container["args"][1:] if not a.startswith("--tls-")]  # files mounted in the pod only
    flags = dict(serve.make_context("serve", args).params)
    flags.pop("config_file"), flags.pop("print_config")
    settings = SETTINGS.load(flags, env={})
    assert settings.leader_elect is True
    assert settings.leader_elect_lease_name == "my-lease"
    assert settings.leader_elect_namespace == "gpu-topology"
    assert (settings.leader_elect_lease_duration_s, settings.leader_elect_renew_deadline_s,
            settings.leader_elect_retry_period_s) == (20, 12, 3)
    assert settings.metrics_port == 8889


def test_https_service_selects_the_leader_and_metrics_service_every_replica() -> None:
    objects = _render(DEFAULT)
    deployment, _, _ = _extender(objects)
    app = deployment["spec"]["selector"]["matchLabels"]
    (https,) = find(objects, "Service", "gpu-topology-extender")
    assert https["spec"]["selector"] == {**app, ROLE: "leader"}
    assert [p["name"] for p in https["spec"]["ports"]] == ["https"]
    (metrics,) = find(objects, "Service", "gpu-topology-extender-metrics")
    assert metrics["spec"]["selector"] == app
    assert metrics["spec"]["ports"] == [{"name": "http-metrics", "port": 8889, "targetPort": "http-metrics",
                                         "protocol": "TCP"}]
    (policy,) = find(objects, "NetworkPolicy", "gpu-topology-extender")
    ports = [p["port"] for rule in policy["spec"]["ingress"] for p in rule["ports"]]
    assert ports == ["https", "http-metrics"]
    scraped = _render({**DEFAULT, "networkPolicy": {"metricsFrom": [{"podSelector": {}}]}})
    (policy,) = find(scraped, "NetworkPolicy", "gpu-topology-extender")
    assert "from" not in policy["spec"]["ingress"][0], "kube-scheduler comes from the control-plane hosts"
    assert policy["spec"]["ingress"][1]["from"] == [{"podSelector": {}}]


def test_probes_on_the_metrics_port() -> None:
    _, _, container = _extender(_render(DEFAULT))
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"https": 8443, "http-metrics": 8889}
    ready, live = container["readinessProbe"], container["livenessProbe"]
    assert ready["httpGet"] == {"path": "/readyz", "port": "http-metrics"} and ready["periodSeconds"] == 2
    assert live["httpGet"] == {"path": "/healthz", "port": "http-metrics"}


def test_lease_rbac_in_the_charts_namespace() -> None:
    objects = _render(DEFAULT)
    (role,) = find(objects, "Role", "gpu-topology-extender-leader-election")
    assert role["metadata"]["namespace"] == "gpu-topology"
    rules = role["rules"]
    assert {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"],
            "resourceNames": ["gpu-topology-extender"], "verbs": ["get", "update", "list", "watch"]} in rules
    assert {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"], "verbs": ["create"]} in rules
    assert {"apiGroups": [""], "resources": ["pods"], "verbs": ["patch"]} in rules
    (binding,) = find(objects, "RoleBinding", "gpu-topology-extender-leader-election")
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "gpu-topology-extender",
                                    "namespace": "gpu-topology"}]
    named = _render({**DEFAULT, "standaloneExtender": {"leaderElection": {"leaseName": "mine"}}})
    (role,) = find(named, "Role", "gpu-topology-extender-leader-election")
    assert role["rules"][0]["resourceNames"] == ["mine"]
    # The ClusterRole's pod patch (refused pods touched for a retry) comes with the policy that narrows it to one
    # annotation and this role label, for both accounts the extender runs as.
    (cluster_role,) = find(objects, "ClusterRole", "gpu-topology-extender")
    assert any("patch" in r["verbs"] and "pods" in r["resources"] for r in cluster_role["rules"])
    (policy,) = find(objects, "ValidatingAdmissionPolicy", "gpu-topology-extender-pod-patches")
    (match,) = policy["spec"]["matchConditions"]
    assert "system:serviceaccount:gpu-topology:gpu-topology-extender" in match["expression"]
    assert "system:serviceaccount:gpu-topology:gpu-topology-scheduler" in match["expression"]
    assert any("gpu-topology.io/extender-role" in v["expression"] for v in policy["spec"]["validations"])


def test_pdb_lets_a_drain_through_and_replicas_spread() -> None:
    objects = _render(DEFAULT)
    deployment, pod, _ = _extender(objects)
    (pdb,) = find(objects, "PodDisruptionBudget", "gpu-topology-extender")
    assert pdb["spec"] == {"minAvailable": 1, "unhealthyPodEvictionPolicy": "AlwaysAllow",
                           "selector": {"matchLabels": deployment["spec"]["selector"]["matchLabels"]}}
    (term,) = pod["affinity"]["podAntiAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
    assert term["podAffinityTerm"]["topologyKey"] == "kubernetes.io/hostname"
    assert term["podAffinityTerm"]["labelSelector"]["matchLabels"] == deployment["spec"]["selector"]["matchLabels"]


def test_placement_and_security_values_reach_the_standalone_pod() -> None:
    values = {"scheduler": {"mode": "default-scheduler", "nodeSelector": {"pool": "system"},
                            "affinity": {"podAntiAffinity": {}}, "priorityClassName": "acme-critical",
                            "tolerations": [{"key": "k", "operator": "Exists"}],
                            "podSecurityContext": {"runAsUser": 20000}},
              "extender": {"securityContext": {"capabilities": {"add": ["NET_BIND_SERVICE"]}},
                           "resources": {"requests": {"cpu": "1", "memory": "1Gi"},
                                         "limits": {"cpu": "2", "memory": "2Gi"}}}}
    _, pod, container = _extender(_render(values))
    assert pod["nodeSelector"] == {"pool": "system"} and pod["affinity"] == {"podAntiAffinity": {}}
    assert pod["priorityClassName"] == "acme-critical" and pod["tolerations"] == [{"key": "k", "operator": "Exists"}]
    assert pod["securityContext"]["runAsUser"] == 20000 and pod["securityContext"]["fsGroup"] == 10001
    assert container["securityContext"]["capabilities"] == {"drop": ["ALL"], "add": ["NET_BIND_SERVICE"]}
    assert container["resources"]["requests"] == {"cpu": "1", "memory": "1Gi"}


def test_without_leader_election_one_replica_as_before() -> None:
    values = {**DEFAULT, "standaloneExtender": {"replicas": 1, "leaderElection": {"enabled": False},
                                                "podDisruptionBudget": {"enabled": False}}}
    objects = _render(values)
    deployment, _, container = _extender(objects)
    assert deployment["spec"]["replicas"] == 1 and deployment["spec"]["strategy"] == {"type": "Recreate"}
    assert not any(a.startswith("--leader-elect") for a in container["args"])
    assert "env" not in container
    (https,) = find(objects, "Service", "gpu-topology-extender")
    assert ROLE not in https["spec"]["selector"]
    roles = [r["metadata"]["name"] for r in find(objects, "Role")]
    assert roles == ["gpu-topology-plugin-cleanup"]  # the uninstall hook's own, nothing for election
    assert find(objects, "PodDisruptionBudget") == []


FAILS = {
    "replicas without election": ({"standaloneExtender": {"leaderElection": {"enabled": False}}},
                                  "standaloneExtender.replicas > 1 needs standaloneExtender.leaderElection.enabled"),
    "undrainable": ({"standaloneExtender": {"replicas": 1}}, "podDisruptionBudget.minAvailable must be below"),
    "metrics on the API port": ({"standaloneExtender": {"metricsPort": 8443}}, "metricsPort must differ"),
    "zero replicas": ({"standaloneExtender": {"replicas": 0}}, "/standaloneExtender/replicas"),
    "role label in podLabels": ({"scheduler": {"podLabels": {ROLE: "leader"}}}, f"may not set {ROLE}"),
}


@pytest.mark.parametrize("case", sorted(FAILS))
def test_bad_standalone_values_fail_with_a_clear_message(case: str) -> None:
    values, message = FAILS[case]
    values = copy.deepcopy(values)
    values.setdefault("scheduler", {})["mode"] = "default-scheduler"
    with pytest.raises(helm_python.HelmError) as caught:
        render_chart_files(ChartVariant("gpu-topology", "gpu-topology", values))
    assert message in str(caught.value)


def test_second_scheduler_mode_is_unchanged() -> None:
    """standaloneExtender values touch nothing in second-scheduler mode."""
    changed = {"standaloneExtender": {"replicas": 3, "metricsPort": 9999, "leaderElection": {"leaseName": "x"}}}
    base = generated_masked(render_chart(CHART_VARIANTS["defaults"]))
    assert generated_masked(render_chart(ChartVariant("gpu-topology", "gpu-topology", changed))) == base
    assert not [o for o in base if o["metadata"]["name"].startswith("gpu-topology-extender")
                and o["kind"] not in ("ClusterRole", "ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding")]
