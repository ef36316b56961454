"""The chart behaves like the charts platform teams already run (NVIDIA's device-plugin chart, the GPU Operator):
`global` from a parent chart, nameOverride / fullnameOverride, updateStrategy per DaemonSet, podSecurityContext /
securityContext per component merged over the chart's hardened defaults, and kubeVersion enforced."""

from __future__ import annotations

import copy
from typing import Any

import helm_python
import pytest

from tests.deploy.rendering import (
    CHART,
    ChartVariant,
    containers,
    find,
    install_dry_run,
    render_chart,
    render_chart_files,
)

MPS = {"enabled": True, "configs": {"mps": "version: v1\nsharing:\n  mps:\n    resources:\n"
                                          "    - {name: nvidia.com/gpu, replicas: 4}\n"}}
EVERYTHING = {"plugin": {"sharing": MPS}, "dra": {"enabled": True}}
NOT_NAMED_BY_FULLNAME = {"Namespace", "DeviceClass"}
ROOT_AGENT = {"runAsUser": 0, "runAsGroup": 0, "runAsNonRoot": False, "privileged": False,
              "allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True, "capabilities": {"drop": ["ALL"]}}
NON_ROOT = {"runAsNonRoot": True, "privileged": False, "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": True, "capabilities": {"drop": ["ALL"]}}
SECCOMP = {"seccompProfile": {"type": "RuntimeDefault"}}
EXTENDER_POD = {"runAsNonRoot": True, "runAsUser": 10001, "runAsGroup": 10001, "fsGroup": 10001, **SECCOMP}


def _render(values: dict[str, Any], release: str = "gpu-topology") -> list[dict[str, Any]]:
    return render_chart(ChartVariant(release, "gpu-topology", copy.deepcopy(values)))


def _workloads(objects: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {w["metadata"]["labels"]["app.kubernetes.io/component"]: w
            for w in find(objects, "DaemonSet") + find(objects, "Deployment")}


def test_global_from_a_parent_chart_is_accepted() -> None:
    values = {"global": {"imageRegistry": "registry.acme.example", "imagePullSecrets": []}}
    assert _render(values)
    report = helm_python.lint(CHART, values, strict=True, namespace="gpu-topology")
    assert report["errors"] == []


@pytest.mark.parametrize("mode", ["second-scheduler", "default-scheduler"])
@pytest.mark.parametrize(("release", "values", "prefix"), [
    ("gpu-topology", {}, "gpu-topology-"),
    ("prod", {}, "prod-gpu-topology-"),
    ("prod", {"nameOverride": "gpus"}, "prod-gpus-"),
    ("gpus-prod", {"nameOverride": "gpus"}, "gpus-prod-"),
    ("prod", {"fullnameOverride": "acme-gpu"}, "acme-gpu-"),
    ("prod", {"fullnameOverride": "a" * 60}, "a" * 40 + "-"),
])
def test_every_object_name_derives_from_the_fullname(mode: str, release: str, values: dict[str, Any],
                                                     prefix: str) -> None:
    values = {**copy.deepcopy(EVERYTHING), **values, "scheduler": {"mode": mode},
              "serviceMonitor": {"enabled": True}}
    objects = _render(values, release)
    names = {(o["kind"], o["metadata"]["name"]) for o in objects}
    assert all(name.startswith(prefix) for kind, name in names if kind not in NOT_NAMED_BY_FULLNAME), names
    assert all(len(name) <= 63 for kind, name in names if kind in ("Service", "ServiceAccount", "Deployment",
                                                                   "DaemonSet"))
    # What names refer to follows: accounts, role references, config maps, the webhook's Service.
    for workload in find(objects, "DaemonSet") + find(objects, "Deployment"):
        pod = workload["spec"]["template"]["spec"]
        assert ("ServiceAccount", pod["serviceAccountName"]) in names
        for volume in pod.get("volumes", []):
            if "configMap" in volume:
                assert ("ConfigMap", volume["configMap"]["name"]) in names
    for binding in find(objects, "RoleBinding") + find(objects, "ClusterRoleBinding"):
        ref = binding["roleRef"]
        assert (ref["kind"], ref["name"]) in names or ref["name"].startswith(("system:", "extension-apiserver"))
        for subject in binding["subjects"]:
            assert ("ServiceAccount", subject["name"]) in names
    for hook in (h for c in find(objects, "MutatingWebhookConfiguration") for h in c["webhooks"]):
        assert ("Service", hook["clientConfig"]["service"]["name"]) in names


def test_default_names_are_unchanged() -> None:
    names = {o["metadata"]["name"] for o in _render({"scheduler": {"mode": "default-scheduler"}})}
    assert {"gpu-topology-plugin", "gpu-topology-extender", "gpu-topology-extender-metrics"} <= names


def test_update_strategies() -> None:
    workloads = _workloads(_render(EVERYTHING))
    one_at_a_time = {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 1}}
    assert workloads["device-plugin"]["spec"]["updateStrategy"] == one_at_a_time
    assert workloads["dra-driver"]["spec"]["updateStrategy"] == one_at_a_time
    assert workloads["mps-control"]["spec"]["updateStrategy"] == {"type": "OnDelete"}
    values = copy.deepcopy(EVERYTHING)
    values["plugin"]["updateStrategy"] = {"type": "OnDelete"}
    values["dra"]["updateStrategy"] = {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": "25%"}}
    workloads = _workloads(_render(values))
    assert workloads["device-plugin"]["spec"]["updateStrategy"] == {"type": "OnDelete"}
    assert workloads["dra-driver"]["spec"]["updateStrategy"]["rollingUpdate"] == {"maxUnavailable": "25%"}
    with pytest.raises(helm_python.HelmError, match="/plugin/updateStrategy"):
        render_chart_files(ChartVariant("r", "ns", {"plugin": {"updateStrategy": {"type": "Sometimes"}}}))


# component label -> (values path of podSecurityContext / securityContext, container, chart's pod default,
# chart's container default)
SECURITY = {
    "device-plugin": (("plugin",), ("plugin",), "plugin", SECCOMP, ROOT_AGENT),
    "mps-control": (("plugin", "sharing", "mps", "control"), ("plugin", "sharing", "mps", "control"), "mps-control",
                    SECCOMP, ROOT_AGENT),
    "dra-driver": (("dra",), ("dra",), "driver", SECCOMP, ROOT_AGENT),
    "webhook": (("webhook",), ("webhook",), "webhook", EXTENDER_POD, NON_ROOT),
    "scheduler": (("scheduler",), ("scheduler",), "kube-scheduler",
                  {"runAsNonRoot": True, "runAsUser": 65532, "runAsGroup": 65532, **SECCOMP}, NON_ROOT),
    "scheduler/extender": (("scheduler",), ("extender",), "extender",
                           {"runAsNonRoot": True, "runAsUser": 65532, "runAsGroup": 65532, **SECCOMP},
                           {**NON_ROOT, "runAsUser": 10001, "runAsGroup": 10001}),
    "extender": (("scheduler",), ("extender",), "extender", EXTENDER_POD, NON_ROOT),
}


def _set(values: dict[str, Any], path: tuple[str, ...], key: str, value: Any) -> None:
    for part in path:
        values = values.setdefault(part, {})
    values[key] = value


def _security(values: dict[str, Any], component: str) -> tuple[dict[str, Any], dict[str, Any]]:
    mode = "default-scheduler" if component == "extender" else "second-scheduler"
    values = {**copy.deepcopy(values), "scheduler": {**values.get("scheduler", {}), "mode": mode}}
    workload = _workloads(_render(values))[component.partition("/")[0]]
    container = SECURITY[component][2]
    (pod, found), = [(p, c) for p, c in containers(workload) if c["name"] == container]
    return pod["securityContext"], found["securityContext"]


@pytest.mark.parametrize("component", sorted(SECURITY))
def test_security_contexts_keep_the_hardened_defaults(component: str) -> None:
    pod, container = _security(EVERYTHING, component)
    assert (pod, container) == SECURITY[component][3:]


@pytest.mark.parametrize("component", sorted(SECURITY))
def test_security_context_overrides_merge_over_the_defaults(component: str) -> None:
    pod_path, container_path, _, pod_default, container_default = SECURITY[component]
    values = copy.deepcopy(EVERYTHING)
    _set(values, pod_path, "podSecurityContext", {"seLinuxOptions": {"type": "spc_t"}, "runAsUser": 4242})
    _set(values, container_path, "securityContext", {"readOnlyRootFilesystem": False,
                                                     "capabilities": {"add": ["SYS_ADMIN"]}})
    pod, container = _security(values, component)
    assert pod == {**pod_default, "seLinuxOptions": {"type": "spc_t"}, "runAsUser": 4242}
    assert container == {**container_default, "readOnlyRootFilesystem": False,
                         "capabilities": {"drop": ["ALL"], "add": ["SYS_ADMIN"]}}, "false overrides true"


def test_kube_version_is_enforced() -> None:
    """`helm install` on a cluster older than Chart.yaml's kubeVersion is refused with Helm's own message."""
    variant = ChartVariant("gpu-topology", "gpu-topology", {})
    with pytest.raises(helm_python.HelmError) as caught:
        install_dry_run(variant, "v1.29.9")
    assert "chart requires kubeVersion: >=1.30.0-0 which is incompatible with Kubernetes v1.29.9" in str(caught.value)
    for version in ("v1.30.0", "v1.33.5-eks-1a2b3c"):
        assert "kind: DaemonSet" in install_dry_run(variant, version)
