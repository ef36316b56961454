"""No pod waits where a new node would help: through the real kube-apiserver and kube-scheduler v1.36.2
(tests/helpers/controlplane.py), the real `gpu-extender serve` and `gpu-extender webhook`, real plugin processes on
simulated nodes, and a stand-in for the Cluster Autoscaler that applies CA's own rules (sim.autoscaler: a pod is
a scale-up candidate when PodScheduled is False with reason Unschedulable and CA's in-tree filters fit it on no
existing node; the group is one whose template fits it; docs/reference/autoscaling.md 1.1, 1.2).

Two refusals of ours that in-tree filters do not make, each either short-lived or visible to CA:
- GPUs reserved for a job's next pod: CA believes the refused pod fits (it does, in GPU counts), so the refusal must
  end soon. It ends with the reservation timeout, and the extender then touches the refused pod (extender.requeue)
  so kube-scheduler retries it at once; without that touch the real kube-scheduler waited for its 5-minute flush.
- `require-nvlink` while only PCIe servers exist: the webhook turns it into required node affinity on the plugin's
  `fabric` label, so kube-scheduler's own NodeAffinity refuses the PCIe server, CA's simulation agrees, the group
  whose template (from `gpuplugin node-template`) carries an NVLink fabric is scaled up, and the pod binds on the
  new node with a plan. The same pod kept from the webhook shows the old behaviour: refused by the extender, CA
  believes it fits the PCIe server.
- k replicas on k distinct GPUs while the free replicas sit on fewer GPUs: the plugin's `free-gpus` label and the
  webhook's affinity make the node refuse the pod in-tree; the template of the group fits it, renamed or not.

The extender runs as the chart's second-scheduler account with the chart's RBAC and its ValidatingAdmissionPolicy,
which lets that account change one annotation of a pod and nothing else.

Skips, naming why, where the Kubernetes binaries (shared/kube beside the clone) or etcd are absent."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest
import yaml

from gputopo.contract import DEFAULT_KEYS, NVLINK_FABRICS, replica_parent
from gputopo.discovery.loader import load_topology_file
from sim.autoscaler import fits, pod_requests
from tests.extender.conftest import A100, H100X4, PCIE
from tests.helpers.controlplane import ControlPlane, start_webhook, tidied, wait_until
from tests.helpers.paths import REPO
from tests.helpers.realnode import plan_of, real_gpu_node

pytestmark = [pytest.mark.timeout(300)]

NS = "autoscaling"
GPU = "nvidia.com/gpu"
SCHEDULER = "gpu-topology-scheduler"
RESERVATION_S = 6  # the extender's --reservation-timeout here
H100_QUAD = H100X4
WAIT_S = 90.0  # liveness bound on a loaded 2-core machine, never a performance figure
FLUSH_S = 300  # kube-scheduler's podMaxInUnschedulablePodsDuration: how long the pod waited before the touch


# NVIDIA's time-slicing as most teams write it: nvidia.com/gpu itself shared, not renamed. The chart then passes it
# to the webhook as a name that is replicas on some nodes and whole GPUs on others.
UNRENAMED_SLICING = """version: v1
sharing:
  timeSlicing:
    resources:
    - name: nvidia.com/gpu
      replicas: 2
