"""Each node agent may write only its own node, as the real kube-apiserver v1.36.2 enforces it
(tests/helpers/controlplane.py): RBAC cannot name "the node this pod runs on", so the plugin's account holds `nodes
patch` and the DRA driver's `resourceslices create/update/delete` cluster-wide, and the chart's (and the
manifests') ValidatingAdmissionPolicies narrow them with the node name the kube-apiserver puts into the credential
of a pod's own token (user extra `authentication.kubernetes.io/node-name`, ServiceAccountTokenPodNodeInfo).

Here the tokens are what the kubelet mounts: a TokenRequest bound to a Pod bound to node A, of the account the chart
creates, with the chart's RBAC and policies applied as rendered (or as deploy/manifests lists them). With it the
plugin's patch of node A's own keys goes through; node B, node A's other labels and annotations, its spec, and a
hold someone else set on it are refused; a token of no pod (no node) is refused; another account of the chart's
namespace (the uninstall hook's) is not matched. The DRA driver's token writes its node's ResourceSlices only.

Skips, naming why, where the Kubernetes binaries (shared/kube beside the clone) or etcd are absent."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from gpuplugin.autoscaler_hold import HOLD_ANNOTATIONS, HOLD_VALUE
from gpuplugin.publisher import topology_labels
from gpuplugin.sharing.labels import MPS_CAPABLE, PRODUCT, REPLICAS, STRATEGY
from gputopo.contract import DEFAULT_KEYS
from gputopo.discovery.loader import load_topology_file
from tests.extender.conftest import H100X4
from tests.helpers.controlplane import ControlPlane, tidied, wait_until
from tests.helpers.paths import short_dir

pytestmark = [pytest.mark.timeout(300)]

NS = "gpu-topology"
PLUGIN = "gpu-topology-plugin"
DRA = "gpu-topology-dra"
DRIVER = "gpu-topology.io"  # dra.driverName's default
NODE_A, NODE_B = "restrict-a", "restrict-b"
POLICY_KINDS = ("ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding", "ValidatingAdmissionPolicy",
                "ValidatingAdmissionPolicyBinding")
SLICES = "/apis/resource.k8s.io/v1/resourceslices"
# GPUs 2 and 3 shared (nvidia.com/gpu.shared), 0 and 1 whole: the free-gpus label and the GFD labels are written.
SHARED_HALF = ("version: v1\nsharing:\n  timeSlicing:\n    renameByDefault: true\n    resources:\n"
               "    - name: nvidia.com/gpu\n      replicas: 2\n      devices: [2, 3]\n")
SHARING = "version: v1\nsharing:\n  timeSlicing:\n    resources:\n    - name: nvidia.com/gpu\n      replicas: 2\n"


def _objects(source: str) -> list[dict[str, Any]]:
    """The RBAC and policy objects as installed: the chart with sharing (its GFD labels) and DRA on, or the
    manifests' plugin folder."""
    from tests.deploy.rendering import MANIFESTS, ChartVariant, kustomize_build, render_chart

    if source == "chart":
        return render_chart(ChartVariant("gpu-topology", NS, {
            "dra": {"enabled": True}, "plugin": {"sharing": {"enabled": True, "configs": {"slicing": SHARING}}}}))
    return kustomize_build(MANIFESTS)


def owned_annotations(hold: bool) -> dict[str, str | None]:
    """Every annotation the plugin writes: topology, state, and the autoscaler hold it sets (or lifts)."""
    held = {k: HOLD_VALUE if hold else None for k in HOLD_ANNOTATIONS}
    return {DEFAULT_KEYS.topology: '{"v":1}', DEFAULT_KEYS.state: '{"v":1,"gen":1,"used":[],"unhealthy":[]}',
            **held, DEFAULT_KEYS.autoscaler_hold: ",".join(HOLD_ANNOTATIONS) if hold else None}


