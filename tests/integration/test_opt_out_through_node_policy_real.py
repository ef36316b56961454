"""The plugin's own opt-out cleanup passes the chart's node policy: with the chart's RBAC and
ValidatingAdmissionPolicies applied to the real kube-apiserver v1.36.2, the plugin's account holding a token bound to
its pod on the node (as the kubelet mounts it), a node that published everything and then opted out is left as it
was by the stopping plugin, through the same policy that keeps the plugin to its own node's keys.

Skips, naming why, where the Kubernetes binaries (shared/kube beside the clone) or etcd are absent."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import pytest

from gpuplugin.autoscaler_hold import HOLD_ANNOTATIONS, HOLD_VALUE
from gpuplugin.node_cleanup import stop_leaver
from gpuplugin.publisher import NodePublisher
from gputopo.contract import DEFAULT_KEYS
from gputopo.discovery.loader import load_topology_file
from gputopo.kube.client import make_api_client
from tests.helpers.controlplane import ControlPlane, tidied, wait_until
from tests.helpers.paths import REPO

pytestmark = [pytest.mark.timeout(240)]

KEYS = DEFAULT_KEYS
NS = "gpu-topology"  # the namespace the chart's policy names the plugin's account in
PLUGIN = "gpu-topology-plugin"
NODE, OTHER = "policy-opt-out", "policy-other"
TOPOLOGY = REPO / "fixtures" / "topologies" / "aws-p5.48xlarge.txt"
POLICY_KINDS = ("ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding", "ValidatingAdmissionPolicy",
                "ValidatingAdmissionPolicyBinding")
CONTROL_PLANE_ANNOTATIONS = ("node.alpha.kubernetes.io/ttl",)


def metadata(cp: ControlPlane, name: str) -> tuple[dict[str, str], dict[str, str]]:
    meta = cp.request("GET", f"/api/v1/nodes/{name}")["metadata"]
    annotations = {k: v for k, v in (meta.get("annotations") or {}).items() if k not in CONTROL_PLANE_ANNOTATIONS}
    return dict(meta.get("labels") or {}), annotations


@pytest.fixture(scope="module")
def cluster(real_control_plane: ControlPlane) -> Iterator[tuple[ControlPlane, Any, str]]:
    from tests.deploy.rendering import ChartVariant, render_chart

    objects = render_chart(ChartVariant("gpu-topology", NS, {}))
    with tidied(real_control_plane) as cp:
        def active() -> bool:
            r = cp.api().get(f"/api/v1/namespaces/{NS}")
            return r.status_code == 404 or r.json().get("status", {}).get("phase") == "Active"

        wait_until(f"namespace {NS} gone or active", active, 60)
        cp.ensure_namespace(NS)
        cp.ensure_service_account(NS, PLUGIN)
        for obj in objects:
            if obj["kind"] in POLICY_KINDS and not (obj["metadata"].get("annotations") or {}).get("helm.sh/hook"):
                cp.create(obj)
        cp.add_node(NODE, labels={KEYS.device_plugin_label: "enabled"})
        cp.add_node(OTHER)
        pod = cp.request("POST", f"/api/v1/namespaces/{NS}/pods", {
            "metadata": {"name": "plugin-on-node"},
            "spec": {"nodeName": NODE, "serviceAccountName": PLUGIN, "terminationGracePeriodSeconds": 0,
                     "containers": [{"name": "plugin", "image": "registry.invalid/none:0"}],
                     "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
                         "nodeSelectorTerms": [{"matchExpressions": [
                             {"key": KEYS.device_plugin_label, "operator": "In", "values": ["enabled"]}]}]}}}}})
        token = cp.request("POST", f"/api/v1/namespaces/{NS}/serviceaccounts/{PLUGIN}/token", {"spec": {
            "expirationSeconds": 3600, "boundObjectRef": {"kind": "Pod", "apiVersion": "v1", "name": "plugin-on-node",
                                                          "uid": pod["metadata"]["uid"]}}})["status"]["token"]
        api = make_api_client(kubeconfig=str(cp.write_kubeconfig(cp.dir / "plugin-policy.kubeconfig", token)))
        # the policies apply once the apiserver's informer has them: until another node is refused (bounded)
        with cp.new_client() as c:
            c.headers["Authorization"] = f"Bearer {token}"
            deadline = time.monotonic() + 20
            while True:
                status = c.patch(f"/api/v1/nodes/{OTHER}", params={"dryRun": "All"},
                                 content=json.dumps({"metadata": {"labels": {KEYS.count_label: "8"}}}),
                                 headers={"Content-Type": "application/merge-patch+json"}).status_code
                if status != 200 or time.monotonic() > deadline:
                    break
                time.sleep(0.25)
            assert status in (403, 422), f"the chart's node policy never took effect ({status})"
        try:
            yield cp, api, "plugin-on-node"
        finally:
            api.close()


def test_the_stopping_plugin_cleans_its_opted_out_node_through_the_policy(
        cluster: tuple[ControlPlane, Any, str]) -> None:
    cp, api, pod = cluster
    before = metadata(cp, NODE)
    NodePublisher(api, NODE, KEYS, load_topology_file(TOPOLOGY), None, lambda: [], lambda: []).publish_once()
    # the hold as the plugin sets it, through the policy with its own token
    from gputopo.kube.patching import patch_node_metadata

    patch_node_metadata(api, NODE, annotations={**dict.fromkeys(HOLD_ANNOTATIONS, HOLD_VALUE),
                                                KEYS.autoscaler_hold: ",".join(HOLD_ANNOTATIONS)})
    assert set(HOLD_ANNOTATIONS) <= set(metadata(cp, NODE)[1])
    cp.patch(f"/api/v1/nodes/{NODE}", {"metadata": {"labels": {KEYS.device_plugin_label: None}}})  # opts out
    stop_leaver(api, NODE, KEYS, pod)()
    labels, annotations = metadata(cp, NODE)
    expected = {k: v for k, v in before[0].items() if k != KEYS.device_plugin_label}
    assert (labels, annotations) == (expected, before[1])
