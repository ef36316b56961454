"""Uninstalling leaves every Node as it was: through the real kube-apiserver v1.36.2 (tests/helpers/controlplane.py),
a Node carries everything the plugin publishes (the real NodePublisher's topology, state and labels, a sharing
resource's free-gpus label, and an autoscaler hold it set), then
- `gpuplugin cleanup` (the chart's pre-delete hook, the kustomize user's command) leaves its labels and
  annotations exactly as they were before the plugin, the admin's opt-in label included;
- the plugin stopping on a node that opted out (label removed, so the DaemonSet removes its pod) does the same,
  while stopping on a node still opted in (a restart, an upgrade) keeps everything;
- a hold the plugin did not set, or one changed since, stays;
- `--daemonset` moves the plugin's DaemonSet off every node and waits for its pods before cleaning.

Skips, naming why, where the Kubernetes binaries (shared/kube beside the clone) or etcd are absent."""

from __future__ import annotations

import copy
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gpuplugin.autoscaler_hold import HOLD_ANNOTATIONS, HOLD_VALUE
from gpuplugin.node_cleanup import stop_leaver
from gpuplugin.publisher import NodePublisher, Publication
from gputopo.contract import DEFAULT_KEYS, KARPENTER_DO_NOT_DISRUPT
from gputopo.discovery.loader import load_topology_file
from gputopo.kube.client import make_api_client
from tests.helpers.controlplane import ControlPlane, tidied, wait_until
from tests.helpers.paths import REPO

pytestmark = [pytest.mark.timeout(240)]

KEYS = DEFAULT_KEYS
OPT_IN = {KEYS.device_plugin_label: "enabled"}
TOPOLOGY = REPO / "fixtures" / "topologies" / "dgx-a100-8gpu-10nic-1mcprddgx05.txt"
NS = "gpu-topology-cleanup"  # the release namespace of the rendered hook
DS = "gpu-topology-plugin"  # the chart's name of it for release gpu-topology
# the admin's own annotation and label: never ours
ADMIN_ANNOTATIONS = {"example.com/owner": "team-a"}
ADMIN_LABELS = {"example.com/rack": "r1", **OPT_IN}


@pytest.fixture(scope="module")
def cp(real_control_plane: ControlPlane) -> Iterator[ControlPlane]:
    with tidied(real_control_plane) as plane:
        plane.ensure_namespace(NS)
        yield plane


@pytest.fixture(scope="module")
def kubeconfig(cp: ControlPlane) -> Path:
    return cp.write_kubeconfig(cp.dir / "cleanup.kubeconfig")


@pytest.fixture
def api(kubeconfig: Path) -> Iterator[Any]:
    client = make_api_client(kubeconfig=str(kubeconfig))
    yield client
    client.close()


# written by the controller-manager's TTL controller whenever it gets to the Node: not the plugin's, nor the test's
CONTROL_PLANE_ANNOTATIONS = ("node.alpha.kubernetes.io/ttl",)


def metadata(cp: ControlPlane, name: str) -> tuple[dict[str, str], dict[str, str]]:
    meta = cp.request("GET", f"/api/v1/nodes/{name}")["metadata"]
    annotations = {k: v for k, v in (meta.get("annotations") or {}).items() if k not in CONTROL_PLANE_ANNOTATIONS}
    return dict(meta.get("labels") or {}), annotations


def publish_everything(cp: ControlPlane, api: Any, name: str, *, hold_keys: tuple[str, ...] = HOLD_ANNOTATIONS
                       ) -> NodePublisher:
    """The Node as a running plugin leaves it: the real publisher's annotations and labels, a shared resource's
    free-gpus label, and the autoscaler hold as the plugin records it (`<prefix>/autoscaler-hold` naming it)."""
    topology = load_topology_file(TOPOLOGY)
    publisher = NodePublisher(api, name, KEYS, topology, None, lambda: ["0", "1"], lambda: [],
                              extra_labels=lambda: {KEYS.free_gpus_label("nvidia.com/gpu.shared") or "": "3"})
    assert publisher.publish_once()
    hold = {k: HOLD_VALUE for k in hold_keys}
    cp.patch(f"/api/v1/nodes/{name}", {"metadata": {"annotations": {
        **hold, KEYS.autoscaler_hold: ",".join(hold_keys)}}})
    labels, annotations = metadata(cp, name)
    assert {KEYS.fabric_label, KEYS.count_label, KEYS.allreduce_label(8)} <= set(labels)
    assert {KEYS.topology, KEYS.state, KEYS.autoscaler_hold, *hold_keys} <= set(annotations)
    return publisher