def owned_labels(gfd: bool) -> dict[str, str | None]:
    """Every label the plugin writes for a 4-GPU NVLink node (the publisher's own function), a shared resource's
    free GPUs, and (with sharing) the GPU Feature Discovery labels."""
    labels: dict[str, str | None] = dict(topology_labels(DEFAULT_KEYS, load_topology_file(H100X4)))
    labels[str(DEFAULT_KEYS.free_gpus_label("nvidia.com/gpu.shared"))] = "3"
    if gfd:
        labels.update({REPLICAS: "2", STRATEGY: "time-slicing", PRODUCT: "NVIDIA-H100-SHARED", MPS_CAPABLE: "false"})
    return labels


@dataclass
class Cluster:
    cp: ControlPlane
    source: str
    tokens: dict[str, str]  # account -> token bound to that account's pod on NODE_A

    def client(self, token: str) -> httpx.Client:
        c = self.cp.new_client()
        c.headers["Authorization"] = f"Bearer {token}"
        return c

    def node(self, name: str) -> dict[str, Any]:
        return self.cp.request("GET", f"/api/v1/nodes/{name}")  # type: ignore[no-any-return]


def _token(cp: ControlPlane, account: str, pod: Mapping[str, Any] | None) -> str:
    """A TokenRequest as the kubelet makes it for a pod's projected volume (bound to the Pod), or unbound."""
    spec: dict[str, Any] = {"expirationSeconds": 3600}
    if pod is not None:
        spec["boundObjectRef"] = {"kind": "Pod", "apiVersion": "v1", "name": pod["metadata"]["name"],
                                  "uid": pod["metadata"]["uid"]}
    got = cp.request("POST", f"/api/v1/namespaces/{NS}/serviceaccounts/{account}/token", {"spec": spec})
    return str(got["status"]["token"])


def _bound_pod(cp: ControlPlane, account: str, node: str) -> dict[str, Any]:
    """A pod of `account` already bound to `node`, as the DaemonSet's pod is once scheduled."""
    return cp.request("POST", f"/api/v1/namespaces/{NS}/pods", {  # type: ignore[no-any-return]
        "metadata": {"generateName": f"{account}-"},
        "spec": {"nodeName": node, "serviceAccountName": account, "terminationGracePeriodSeconds": 0,
                 "containers": [{"name": "agent", "image": "registry.invalid/none:0"}]}})


def _settle(cluster: Cluster) -> None:
    """Policies take effect once the kube-apiserver's informer has them: wait (bounded) until a dry-run patch of
    node B by node A's plugin is refused. Returns either way; the tests then say what was let through."""
    with cluster.client(cluster.tokens[PLUGIN]) as c:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            r = _patch(c, f"/api/v1/nodes/{NODE_B}", {"metadata": {"labels": {DEFAULT_KEYS.count_label: "4"}}},
                       dry_run=True)
            if r.status_code in (403, 422):
                return
            time.sleep(0.25)


def _namespace_gone_or_active(cp: ControlPlane) -> None:
    """The previous parameter's namespace is deleted on its way out: wait until it is gone before making it again
    (a terminating namespace refuses new objects)."""
    def settled() -> bool:
        r = cp.api().get(f"/api/v1/namespaces/{NS}")
        return r.status_code == 404 or r.json().get("status", {}).get("phase") == "Active"

    wait_until(f"namespace {NS} gone or active", settled, 60)


@pytest.fixture(scope="module", params=["chart", "manifests"])
def cluster(request: pytest.FixtureRequest, real_control_plane: ControlPlane) -> Iterator[Cluster]:
    source = str(request.param)
    objects = _objects(source)
    with tidied(real_control_plane) as cp:
        _namespace_gone_or_active(cp)
        cp.ensure_namespace(NS)
        accounts = [o["metadata"]["name"] for o in objects if o["kind"] == "ServiceAccount"
                    and o["metadata"]["name"] in (PLUGIN, DRA)]
        for account in accounts:
            cp.ensure_service_account(NS, account)
        for obj in objects:
            if obj["kind"] in POLICY_KINDS:
                cp.create(obj)
        cp.add_node(NODE_A)
        cp.add_node(NODE_B)
        tokens = {account: _token(cp, account, _bound_pod(cp, account, NODE_A)) for account in accounts}
        cluster = Cluster(cp, source, tokens)
        _settle(cluster)
        yield cluster


