"""The Helm chart: lints clean, values reach the objects they configure, bad values fail with a clear message,
and with default values it installs the same pods as the kustomize manifests."""

from __future__ import annotations

import copy
from typing import Any

import helm_python
import pytest

from tests.deploy.rendering import (
    CHART,
    CHART_VARIANTS,
    MANIFESTS,
    ChartVariant,
    containers,
    find,
    kustomize_build,
    newest_kubernetes_versions,
    render_chart,
    render_chart_files,
)


@pytest.mark.parametrize("variant", sorted(CHART_VARIANTS))
def test_helm_lint_is_clean(variant: str) -> None:
    report = helm_python.lint(CHART, CHART_VARIANTS[variant].values, strict=True,
                              namespace=CHART_VARIANTS[variant].namespace,
                              kube_version=f"v{newest_kubernetes_versions(1)[0]}")
    serious = [m for m in report["messages"] if m["severity"] >= 2]
    assert report["errors"] == [] and serious == []


def test_custom_values_reach_their_objects() -> None:
    variant = CHART_VARIANTS["custom"]
    objects = render_chart(variant)
    values = variant.values
    namespaced = [o for o in objects if o["kind"] not in ("ClusterRole", "ClusterRoleBinding")]
    for obj in namespaced:
        expected = "kube-system" if obj["kind"] == "RoleBinding" and obj["metadata"]["name"].endswith(
            "auth-reader") else variant.namespace
        assert obj["metadata"]["namespace"] == expected, obj["metadata"]["name"]
    assert all(o["metadata"]["name"].startswith("prod-gpu-topology-") for o in objects)

    (daemonset,) = find(objects, "DaemonSet")
    pod = daemonset["spec"]["template"]["spec"]
    plugin = pod["containers"][0]
    assert pod["runtimeClassName"] == "nvidia"
    assert pod["nodeSelector"] == values["plugin"]["nodeSelector"]
    assert pod["tolerations"] == values["plugin"]["tolerations"]
    assert plugin["image"] == "registry.acme.example/gpu-topology/plugin:0.1.0-rc1"
    assert plugin["imagePullPolicy"] == "Always"
    terms = pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    assert all(any(e["key"] == "topo.acme.example/device-plugin" for e in t["matchExpressions"]) for t in terms)

    (deployment,) = find(objects, "Deployment")
    assert deployment["spec"]["replicas"] == 3
    images = {c["name"]: c["image"] for _, c in containers(deployment)}
    assert images == {"kube-scheduler": "registry.k8s.io/kube-scheduler:v1.35.4",
                      "extender": "registry.acme.example/gpu-topology/extender:0.1.0-rc1"}
    extender = next(c for _, c in containers(deployment) if c["name"] == "extender")
    assert "--reservation-timeout=120" in extender["args"] and "--metrics-port=18889" in extender["args"]
    assert extender["ports"] == [{"name": "http-metrics", "containerPort": 18889, "protocol": "TCP"}]
    (service,) = find(objects, "Service", "prod-gpu-topology-scheduler-metrics")
    assert {"name": "http-metrics", "port": 18889, "targetPort": "http-metrics", "protocol": "TCP"} in \
        service["spec"]["ports"]
    (pdb,) = find(objects, "PodDisruptionBudget")
    assert pdb["spec"]["minAvailable"] == 2
    for policy in find(objects, "NetworkPolicy"):
        assert policy["spec"]["ingress"][0]["from"] == values["networkPolicy"]["metricsFrom"]


def test_default_scheduler_mode_runs_no_scheduler_and_one_https_extender() -> None:
    objects = render_chart(CHART_VARIANTS["default-scheduler"])
    (deployment,) = find(objects, "Deployment")
    assert [c["name"] for _, c in containers(deployment)] == ["extender"]
    assert deployment["spec"]["replicas"] == 1 and deployment["spec"]["strategy"]["type"] == "Recreate"
    assert find(objects, "ConfigMap") == [] and find(objects, "PodDisruptionBudget") == []
    volumes = deployment["spec"]["template"]["spec"]["volumes"]
    assert {"name": "tls", "secret": {"secretName": "gpu-extender-tls", "defaultMode": 0o440}} in volumes


BAD_VALUES: dict[str, tuple[dict[str, Any], str]] = {
    "unknown mode": ({"scheduler": {"mode": "both"}}, "/scheduler/mode"),
    "list strategy": ({"plugin": {"deviceListStrategy": "volume-mounts"}}, "/plugin/deviceListStrategy"),
    "id strategy": ({"plugin": {"deviceIdStrategy": "serial"}}, "/plugin/deviceIdStrategy"),
    "kubernetes.io resource": ({"resourceName": "kubernetes.io/gpu"}, "/resourceName"),
    "prefix with slash": ({"annotationPrefix": "gpu-topology.io/x"}, "/annotationPrefix"),
    "zero weight": ({"scheduler": {"weight": 0}}, "/scheduler/weight"),
    "timeout without unit": ({"scheduler": {"httpTimeout": "5"}}, "/scheduler/httpTimeout"),
    "typo": ({"scheduler": {"replica": 3}}, "replica"),
    "racing schedulers": ({"scheduler": {"leaderElection": {"enabled": False}}}, "leaderElection.enabled=true"),
    "undrainable": ({"scheduler": {"podDisruptionBudget": {"minAvailable": 2}}}, "minAvailable must be below"),
    "metrics on the API port": ({"scheduler": {"extenderMetricsPort": 8888}}, "extenderMetricsPort must differ"),
}


@pytest.mark.parametrize("case", sorted(BAD_VALUES))
def test_bad_values_fail_with_a_message_naming_them(case: str) -> None:
    values, named = BAD_VALUES[case]
    with pytest.raises(helm_python.HelmError) as caught:
        render_chart_files(ChartVariant("gpu-topology", "gpu-topology", copy.deepcopy(values)))
    assert named in str(caught.value)


def _pod_essentials(workload: dict[str, Any]) -> dict[str, Any]:
    """The parts of a pod that decide what runs and how (labels and chart bookkeeping left out)."""
    pod = copy.deepcopy(workload["spec"]["template"]["spec"])
    pod.pop("affinity", None)  # selector labels differ (the chart adds the release); checked elsewhere
    return pod


@pytest.mark.parametrize("kind", ["DaemonSet", "Deployment"])
def test_chart_defaults_install_the_same_pods_as_kustomize(kind: str) -> None:
    (chart,) = find(render_chart(CHART_VARIANTS["defaults"]), kind)
    (kustomize,) = find(kustomize_build(MANIFESTS), kind)
    assert chart["metadata"]["name"] == kustomize["metadata"]["name"]
    assert chart["spec"].get("replicas") == kustomize["spec"].get("replicas")
    assert _pod_essentials(chart) == _pod_essentials(kustomize)
    if kind == "DaemonSet":
        assert chart["spec"]["template"]["spec"]["affinity"] == kustomize["spec"]["template"]["spec"]["affinity"]


def test_notes_tell_how_to_opt_in_and_check() -> None:
    notes = render_chart_files(CHART_VARIANTS["custom"])["gpu-topology/templates/NOTES.txt"]
    assert "schedulerName: topology-aware" in notes
    assert "acme.example/gpu: 4" in notes
    assert "topo.acme.example/topology" in notes and "topo.acme.example/plan" in notes
