"""The REAL Cluster Autoscaler 1.31.5 decides: the same scenario test_autoscaling_real.py drives with a model of CA
(sim.autoscaler), now with CA itself as a process (tests/helpers/autoscaler.py), its cloud the project's
externalgrpc provider (sim.ca_provider) over two node groups of real topologies: `pcie` (8x RTX 5090, PCIe only)
and `nvswitch` (HGX A100, one NVSwitch fabric), both at zero nodes, templates from `gpuplugin node-template`. The
cluster also runs the real kube-apiserver, kube-scheduler (the chart's second scheduler with our extender), our
webhook, and one PCIe server no group owns.

What CA does here is decided from the pod spec alone (it knows nothing of the extender): the webhook turns
`require-nvlink` into required node affinity on the plugin's fabric label, CA's in-tree NodeAffinity then refuses
the PCIe server and the `pcie` template and fits the `nvswitch` template, and it asks our provider for one node of
that group. GPU pods younger than 30 s are left for a later loop, so each scale-up starts about 30 s after its pod.

One control plane, one CA and its provider serve the whole file (module scope); the cases run in order: two
scale-ups, the scale-down of the two nodes they made, then a job's scale-up from zero again. Skips, naming why,
without shared/autoscaler, shared/kube or etcd."""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from typing import Any

import pytest

from gputopo.contract import DEFAULT_KEYS, NVLINK_FABRICS
from sim.ca_provider import NodeGroupSpec, parse_provider_id
from tests.extender.conftest import A100, PCIE
from tests.helpers.autoscaler import Autoscaler, product_for_ca, running_autoscaler
from tests.helpers.controlplane import ControlPlane
from tests.helpers.realnode import plan_of, real_gpu_node

pytestmark = [pytest.mark.timeout(420)]

NS = "ca-real"
GPU = "nvidia.com/gpu"
SCHEDULER = "gpu-topology-scheduler"
SCALE_UP_S = 120.0  # CA's 30 s young-pod wait + loops + a node starting, on an idle machine (scaled by load)
SCALE_DOWN_S = 120.0  # 15 s unneeded + loops + the node stopping
GROUPS = (NodeGroupSpec("pcie", PCIE, 0, 2, gpu_type="rtx5090"),
          NodeGroupSpec("nvswitch", A100, 0, 3, gpu_type="a100"))
JOB_LABEL = "training.kubeflow.org/job-name"


@pytest.fixture(scope="module")
def ca(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Autoscaler]:
    """CA and its cloud over the shared control plane, with the PCIe server no group owns already publishing."""
    with product_for_ca(request, tmp_path_factory, NS) as (cp, binary), \
            real_gpu_node(cp, "pcie-static", topology=PCIE) as pcie:
        pcie.wait_published(GPU, 8, 90)
        with running_autoscaler(cp, binary, GROUPS) as autoscaler:
            yield autoscaler


def _pods(cp: ControlPlane) -> list[str]:
    return [p["metadata"]["name"] for p in cp.list_items(f"/api/v1/namespaces/{NS}/pods")]


def _pod(name: str, gpus: int, *, ours: bool = False, job: tuple[str, int, int] | None = None) -> dict[str, Any]:
    """A pod asking `gpus` GPUs and NVLink; `job` = (name, index, size) labels it as the training operator does."""
    meta: dict[str, Any] = {"name": name, "annotations": {DEFAULT_KEYS.require_nvlink: "true"}}
    if job is not None:
        meta["labels"] = {JOB_LABEL: job[0], "training.kubeflow.org/replica-index": str(job[1])}
        meta["annotations"][DEFAULT_KEYS.job_size] = str(job[2])
    spec: dict[str, Any] = {"terminationGracePeriodSeconds": 0, "containers": [{
        "name": "train", "image": "registry.invalid/none:0", "resources": {"limits": {GPU: str(gpus)}}}]}
    if ours:
        spec["schedulerName"] = SCHEDULER
    return {"metadata": meta, "spec": spec}


def _get(cp: ControlPlane, name: str) -> dict[str, Any]:
    return cp.request("GET", f"/api/v1/namespaces/{NS}/pods/{name}")  # type: ignore[no-any-return]


def _nodes_of(cp: ControlPlane) -> dict[str, str]:
    """Node name -> the group its providerID names, for the Nodes of our groups."""
    out = {}
    for n in cp.list_items("/api/v1/nodes"):
        parsed = parse_provider_id((n.get("spec") or {}).get("providerID") or "")
        if parsed:
            out[n["metadata"]["name"]] = parsed[0]
    return out