def _patch(c: httpx.Client, path: str, body: Any, *, dry_run: bool = False) -> httpx.Response:
    kind = "application/json-patch+json" if isinstance(body, list) else "application/merge-patch+json"
    return c.patch(path, content=json.dumps(body), headers={"Content-Type": kind},
                   params={"dryRun": "All"} if dry_run else None)


def _refused(r: httpx.Response, what: str, says: str) -> None:
    assert r.status_code in (403, 422), (what, r.status_code, r.text[:400])
    assert "ValidatingAdmissionPolicy" in r.text and says in r.text, (what, r.text[:400])


def test_the_plugin_writes_its_own_nodes_keys(cluster: Cluster) -> None:
    """What the publisher sends (merge patches of its annotations and labels), on the node its pod runs on:
    published, the autoscaler hold set, then lifted and every label removed."""
    gfd = cluster.source == "chart"
    with cluster.client(cluster.tokens[PLUGIN]) as c:
        path = f"/api/v1/nodes/{NODE_A}"
        r = _patch(c, path, {"metadata": {"annotations": owned_annotations(False), "labels": owned_labels(gfd)}})
        assert r.status_code == 200, r.text[:400]
        r = _patch(c, path, {"metadata": {"annotations": owned_annotations(True)}})
        assert r.status_code == 200, r.text[:400]
        lifted = _patch(c, path, {"metadata": {"annotations": owned_annotations(False),
                                               "labels": dict.fromkeys(owned_labels(gfd))}})
        assert lifted.status_code == 200, lifted.text[:400]
    annotations = cluster.node(NODE_A)["metadata"].get("annotations") or {}
    assert DEFAULT_KEYS.state in annotations and not set(HOLD_ANNOTATIONS) & set(annotations)


def test_the_plugin_may_not_write_another_node(cluster: Cluster) -> None:
    before = cluster.node(NODE_B)["metadata"]
    with cluster.client(cluster.tokens[PLUGIN]) as c:
        r = _patch(c, f"/api/v1/nodes/{NODE_B}", {"metadata": {"annotations": owned_annotations(False),
                                                               "labels": owned_labels(False)}})
    _refused(r, "node B", f"on node {NODE_A} may change only its own Node")
    after = cluster.node(NODE_B)["metadata"]
    assert after.get("labels") == before.get("labels") and after.get("annotations") == before.get("annotations")


def test_the_plugin_may_not_write_other_keys_or_the_spec(cluster: Cluster) -> None:
    """Its own Node, but nothing it does not own: a node's other labels (its own opt-in label included) and
    annotations, the taints and unschedulable, finalizers."""
    cp = cluster.cp
    path = f"/api/v1/nodes/{NODE_A}"
    cp.patch(path, {"metadata": {"labels": {"team": "ml"}, "annotations": {"owner": "ops"}}})
    refused = {
        "another label": {"metadata": {"labels": {"team": "other"}}},
        "a label removed": {"metadata": {"labels": {"team": None}}},
        "the hostname label": {"metadata": {"labels": {"kubernetes.io/hostname": NODE_B}}},
        "the opt-in label of the prefix": {"metadata": {"labels": {"gpu-topology.io/device-plugin": "enabled"}}},
        "a control-plane role": {"metadata": {"labels": {"node-role.kubernetes.io/control-plane": ""}}},
        "another annotation": {"metadata": {"annotations": {"owner": "me"}}},
        "an unknown key of the prefix": {"metadata": {"annotations": {"gpu-topology.io/plan": "{}"}}},
        "a taint": {"spec": {"taints": [{"key": "example.com/mine", "effect": "NoSchedule"}]}},
        "unschedulable": {"spec": {"unschedulable": True}},
        "a finalizer": {"metadata": {"finalizers": ["example.com/hold"]}},
        "own keys and one more": {"metadata": {"labels": {DEFAULT_KEYS.fabric_label: "pcie", "team": "x"}}},
    }
    with cluster.client(cluster.tokens[PLUGIN]) as c:
        for what, body in refused.items():
            _refused(_patch(c, path, body), what, "gpu-topology plugin may")
    meta = cluster.node(NODE_A)["metadata"]
    assert meta["labels"]["team"] == "ml" and meta["annotations"]["owner"] == "ops"
    assert not cluster.node(NODE_A)["spec"].get("taints") and not cluster.node(NODE_A)["spec"].get("unschedulable")


