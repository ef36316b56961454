"""The REAL Cluster Autoscaler 1.31.5 and NVLink that joins only pairs: one node group of 8x RTX A6000 servers whose
GPUs are NVLink-bridged in pairs (fabric label `nvlink`), over the real kube-apiserver and kube-scheduler, our
extender, the chart's second scheduler and our webhook (tests.helpers.chart_install), the cloud sim.ca_provider.

A `require-nvlink` pod of 4 GPUs can never run there: no 4 of its GPUs ring on NVLink, and the extender refuses it
for good. The fabric label alone matched the pod's affinity, so CA added a bridge node, the extender refused the
pod on it, and CA then read the pod as "can be moved to" that node: an empty node kept up for nothing and a pod
left pending. The plugin's `nvlink-ring-<k>` labels (on the template too) and the webhook's `NotIn [false]` on the
pod's size make CA's own NodeAffinity refuse the template. A 2-GPU `require-nvlink` pod still gets a bridge node.
Skips, naming why, without shared/autoscaler, shared/kube or etcd."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest

from gputopo.contract import DEFAULT_KEYS
from sim.ca_provider import NodeGroupSpec
from tests.helpers.autoscaler import Autoscaler, product_for_ca, running_autoscaler
from tests.helpers.controlplane import ControlPlane
from tests.helpers.paths import REPO
from tests.helpers.realnode import plan_of

pytestmark = [pytest.mark.timeout(420)]

NS = "ca-bridge"
GPU = "nvidia.com/gpu"
BRIDGE = REPO / "fixtures" / "topologies" / "pcie-8x-rtxa6000-nvlinkbridge-pairs-2socket-unige-baobab.txt"
GROUPS = (NodeGroupSpec("bridge", BRIDGE, 0, 2, gpu_type="rtxa6000"),)
VERDICT_S = 120.0  # CA's 30 s young-pod wait + loops, on a loaded 2-core machine (scaled by load)
SCALE_UP_S = 120.0


@pytest.fixture(scope="module")
def ca(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Autoscaler]:
    with product_for_ca(request, tmp_path_factory, NS) as (cp, binary), \
            running_autoscaler(cp, binary, GROUPS) as autoscaler:
        yield autoscaler


def _pod(name: str, gpus: int) -> dict[str, Any]:
    return {"metadata": {"name": name, "annotations": {DEFAULT_KEYS.require_nvlink: "true"}},
            "spec": {"terminationGracePeriodSeconds": 0, "containers": [{
                "name": "train", "image": "registry.invalid/none:0", "resources": {"limits": {GPU: str(gpus)}}}]}}


def _get(cp: ControlPlane, name: str) -> dict[str, Any]:
    return cp.request("GET", f"/api/v1/namespaces/{NS}/pods/{name}")  # type: ignore[no-any-return]


def test_the_bridge_template_is_refused_for_four_gpus_on_nvlink_and_no_node_is_added(ca: Autoscaler) -> None:
    """CA evaluates the pending 4-GPU pod (after its 30 s young-pod wait) and refuses the `bridge` template on
    NodeAffinity, loop after loop; it asks for no node. Before the ring labels it added one."""
    cp = ca.cp
    cp.request("POST", f"/api/v1/namespaces/{NS}/pods", _pod("four-on-nvlink", 4))
    terms = _get(cp, "four-on-nvlink")["spec"]["affinity"]["nodeAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    ring = {"key": DEFAULT_KEYS.nvlink_ring_label(4), "operator": "NotIn", "values": ["false"]}
    assert all(ring in t["matchExpressions"] for t in terms), terms
    refusal = f"Pod {NS}/four-on-nvlink can't be scheduled on bridge"

    def refusals() -> list[str]:
        return [line for line in ca.log().splitlines() if refusal in line]

    ca.wait("CA refusing the bridge template three loops running", lambda: len(refusals()) >= 3, VERDICT_S)
    assert all("node affinity" in line.lower() for line in refusals()), refusals()[:3]
    assert ca.provider.members("bridge") == [], ca.log_tail()
    assert "Final scale-up plan" not in ca.log(), ca.log_tail()
    assert not _get(cp, "four-on-nvlink")["spec"].get("nodeName")
    cp.request("DELETE", f"/api/v1/namespaces/{NS}/pods/four-on-nvlink", gracePeriodSeconds=0)


def test_a_pair_on_nvlink_still_gets_a_bridge_node(ca: Autoscaler) -> None:
    """2 GPUs ring on one bridge: the template fits (nvlink-ring-2 true), CA adds one node, the pod binds there with
    a plan on a bridged pair."""
    cp = ca.cp
    started = time.monotonic()
    cp.request("POST", f"/api/v1/namespaces/{NS}/pods", _pod("pair-on-nvlink", 2))
    ca.wait("pair-on-nvlink bound", lambda: _get(cp, "pair-on-nvlink")["spec"].get("nodeName"), SCALE_UP_S)
    pod = _get(cp, "pair-on-nvlink")
    assert pod["spec"]["nodeName"] in ca.provider.members("bridge") and len(ca.provider.members("bridge")) == 1
    plan = plan_of(pod)
    assert plan is not None, "bound by our extender, with a plan"
    print(f"bound on {pod['spec']['nodeName']} {time.monotonic() - started:.1f} s after creation; plan {plan}")