"""


def _chart() -> list[dict[str, Any]]:
    from tests.deploy.rendering import ChartVariant, render_chart

    return render_chart(ChartVariant("gpu-topology", "gpu-topology", {
        "plugin": {"sharing": {"enabled": True, "configs": {"inference": UNRENAMED_SLICING}}}}))


RBAC_KINDS = ("ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding", "ValidatingAdmissionPolicy",
              "ValidatingAdmissionPolicyBinding")


@pytest.fixture(scope="module")
def cluster(real_control_plane: ControlPlane) -> Iterator[ControlPlane]:
    """The extender runs as the chart's second-scheduler account, with the chart's RBAC and pod-patch policy
    applied: its touches of refused pods go through both, as installed."""
    objects = _chart()
    with tidied(real_control_plane) as cp:
        cp.ensure_namespace(NS)
        cp.ensure_namespace("gpu-topology")
        for obj in objects:
            if obj["kind"] in RBAC_KINDS:
                cp.create(obj)
        extender = cp.start_extender(extra=["--reservation-timeout", str(RESERVATION_S), "--log-level", "debug"],
                                     kubeconfig=cp.extender_kubeconfig())
        (cm,) = [o for o in objects if o["kind"] == "ConfigMap" and o["metadata"]["name"].endswith("-scheduler-config")]
        config = yaml.safe_load(cm["data"]["scheduler-config.yaml"])
        (stanza,) = config["extenders"]
        cp.start_scheduler([{**stanza, "urlPrefix": extender.url}], name=SCHEDULER,
                           extra_config={"profiles": config["profiles"]})
        (hook_config,) = [o for o in objects if o["kind"] == "MutatingWebhookConfiguration"]
        (deployment,) = [o for o in objects if o["kind"] == "Deployment" and o["metadata"]["name"].endswith("-webhook")]
        args = [a for a in deployment["spec"]["template"]["spec"]["containers"][0]["args"][1:]
                if a.split("=", 1)[0] in ("--scheduler-name", "--resource-name", "--annotation-prefix",
                                          "--extra-resources", "--replica-resources", "--whole-jobs")]
        assert f"--replica-resources={GPU}" in args, args
        start_webhook(cp, hook_config["webhooks"][0], *args)
        yield cp


def _pod(name: str, gpus: int, annotations: dict[str, str] | None = None, *, ours: bool = False,
         labels: dict[str, str] | None = None) -> dict[str, Any]:
    spec: dict[str, Any] = {"terminationGracePeriodSeconds": 0, "containers": [{
        "name": "train", "image": "registry.invalid/none:0", "resources": {"limits": {GPU: str(gpus)}}}]}
    if ours:
        spec["schedulerName"] = SCHEDULER
    return {"metadata": {"name": name, "annotations": annotations or {}, "labels": labels or {}}, "spec": spec}


def _get(cp: ControlPlane, name: str) -> dict[str, Any]:
    return cp.request("GET", f"/api/v1/namespaces/{NS}/pods/{name}")  # type: ignore[no-any-return]


def _unschedulable(pod: dict[str, Any]) -> str | None:
    """The message of PodScheduled=False/Unschedulable (what CA and Karpenter act on), else None."""
    for c in pod.get("status", {}).get("conditions") or []:
        if c.get("type") == "PodScheduled" and c.get("status") == "False" and c.get("reason") == "Unschedulable":
            return str(c.get("message") or "")
    return None


def _used(cp: ControlPlane, node: str) -> dict[str, int]:
    """What CA counts as requested on a node: the requests of the pods bound there that have not ended."""
    used: dict[str, int] = {}
    for p in cp.list_items("/api/v1/pods", fieldSelector=f"spec.nodeName={node}"):
        if p.get("status", {}).get("phase") in ("Succeeded", "Failed"):
            continue
        for k, v in pod_requests(p).items():
            used[k] = used.get(k, 0) + v
    return used


def _ca_believes_it_fits(cp: ControlPlane, pod: dict[str, Any]) -> list[str]:
    """The existing nodes CA's simulation would place the pod on (no scale-up while any)."""
    return [n["metadata"]["name"] for n in cp.list_items("/api/v1/nodes")
            if fits(pod, n, _used(cp, n["metadata"]["name"])) is None]


def _template(topology: str, name: str) -> dict[str, Any]:
    """A node-group template as a platform team declares it for scale from zero: the labels and resources
    `gpuplugin node-template` prints for one node of the group."""
    out = subprocess.run([sys.executable, "-m", "gpuplugin.cli", "node-template", "--topology", topology],
                         capture_output=True, text=True, timeout=60, cwd=REPO, check=True).stdout
    labels = dict(line.split("=", 1) for line in out.splitlines() if "=" in line and not line.startswith("#"))
    return {"metadata": {"name": name, "labels": {k: v for k, v in labels.items() if "/" in k and k != GPU}},
            "status": {"allocatable": {GPU: "8", "pods": "110"}}}