def test_the_plugin_lifts_only_a_hold_it_set(cluster: Cluster) -> None:
    """A "do not remove" annotation a person set (any value) is theirs: the plugin may not lift or change it, nor
    set one to anything but "true"; one it lists in <prefix>/autoscaler-hold it may lift."""
    cp = cluster.cp
    path = f"/api/v1/nodes/{NODE_A}"
    ca, karpenter = HOLD_ANNOTATIONS
    cp.patch(path, {"metadata": {"annotations": {ca: "true", karpenter: "false", DEFAULT_KEYS.autoscaler_hold: None}}})
    with cluster.client(cluster.tokens[PLUGIN]) as c:
        _refused(_patch(c, path, {"metadata": {"annotations": {ca: None}}}), "lift a person's hold",
                 "may lift only")
        _refused(_patch(c, path, {"metadata": {"annotations": {karpenter: "true"}}}), "change a person's value",
                 "may lift only")
        _refused(_patch(c, path, {"metadata": {"annotations": {ca: None, DEFAULT_KEYS.autoscaler_hold: ca}}}),
                 "claim a person's hold in the same patch", "may lift only")
        cp.patch(path, {"metadata": {"annotations": {karpenter: None}}})
        _refused(_patch(c, path, {"metadata": {"annotations": {karpenter: "yes"}}}), "a hold of another value",
                 "may lift only")
        ok = _patch(c, path, {"metadata": {"annotations": {karpenter: "true",
                                                           DEFAULT_KEYS.autoscaler_hold: karpenter}}})
        assert ok.status_code == 200, ok.text[:400]
        ok = _patch(c, path, {"metadata": {"annotations": {karpenter: None, DEFAULT_KEYS.autoscaler_hold: None}}})
        assert ok.status_code == 200, ok.text[:400]
    assert cluster.node(NODE_A)["metadata"]["annotations"][ca] == "true"
    cp.patch(path, {"metadata": {"annotations": {ca: None}}})


def test_a_token_of_no_pod_names_no_node_and_is_refused(cluster: Cluster) -> None:
    """The account's token not bound to a pod (a legacy Secret, a hand-made TokenRequest) carries no node: the
    policy refuses it rather than let it write any node."""
    with cluster.client(_token(cluster.cp, PLUGIN, None)) as c:
        r = _patch(c, f"/api/v1/nodes/{NODE_A}", {"metadata": {"labels": {DEFAULT_KEYS.count_label: "4"}}})
    _refused(r, "unbound token", "names no node")