def add_node(cp: ControlPlane, name: str, *, annotations: dict[str, str] | None = None
             ) -> tuple[dict[str, str], dict[str, str]]:
    cp.add_node(name, labels=ADMIN_LABELS, annotations={**ADMIN_ANNOTATIONS, **(annotations or {})},
                extended={"nvidia.com/gpu": "8"})
    return metadata(cp, name)


def run_cleanup(kubeconfig: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(Path(sys.executable).parent / "gpuplugin"), "cleanup", "--kubeconfig",
                           str(kubeconfig), *args], capture_output=True, text=True, timeout=120)


def plugin_pod(cp: ControlPlane, name: str, node: str) -> None:
    """The plugin's Pod as the DaemonSet controller makes it: the chart's opt-in affinity, plus its own matchFields
    pinning it to the node."""
    cp.request("POST", f"/api/v1/namespaces/{NS}/pods", {
        "metadata": {"name": name},
        "spec": {"nodeName": node, "containers": [{"name": "plugin", "image": "plugin:test"}],
                 "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
                     "nodeSelectorTerms": [{
                         "matchExpressions": [
                             {"key": KEYS.device_plugin_label, "operator": "In", "values": ["enabled"]},
                             {"key": "nvidia.com/gpu.deploy.device-plugin", "operator": "NotIn",
                              "values": ["true"]}],
                         "matchFields": [{"key": "metadata.name", "operator": "In", "values": [node]}]}]}}}}})


def test_cleanup_command_leaves_the_node_as_it_was(cp: ControlPlane, api: Any, kubeconfig: Path) -> None:
    before = add_node(cp, "clean-a")
    publish_everything(cp, api, "clean-a")
    done = run_cleanup(kubeconfig, "--node", "clean-a")
    assert done.returncode == 0, done.stderr
    assert metadata(cp, "clean-a") == before
    again = run_cleanup(kubeconfig, "--node", "clean-a")  # nothing left: a second run changes nothing
    assert again.returncode == 0 and again.stdout == "", again.stderr
    assert metadata(cp, "clean-a") == before


def test_cleanup_all_nodes(cp: ControlPlane, api: Any, kubeconfig: Path) -> None:
    before = {n: add_node(cp, n) for n in ("clean-b1", "clean-b2")}
    for n in before:
        publish_everything(cp, api, n)
    done = run_cleanup(kubeconfig, "--all")
    assert done.returncode == 0, done.stderr
    assert {n: metadata(cp, n) for n in before} == before


def test_a_hold_the_plugin_did_not_set_stays(cp: ControlPlane, api: Any, kubeconfig: Path) -> None:
    # the admin pinned the node for maintenance before the plugin ran: CA's annotation is theirs
    admin_hold = {HOLD_ANNOTATIONS[0]: HOLD_VALUE}
    before = add_node(cp, "clean-c", annotations=admin_hold)
    publish_everything(cp, api, "clean-c", hold_keys=(KARPENTER_DO_NOT_DISRUPT,))
    # someone changed the plugin's Karpenter hold since: no longer ours either
    cp.patch("/api/v1/nodes/clean-c", {"metadata": {"annotations": {KARPENTER_DO_NOT_DISRUPT: "pinned-by-ops"}}})
    done = run_cleanup(kubeconfig, "--node", "clean-c")
    assert done.returncode == 0, done.stderr
    labels, annotations = metadata(cp, "clean-c")
    assert labels == before[0]
    assert annotations == {**before[1], KARPENTER_DO_NOT_DISRUPT: "pinned-by-ops"}