def test_a_pod_refused_for_a_jobs_reserved_gpus_binds_when_the_reservation_ends(cluster: ControlPlane) -> None:
    cp = cluster
    cp.add_gpu_node("res-0", load_topology_file(A100))
    job = {DEFAULT_KEYS.job: "train-a", DEFAULT_KEYS.job_size: "2"}
    cp.request("POST", f"/api/v1/namespaces/{NS}/pods", _pod("train-a-0", 4, job, ours=True))
    wait_until("the job's first pod bound", lambda: _get(cp, "train-a-0")["spec"].get("nodeName") == "res-0",
               WAIT_S)
    # the job's second pod never comes: its 4 GPUs stay reserved until the reservation times out
    started = time.monotonic()
    cp.request("POST", f"/api/v1/namespaces/{NS}/pods", _pod("other", 4, ours=True))
    wait_until("the other pod refused", lambda: _unschedulable(_get(cp, "other")) is not None, WAIT_S)
    refused_by = _unschedulable(_get(cp, "other"))
    assert refused_by is not None and "reserved for pods being bound" in refused_by, refused_by
    assert _ca_believes_it_fits(cp, _get(cp, "other")) == ["res-0"], \
        "CA sees 4 free GPUs: this refusal must end by itself"
    wait_until("the other pod bound", lambda: _get(cp, "other")["spec"].get("nodeName") == "res-0", WAIT_S)
    waited = time.monotonic() - started
    pod = _get(cp, "other")
    assert DEFAULT_KEYS.requeued in pod["metadata"]["annotations"], "the extender touched it"
    assert plan_of(pod) is not None
    assert waited < FLUSH_S / 3, f"bound after {waited:.0f} s"
    print(f"refused pod bound {waited:.1f} s after creation (reservation timeout {RESERVATION_S} s)")