def test_other_accounts_are_not_matched(cluster: Cluster) -> None:
    """The uninstall hook's account removes the plugin's keys from every node: the policies match the plugin's
    and the driver's accounts by name only, so another account of the namespace with the same grant passes."""
    cp = cluster.cp
    cp.ensure_service_account(NS, "gpu-topology-plugin-cleanup")
    cp.create({"kind": "ClusterRoleBinding", "apiVersion": "rbac.authorization.k8s.io/v1",
               "metadata": {"name": "restrict-test-cleanup"},
               "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": PLUGIN},
               "subjects": [{"kind": "ServiceAccount", "name": "gpu-topology-plugin-cleanup", "namespace": NS}]})
    cp.patch(f"/api/v1/nodes/{NODE_B}", {"metadata": {"labels": {DEFAULT_KEYS.count_label: "4"},
                                                      "annotations": {DEFAULT_KEYS.state: "{}"}}})
    with cluster.client(_token(cp, "gpu-topology-plugin-cleanup", None)) as c:
        for node in (NODE_A, NODE_B):
            r = _patch(c, f"/api/v1/nodes/{node}", {"metadata": {"labels": {DEFAULT_KEYS.count_label: None},
                                                                 "annotations": {DEFAULT_KEYS.state: None}}})
            assert r.status_code == 200, (node, r.text[:400])
    assert DEFAULT_KEYS.count_label not in cluster.node(NODE_B)["metadata"].get("labels", {})


# -- the DRA driver's ResourceSlices ------------------------------------------------------------------------------


def _slice(node: str, *, pool: str | None = None, driver: str = DRIVER, name: str | None = None) -> dict[str, Any]:
    meta = {"name": name} if name else {"generateName": f"00000-{driver}-{node}-"}
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice", "metadata": meta,
            "spec": {"driver": driver, "nodeName": node,
                     "pool": {"name": pool or node, "generation": 1, "resourceSliceCount": 1},
                     "devices": [{"name": "gpu-0"}]}}


def test_the_dra_driver_writes_its_own_nodes_slices_only(cluster: Cluster) -> None:
    if cluster.source != "chart":
        pytest.skip("the DRA driver is installed by the chart only (deploy/manifests has no DRA mode)")
    cp = cluster.cp
    other = cp.request("POST", SLICES, _slice(NODE_B))
    with cluster.client(cluster.tokens[DRA]) as c:
        created = c.post(SLICES, json=_slice(NODE_A))
        assert created.status_code == 201, created.text[:400]
        mine = created.json()
        mine["spec"]["pool"]["generation"] = 2
        updated = c.put(f"{SLICES}/{mine['metadata']['name']}", json=mine)
        assert updated.status_code == 200, updated.text[:400]
        deleted = c.delete(f"{SLICES}/{mine['metadata']['name']}")
        assert deleted.status_code == 200, deleted.text[:400]

        _refused(c.post(SLICES, json=_slice(NODE_B)), "a slice of node B", f"on node {NODE_A} may write only")
        _refused(c.post(SLICES, json=_slice(NODE_A, pool=NODE_B)), "node B's pool on node A", "pool")
        _refused(c.post(SLICES, json=_slice(NODE_A, driver="gpu.nvidia.com")), "another driver's slice",
                 f"driver {DRIVER}")
        cluster_wide = _slice(NODE_A)
        del cluster_wide["spec"]["nodeName"]
        cluster_wide["spec"]["allNodes"] = True
        _refused(c.post(SLICES, json=cluster_wide), "a slice of every node", f"on node {NODE_A} may write only")
        other["spec"]["pool"]["generation"] = 2
        _refused(c.put(f"{SLICES}/{other['metadata']['name']}", json=other), "update node B's slice",
                 f"on node {NODE_A} may write only")
        _refused(c.delete(f"{SLICES}/{other['metadata']['name']}"), "delete node B's slice",
                 f"on node {NODE_A} may write only")
    with cluster.client(_token(cp, DRA, None)) as c:
        _refused(c.post(SLICES, json=_slice(NODE_A)), "unbound token", "names no node")
    assert cp.request("GET", f"{SLICES}/{other['metadata']['name']}")["spec"]["nodeName"] == NODE_B


# -- the real plugin under its policy -----------------------------------------------------------------------------


def _status_patch(c: httpx.Client, node: str, status: dict[str, Any]) -> httpx.Response:
    """What gputopo.kube.patching.patch_node_condition sends: a strategic merge patch of nodes/status."""
    return c.patch(f"/api/v1/nodes/{node}/status", content=json.dumps({"status": status}),
                   headers={"Content-Type": "application/strategic-merge-patch+json"})


