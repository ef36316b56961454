"""The chart's uninstall hook: `helm uninstall` runs `gpuplugin cleanup` as a pre-delete Job under its own account
before the DaemonSet goes, so no Node keeps the plugin's keys (an autoscaler hold left behind pins a node for ever).
What the Job runs is tested against the real kube-apiserver in tests/integration/test_uninstall_cleanup_real.py."""

from __future__ import annotations

from typing import Any

import pytest

from tests.deploy.rendering import ChartVariant, find, render_chart

HOOK = "helm.sh/hook"


def hook_objects(values: dict[str, Any], release: str = "gpu-topology", namespace: str = "gpu-topology"
                 ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    objects = render_chart(ChartVariant(release, namespace, values))
    return objects, [o for o in objects if (o["metadata"].get("annotations") or {}).get(HOOK)]


def job_args(hooked: list[dict[str, Any]]) -> list[str]:
    (job,) = find(hooked, "Job")
    (container,) = job["spec"]["template"]["spec"]["containers"]
    assert container["command"] == ["gpuplugin"]
    return list(container["args"])


def test_defaults_render_a_pre_delete_job_that_stops_the_plugin_daemonset_and_cleans_every_node() -> None:
    objects, hooked = hook_objects({})
    assert {o["metadata"]["annotations"][HOOK] for o in hooked} == {"pre-delete"}
    kinds = sorted(o["kind"] for o in hooked)
    assert kinds == ["ClusterRole", "ClusterRoleBinding", "Job", "NetworkPolicy", "Role", "RoleBinding",
                     "ServiceAccount"]
    (daemonset,) = [d for d in find(objects, "DaemonSet") if d["metadata"]["name"].endswith("-plugin")]
    ds = f"{daemonset['metadata']['namespace']}/{daemonset['metadata']['name']}"
    assert job_args(hooked) == ["cleanup", "--all", "--annotation-prefix=gpu-topology.io", f"--daemonset={ds}",
                                "--wait=120"]
    # the account and its grants exist before the Job (lower weight), and each is deleted once it succeeded,
    # or left for a look when it failed
    weights = {o["kind"]: int(o["metadata"]["annotations"]["helm.sh/hook-weight"]) for o in hooked}
    assert all(w < weights["Job"] for k, w in weights.items() if k != "Job")
    assert {o["metadata"]["annotations"]["helm.sh/hook-delete-policy"] for o in hooked} == {
        "before-hook-creation,hook-succeeded"}
    (job,) = find(hooked, "Job")
    (account,) = find(hooked, "ServiceAccount")
    assert job["spec"]["template"]["spec"]["serviceAccountName"] == account["metadata"]["name"]
    assert job["spec"]["template"]["spec"]["restartPolicy"] == "Never"
    assert job["spec"]["activeDeadlineSeconds"] > 120


def test_its_daemonset_grant_names_the_plugin_daemonset_only() -> None:
    objects, hooked = hook_objects({})
    (role,) = find(hooked, "Role")
    (daemonset,) = [d for d in find(objects, "DaemonSet") if d["metadata"]["name"].endswith("-plugin")]
    (rule,) = [r for r in role["rules"] if r["apiGroups"] == ["apps"]]
    assert rule["resourceNames"] == [daemonset["metadata"]["name"]] and rule["verbs"] == ["patch"]


def test_custom_release_prefix_and_wait_reach_the_job() -> None:
    _, hooked = hook_objects({"annotationPrefix": "topo.acme.example", "namespace": {"name": "gpu-system"},
                              "plugin": {"uninstallCleanup": {"waitSeconds": 30,
                                                              "nodeSelector": {"kubernetes.io/os": "linux"}}}},
                             release="prod", namespace="default")
    assert job_args(hooked) == ["cleanup", "--all", "--annotation-prefix=topo.acme.example",
                                "--daemonset=gpu-system/prod-gpu-topology-plugin", "--wait=30"]
    (job,) = find(hooked, "Job")
    assert job["metadata"]["namespace"] == "gpu-system"
    assert job["spec"]["template"]["spec"]["nodeSelector"] == {"kubernetes.io/os": "linux"}


@pytest.mark.parametrize(("gfd", "expected"), [(True, True), (False, False)])
def test_gfd_labels_go_too_where_the_plugin_writes_them(gfd: bool, expected: bool) -> None:
    _, hooked = hook_objects({"plugin": {"sharing": {"enabled": True, "gfdLabels": gfd, "configMapName": "mine"}}})
    assert ("--gfd-labels" in job_args(hooked)) is expected


@pytest.mark.parametrize("values", [{"plugin": {"uninstallCleanup": {"enabled": False}}},
                                    {"plugin": {"enabled": False}}])
def test_no_hook_when_turned_off_or_without_the_plugin(values: dict[str, Any]) -> None:
    _, hooked = hook_objects(values)
    assert hooked == []


def test_without_network_policies_the_hook_has_none_either() -> None:
    _, hooked = hook_objects({"networkPolicy": {"enabled": False}})
    assert find(hooked, "NetworkPolicy") == []