def test_require_nvlink_reads_to_the_autoscaler_as_needing_an_nvlink_node(cluster: ControlPlane) -> None:
    cp = cluster
    groups = {"pcie": _template(str(PCIE), "template-pcie"), "nvswitch": _template(str(A100), "template-nvswitch")}
    assert groups["pcie"]["metadata"]["labels"][DEFAULT_KEYS.fabric_label] == "pcie"
    assert groups["nvswitch"]["metadata"]["labels"][DEFAULT_KEYS.fabric_label] in NVLINK_FABRICS
    with real_gpu_node(cp, "pcie-0", topology=PCIE) as pcie:
        pcie.wait_published(GPU, 8, WAIT_S)
        wait_until("the plugin's fabric label", lambda: (pcie.node()["metadata"].get("labels") or {})
                   .get(DEFAULT_KEYS.fabric_label) == "pcie", WAIT_S)
        need = {DEFAULT_KEYS.require_nvlink: "true"}
        # kept from the webhook: the old behaviour, refused by the extender where CA sees room
        hidden = _pod("nvlink-hidden", 2, need, ours=True, labels={DEFAULT_KEYS.webhook: "disabled"})
        cp.request("POST", f"/api/v1/namespaces/{NS}/pods", hidden)
        wait_until("the hidden pod refused", lambda: _unschedulable(_get(cp, "nvlink-hidden")) is not None, WAIT_S)
        assert "NVLink" in (_unschedulable(_get(cp, "nvlink-hidden")) or "")
        assert _ca_believes_it_fits(cp, _get(cp, "nvlink-hidden")) == ["pcie-0"], "stuck: no autoscaler adds a node"
        cp.request("DELETE", f"/api/v1/namespaces/{NS}/pods/nvlink-hidden", ok=(200, 202, 404))
        # through the webhook: the constraint is node affinity that CA's simulation evaluates
        cp.request("POST", f"/api/v1/namespaces/{NS}/pods", _pod("nvlink", 2, need))
        wait_until("the pod refused", lambda: _unschedulable(_get(cp, "nvlink")) is not None, WAIT_S)
        pod = _get(cp, "nvlink")
        assert pod["spec"]["schedulerName"] == SCHEDULER
        terms = pod["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
        nvlink = {"key": DEFAULT_KEYS.fabric_label, "operator": "In", "values": list(NVLINK_FABRICS)}
        # two terms: a time-slicing config shares nvidia.com/gpu unrenamed here, so the pod may also take replicas
        assert all(nvlink in t["matchExpressions"] for t in terms["nodeSelectorTerms"]), terms
        assert "affinity" in (_unschedulable(pod) or ""), _unschedulable(pod)
        assert _ca_believes_it_fits(cp, pod) == [], "CA's simulation refuses the PCIe server too"
        chosen = [g for g, t in groups.items() if fits(pod, t, {}) is None]
        assert chosen == ["nvswitch"], chosen
        started = time.monotonic()
        with real_gpu_node(cp, "nvswitch-0", topology=A100) as added:  # the scale-up
            added.wait_published(GPU, 8, WAIT_S)
            wait_until("the pod bound on the new node",
                       lambda: _get(cp, "nvlink")["spec"].get("nodeName") == "nvswitch-0", WAIT_S)
            print(f"bound {time.monotonic() - started:.1f} s after the new node was started")
            assert plan_of(_get(cp, "nvlink")) is not None
            cp.request("DELETE", f"/api/v1/namespaces/{NS}/pods/nvlink", ok=(200, 202, 404))


def test_the_extenders_account_may_touch_the_requeued_annotation_and_nothing_else(cluster: ControlPlane) -> None:
    """RBAC lets the extender patch pods; the chart's ValidatingAdmissionPolicy narrows that to the one annotation
    (and its own role label), as the real kube-apiserver enforces it."""
    cp = cluster
    cp.request("POST", f"/api/v1/namespaces/{NS}/pods", _pod("victim", 1, {"team": "ml"}))
    as_extender = cp.new_client()
    as_extender.headers["Authorization"] = f"Bearer {cp.token}-ext"
    path = f"/api/v1/namespaces/{NS}/pods/victim"
    merge = {"Content-Type": "application/strategic-merge-patch+json"}  # containers merged by name

    def patch(body: Any) -> Any:
        kind = {"Content-Type": "application/json-patch+json"} if isinstance(body, list) else merge
        return as_extender.patch(path, content=json.dumps(body), headers=kind)

    try:
        ok = patch({"metadata": {"annotations": {DEFAULT_KEYS.requeued: "2026-12-03T00:00:00Z"}}})
        assert ok.status_code == 200, ok.text
        refused = {
            "another annotation": {"metadata": {"annotations": {"team": "other"}}},
            "a label": {"metadata": {"labels": {"app": "x"}}},
            "the image": {"spec": {"containers": [{"name": "train", "image": "registry.invalid/evil:1"}]}},
            "a toleration": [{"op": "add", "path": "/spec/tolerations/-",
                              "value": {"key": "example.com/any", "operator": "Exists", "effect": "NoSchedule"}}],
            "a finalizer": {"metadata": {"finalizers": ["example.com/hold"]}},
        }
        for what, body in refused.items():
            r = patch(body)
            assert r.status_code in (403, 422), (what, r.status_code, r.text[:300])
            assert "ValidatingAdmissionPolicy" in r.text and "gpu-topology extender may" in r.text, (what, r.text[:300])
        after = _get(cp, "victim")
        assert after["metadata"]["annotations"]["team"] == "ml" and "app" not in after["metadata"].get("labels", {})
        assert after["spec"]["containers"][0]["image"] == "registry.invalid/none:0"
    finally:
        as_extender.close()
        cp.request("DELETE", path, ok=(200, 202, 404))


RENAMED_SLICING = """version: v1
sharing:
  timeSlicing:
    renameByDefault: true
    resources:
    - name: nvidia.com/gpu
      replicas: 2
"""
SHARED_GPU = "nvidia.com/gpu.shared"


@pytest.mark.parametrize(("config", "resource"), [(RENAMED_SLICING, SHARED_GPU), (UNRENAMED_SLICING, GPU)],
                         ids=["renamed", "unrenamed"])
def test_replicas_on_distinct_gpus_read_to_the_autoscaler_as_needing_a_node(
        cluster: ControlPlane, tmp_path: Any, config: str, resource: str) -> None:
    """4 GPUs time-sliced 2 ways (8 replicas). Six one-replica pods fill three GPUs (packing); 2 replicas stay
    free, on one GPU. A two-replica pod needs 2 distinct GPUs: the replica count says it fits, the plugin's
    `free-gpus` label says 1, and the webhook's affinity makes kube-scheduler and CA's simulation refuse the node;
    the group's template (from `gpuplugin node-template` with the sharing config) fits, and the pod binds on the
    node added. Renamed (`nvidia.com/gpu.shared`, always replicas) and as NVIDIA's usual config has it
    (`nvidia.com/gpu` shared under its own name: the affinity lets the pod go where the label is absent too, to
    whole-GPU nodes). The real CA agrees with the model on the renamed variant:
    test_cluster_autoscaler_sharing_real.py::test_two_replicas_on_one_gpu_read_to_the_real_ca_as_needing_a_node
    (a second node of the group added, the pod bound there on two GPUs)."""
    cp = cluster
    tag = "r" if resource == SHARED_GPU else "u"
    configs = tmp_path / "configs"
    configs.mkdir()
    (configs / "default").write_text(config)
    args = ["--sharing-config-dir", str(configs), "--sharing-poll-interval", "0.2"]
    label = DEFAULT_KEYS.free_gpus_label(resource)
    assert label is not None
    out = subprocess.run(
        [sys.executable, "-m", "gpuplugin.cli", "node-template", "--topology", str(H100_QUAD), "--sharing-config",
         str(configs / "default")], capture_output=True, text=True, timeout=60, cwd=REPO, check=True).stdout
    template = {"metadata": {"name": f"template-{tag}", "labels": dict(
        line.split("=", 1) for line in out.splitlines() if "=" in line)},
        "status": {"allocatable": {resource: "8", "pods": "110"}}}
    assert template["metadata"]["labels"][label] == "4"
    names = [f"{tag}-one-{i}" for i in range(6)]
    with real_gpu_node(cp, f"ts{tag}-0", topology=H100_QUAD, args=args) as node:
        node.wait_published(resource, 8, WAIT_S)
        for name in names:
            cp.request("POST", f"/api/v1/namespaces/{NS}/pods", _replica_pod(name, resource, 1))
        wait_until("six replicas held and published", lambda: (node.node()["metadata"].get("labels") or {})
                   .get(label) == "1", WAIT_S)
        two = f"{tag}-two"
        cp.request("POST", f"/api/v1/namespaces/{NS}/pods", _replica_pod(two, resource, 2))
        wait_until("the two-replica pod refused", lambda: _unschedulable(_get(cp, two)) is not None, WAIT_S)
        pod = _get(cp, two)
        assert "affinity" in (_unschedulable(pod) or ""), _unschedulable(pod)
        assert _ca_believes_it_fits(cp, pod) == [], "CA's simulation refuses the full node too"
        assert fits(pod, template, {}) is None, "the group's template fits it"
        with real_gpu_node(cp, f"ts{tag}-1", topology=H100_QUAD, args=args) as added:
            added.wait_published(resource, 8, WAIT_S)
            wait_until("the pod bound on the new node",
                       lambda: _get(cp, two)["spec"].get("nodeName") == f"ts{tag}-1", WAIT_S)
            wait_until("the pod admitted", lambda: bool(added.admission.held(resource)), WAIT_S)
            (replicas,) = added.admission.held(resource).values()
            assert len({replica_parent(r)[0] for r in replicas}) == 2, replicas
        for name in (two, *names):
            cp.request("DELETE", f"/api/v1/namespaces/{NS}/pods/{name}", ok=(200, 202, 404))


def _replica_pod(name: str, resource: str, replicas: int) -> dict[str, Any]:
    return {"metadata": {"name": name}, "spec": {"terminationGracePeriodSeconds": 0, "containers": [{
        "name": "infer", "image": "registry.invalid/none:0", "resources": {"limits": {resource: str(replicas)}}}]}}