def test_opted_out_node_is_cleaned_when_the_plugin_stops(cp: ControlPlane, api: Any) -> None:
    before = add_node(cp, "clean-d")
    publisher = publish_everything(cp, api, "clean-d")
    plugin_pod(cp, "plugin-d", "clean-d")
    cp.patch("/api/v1/nodes/clean-d", {"metadata": {"labels": {KEYS.device_plugin_label: None}}})  # opt out
    publication = Publication(publisher, None, [], on_stop=stop_leaver(api, "clean-d", KEYS, "plugin-d")).start()
    publication.stop()
    labels, annotations = metadata(cp, "clean-d")
    expected_labels = copy.deepcopy(before[0])
    del expected_labels[KEYS.device_plugin_label]  # the admin's own change, kept
    assert (labels, annotations) == (expected_labels, before[1])


def test_a_restart_on_an_opted_in_node_keeps_everything(cp: ControlPlane, api: Any) -> None:
    add_node(cp, "clean-e")
    publisher = publish_everything(cp, api, "clean-e")
    published = metadata(cp, "clean-e")
    plugin_pod(cp, "plugin-e", "clean-e")
    publication = Publication(publisher, None, [], on_stop=stop_leaver(api, "clean-e", KEYS, "plugin-e")).start()
    publication.stop()
    assert metadata(cp, "clean-e") == published
    # and a plugin that cannot find its own Pod keeps them too: it cannot tell
    stop_leaver(api, "clean-e", KEYS, "no-such-pod")()
    assert metadata(cp, "clean-e") == published


def hook_kubeconfig(cp: ControlPlane) -> Path:
    """A kubeconfig with the token of the chart's uninstall hook account, its RBAC applied as rendered."""
    from tests.deploy.rendering import ChartVariant, render_chart

    objects = render_chart(ChartVariant("gpu-topology", NS, {}))
    hooked = [o for o in objects if (o["metadata"].get("annotations") or {}).get("helm.sh/hook") == "pre-delete"]
    account = next(o["metadata"]["name"] for o in hooked if o["kind"] == "ServiceAccount")
    for obj in hooked:
        if obj["kind"] == "ServiceAccount":
            cp.ensure_service_account(NS, account)
        elif obj["kind"] in ("ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding"):
            cp.create(obj)
    token = cp.request("POST", f"/api/v1/namespaces/{NS}/serviceaccounts/{account}/token",
                       {"spec": {"expirationSeconds": 3600}})["status"]["token"]
    return cp.write_kubeconfig(cp.dir / "cleanup-hook.kubeconfig", token)


def test_the_hook_stops_the_daemonset_then_cleans_with_its_own_rbac(cp: ControlPlane, api: Any) -> None:
    """As the chart's pre-delete Job runs it: its account and RBAC only, the plugin's DaemonSet moved to no node
    and its pods waited for, then every node cleaned."""
    before = add_node(cp, "clean-f")
    publish_everything(cp, api, "clean-f")
    labels = {"app.kubernetes.io/name": DS}
    cp.request("POST", f"/apis/apps/v1/namespaces/{NS}/daemonsets", {
        "metadata": {"name": DS, "labels": labels},
        "spec": {"selector": {"matchLabels": labels}, "template": {
            "metadata": {"labels": labels},
            "spec": {"containers": [{"name": "plugin", "image": "plugin:test"}],
                     "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
                         "nodeSelectorTerms": [{"matchExpressions": [
                             {"key": KEYS.device_plugin_label, "operator": "In", "values": ["enabled"]}]}]}}}}}}})

    def ds_pods() -> list[str]:
        return [p["metadata"]["name"] for p in cp.list_items(f"/api/v1/namespaces/{NS}/pods",
                                                              labelSelector=f"app.kubernetes.io/name={DS}")]

    wait_until("the DaemonSet's pods", ds_pods, 60)
    done = run_cleanup(hook_kubeconfig(cp), "--all", "--daemonset", f"{NS}/{DS}", "--wait", "60")
    assert done.returncode == 0, done.stderr
    assert ds_pods() == []
    assert metadata(cp, "clean-f") == before