def _scale_up_for(ca: Autoscaler, pod: dict[str, Any]) -> tuple[str, float]:
    """Create `pod`, wait for it to bind; return its node and the seconds it took. Asserts on the way that the pod
    was first refused for the NVLink affinity (what CA acts on), and that the node CA had added is the only one the
    provider started meanwhile."""
    cp = ca.cp
    name = pod["metadata"]["name"]
    before = {g.id: set(ca.provider.members(g.id)) for g in GROUPS}
    started = time.monotonic()
    cp.request("POST", f"/api/v1/namespaces/{NS}/pods", pod)
    created = _get(cp, name)
    assert created["spec"]["schedulerName"] == SCHEDULER
    nvlink = {"key": DEFAULT_KEYS.fabric_label, "operator": "In", "values": list(NVLINK_FABRICS)}
    terms = created["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert all(nvlink in t["matchExpressions"] for t in terms["nodeSelectorTerms"]), terms
    ca.wait(f"{name} bound", lambda: _get(cp, name)["spec"].get("nodeName"), SCALE_UP_S)
    took = time.monotonic() - started
    node = _get(cp, name)["spec"]["nodeName"]
    added = {g.id: set(ca.provider.members(g.id)) - before[g.id] for g in GROUPS}
    assert added == {"pcie": set(), "nvswitch": {node}}, (added, node, ca.log_tail())
    assert _nodes_of(cp)[node] == "nvswitch"
    assert plan_of(_get(cp, name)) is not None, "bound by our extender, with a plan"
    return node, took


def _assert_verdicts(ca: Autoscaler, pod: str) -> None:
    """CA's own log says why: the PCIe group's template refused by NodeAffinity, and a plan of one NVSwitch node
    (no plan ever named the PCIe group)."""
    log = ca.log()
    refused = [line for line in log.splitlines() if f"Pod {NS}/{pod} can't be scheduled on pcie" in line]
    assert refused and all("NodeAffinity" in line for line in refused), ca.log_tail()
    plans = [line.split("Final scale-up plan: ", 1)[1] for line in log.splitlines() if "Final scale-up plan" in line]
    assert plans and all(p.startswith("[{nvswitch ") for p in plans), plans


def test_ca_scales_up_one_nvlink_node_from_zero_for_a_pod_the_webhook_made_ask_for_nvlink(ca: Autoscaler) -> None:
    """A pod asking 4 GPUs with require-nvlink and no scheduler of its own. The webhook gives it our scheduler and
    required affinity on an NVLink fabric; the only GPU server is PCIe, so kube-scheduler refuses it
    (Unschedulable) and so does CA's simulation. CA finds the `nvswitch` template fits (the `pcie` one does not),
    asks for exactly one node of that group, and the pod binds there through our extender, with a plan."""
    node, took = _scale_up_for(ca, _pod("nvlink-webhook", 4))
    _assert_verdicts(ca, "nvlink-webhook")
    print(f"bound on {node} {took:.1f} s after the pod was created")


def test_ca_scales_up_for_a_pod_that_names_our_scheduler_itself(ca: Autoscaler) -> None:
    """The same need from a pod that names `schedulerName: gpu-topology-scheduler` itself: the webhook lets it
    through and still adds the NVLink affinity. It asks all 8 GPUs, so the NVSwitch node of the case before (4 in
    use, if it ran) does not fit: CA adds one more `nvswitch` node, none of `pcie`, and the pod binds there."""
    node, took = _scale_up_for(ca, _pod("nvlink-named", 8, ours=True))
    _assert_verdicts(ca, "nvlink-named")
    print(f"bound on {node} {took:.1f} s after the pod was created")


def test_ca_removes_the_nodes_it_added_once_their_pods_are_gone(ca: Autoscaler) -> None:
    """With the pods deleted, each node CA added holds no GPU request: under the 0.5 utilisation threshold, empty,
    unneeded for --scale-down-unneeded-time (15 s here). CA asks our provider to delete them; the provider stops
    their plugin and kubelet stand-in and deletes the Nodes. The PCIe server no group owns stays."""
    cp = ca.cp
    added = [n for n, g in _nodes_of(cp).items() if g == "nvswitch"]
    if not added:
        pytest.skip("no scale-up case left a node to remove")
    started = time.monotonic()
    for name in _pods(cp):
        cp.request("DELETE", f"/api/v1/namespaces/{NS}/pods/{name}", ok=(200, 202, 404), gracePeriodSeconds=0)
    ca.wait("the added nodes removed", lambda: not _nodes_of(cp) and not any(
        ca.provider.members(g.id) for g in GROUPS), SCALE_DOWN_S)
    names = {n["metadata"]["name"] for n in cp.list_items("/api/v1/nodes")}
    assert "pcie-static" in names and not names & set(added), names
    log = ca.log()
    assert all(f'Scale-down: removing empty node "{n}"' in log for n in added), ca.log_tail()
    plans = re.findall(r"Final scale-up plan: \[\{(\S+) (\d+)->(\d+) ", log)
    assert len(plans) == len(added) and all(int(b) == int(a) + 1 for _, a, b in plans), plans  # one node each
    print(f"{sorted(added)} removed {time.monotonic() - started:.1f} s after their pods were deleted")


def test_a_four_pod_job_gets_one_new_node_not_four(ca: Autoscaler) -> None:
    """Four pods of one job (the training operator's labels, job size 4), 2 GPUs each, NVLink asked, and no NVSwitch
    node left. CA sees four unschedulable pods; its bin-packing estimate puts all four on one template node (8
    GPUs): one node, not one per pod. All four bind there through our extender, each with a plan."""
    cp = ca.cp
    before = set(ca.provider.members("nvswitch"))
    names = [f"job-x-worker-{i}" for i in range(4)]
    mark = len(ca.log())
    started = time.monotonic()
    for i, name in enumerate(names):
        cp.request("POST", f"/api/v1/namespaces/{NS}/pods", _pod(name, 2, job=("job-x", i, 4)))
    ca.wait("the job's pods bound", lambda: all(_get(cp, n)["spec"].get("nodeName") for n in names), SCALE_UP_S)
    took = time.monotonic() - started
    added = set(ca.provider.members("nvswitch")) - before
    assert len(added) == 1 and not ca.provider.members("pcie"), (added, ca.log_tail())
    pods = [_get(cp, n) for n in names]
    assert {p["spec"]["nodeName"] for p in pods} == added
    assert all(plan_of(p) is not None for p in pods)
    plans = [line for line in ca.log()[mark:].splitlines() if "Final scale-up plan" in line]
    assert len(plans) == 1 and "[{nvswitch 0->1 " in plans[0], plans
    print(f"job bound on {sorted(added)} {took:.1f} s after its pods were created")