def _condition(type_: str, status: str) -> dict[str, str]:
    return {"type": type_, "status": status, "reason": "SharingConfigRefused", "message": "config 'x' refused",
            "lastHeartbeatTime": "2026-01-01T00:00:00Z", "lastTransitionTime": "2026-01-01T00:00:00Z"}


def test_the_plugin_sets_only_its_sharing_condition_on_its_own_node(cluster: Cluster) -> None:
    """A refused sharing config shows as the condition GPUSharingConfigValid and an Event: the plugin may patch that
    one condition of its own Node's status, merged beside the others; another condition type, another status field
    or another node's status is refused. Events about its Node it may create."""
    cp = cluster.cp
    cp.request("PATCH", f"/api/v1/nodes/{NODE_A}/status", {"status": {"conditions": [
        {"type": "Ready", "status": "True", "reason": "KubeletReady", "message": "ready",
         "lastHeartbeatTime": "2026-01-01T00:00:00Z", "lastTransitionTime": "2026-01-01T00:00:00Z"}]}},
        content_type="application/strategic-merge-patch+json")
    with cluster.client(cluster.tokens[PLUGIN]) as c:
        r = _status_patch(c, NODE_A, {"conditions": [_condition("GPUSharingConfigValid", "False")]})
        assert r.status_code == 200, r.text[:400]
        _refused(_status_patch(c, NODE_A, {"conditions": [_condition("Ready", "False")]}), "another condition",
                 "only its condition GPUSharingConfigValid")
        _refused(_status_patch(c, NODE_A, {"capacity": {"example.com/gpus": "8"}}), "capacity",
                 "only its condition GPUSharingConfigValid")
        _refused(_status_patch(c, NODE_B, {"conditions": [_condition("GPUSharingConfigValid", "False")]}),
                 "node B", f"on node {NODE_A} may change only its own Node")
        event = {"metadata": {"generateName": f"{NODE_A}."}, "involvedObject": {"kind": "Node", "name": NODE_A},
                 "reason": "SharingConfigRefused", "message": "config 'x' refused", "type": "Warning"}
        r = c.post("/api/v1/namespaces/default/events", content=json.dumps(event),
                   headers={"Content-Type": "application/json"})
        assert r.status_code == 201, r.text[:400]
    conditions = {x["type"]: x["status"] for x in cluster.node(NODE_A)["status"]["conditions"]}
    assert conditions["GPUSharingConfigValid"] == "False" and conditions["Ready"] == "True"
    assert "example.com/gpus" not in cluster.node(NODE_A)["status"].get("capacity", {})


def test_the_real_plugin_publishes_under_its_policy(cluster: Cluster) -> None:
    """`gpuplugin run` with the token of its pod on node A (as the kubelet mounts it) and a time-slicing config:
    everything it writes (topology, state, the topology labels, free-gpus of the shared resource, the GFD labels, the
    condition GPUSharingConfigValid) reaches node A through the chart's policy, with no refusal in its log."""
    if cluster.source != "chart":
        pytest.skip("GPU sharing (and its GFD labels) is configured by the chart only")
    import os
    import subprocess
    import sys

    from sim.kubelet import KubeletSimulator
    from sim.podresources import PodResourcesServer
    from sim.ports import free_port
    from tests.helpers.processes import stop_process

    cp = cluster.cp
    with short_dir("restrict-") as root, PodResourcesServer(str(root / "podres.sock")), \
            KubeletSimulator(root / "dp"):
        (root / "configs").mkdir()
        (root / "configs" / "default").write_text(SHARED_HALF)
        kubeconfig = cp.write_kubeconfig(root / "plugin.kubeconfig", cluster.tokens[PLUGIN])
        env = dict(os.environ, KUBECONFIG=str(kubeconfig), NODE_NAME=NODE_A, PYTHONUNBUFFERED="1")
        env.pop("POD_NAME", None)
        log = root / "plugin.log"
        with open(log, "wb") as out:
            process = subprocess.Popen([
                sys.executable, "-m", "gpuplugin.cli", "run", "--publish", "--topology", str(H100X4),
                "--device-plugin-dir", str(root / "dp"), "--pod-resources-socket", str(root / "podres.sock"),
                "--metrics-port", str(free_port()), "--pod-resources-poll-interval", "0.5",
                "--sharing-config-dir", str(root / "configs"), "--sharing-poll-interval", "0.2",
                "--device-id-strategy", "index"], env=env, stdout=out, stderr=subprocess.STDOUT)
        try:
            def published() -> bool:
                meta = cluster.node(NODE_A)["metadata"]
                labels = meta.get("labels") or {}
                conditions = cluster.node(NODE_A).get("status", {}).get("conditions") or []
                return (DEFAULT_KEYS.state in (meta.get("annotations") or {})
                        and labels.get(REPLICAS) == "2" and DEFAULT_KEYS.fabric_label in labels
                        and any(DEFAULT_KEYS.is_free_gpus_label(k) for k in labels)
                        and any(x["type"] == "GPUSharingConfigValid" and x["status"] == "True" for x in conditions))

            try:
                wait_until(f"the plugin publishing on {NODE_A}", published, 60)
            except RuntimeError as e:
                raise AssertionError(f"{e}; node A: {cluster.node(NODE_A)['metadata']}; plugin log: "
                                     f"{log.read_text(errors='replace')[-3000:]}") from None
        finally:
            stop_process(process, log=log)
            text = log.read_text(errors="replace")
        assert "ValidatingAdmissionPolicy" not in text and "Forbidden" not in text, text[-3000:]
    assert DEFAULT_KEYS.topology in cluster.node(NODE_A)["metadata"]["annotations"]


def test_the_real_dra_slice_publisher_writes_under_its_policy(cluster: Cluster) -> None:
    """gpuplugin.dra's SlicePublisher with the token of the driver's pod on node A: it reads its Node (the slices'
    owner), publishes the whole pool, and republishes it when a GPU turns unhealthy, all through the policy."""
    if cluster.source != "chart":
        pytest.skip("the DRA driver is installed by the chart only (deploy/manifests has no DRA mode)")
    from gpuplugin.dra.pool import PoolPlanner
    from gpuplugin.dra.publisher import SlicePublisher
    from gputopo.kube import make_api_client
    from tests.gpuplugin.dra.conftest import DGX1, TAINT, catalog

    cp = cluster.cp
    unhealthy: set[int] = set()
    with short_dir("restrict-dra-") as root:
        kubeconfig = cp.write_kubeconfig(root / "dra.kubeconfig", cluster.tokens[DRA])
        api = make_api_client(kubeconfig=str(kubeconfig), timeout_s=10.0)
        publisher = SlicePublisher(api, PoolPlanner(catalog(str(DGX1)), taint_key=TAINT),
                                   lambda: (set(), set(unhealthy)), driver=DRIVER, node=NODE_A, min_interval_s=0.0)
        try:
            publisher.start()
            assert publisher.wait_syncs(1, 30), "no sync through the policy"
            unhealthy.add(3)
            publisher.request()
            wait_until("the unhealthy GPU's devices republished tainted", lambda: any(
                d.get("taints") for s in cp.list_items(SLICES) if s["spec"]["nodeName"] == NODE_A
                for d in s["spec"].get("devices") or []), 30)
        finally:
            publisher.stop()
            api.close()
    mine = [s for s in cp.list_items(SLICES) if s["spec"]["nodeName"] == NODE_A and s["spec"]["driver"] == DRIVER]
    assert mine and len(mine) == mine[0]["spec"]["pool"]["resourceSliceCount"]
    assert all(s["metadata"]["ownerReferences"][0]["name"] == NODE_A for s in mine)
