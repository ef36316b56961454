"""The REAL Cluster Autoscaler 1.31.5 and the window while a new node is being described: the Node registers Ready
before its plugin has published the node's GPUs (`nvidia.com/gpu` allocatable) and labels. A CA loop in that window
may see a ready node with no room for the pending pod and add a second node.

What protects against it (docs/autoscaling.md, "Configure the autoscaler"): the node registers with the provider's
GPU label, so CA counts a GPU-labelled node without allocatable GPUs as still starting, with its template's GPUs,
and with the plugin's labels from `gpuplugin node-template --format kubelet` (the provider passes the template's
labels to the node's registration). The window is made long on purpose here: each new node's plugin starts
PUBLISH_DELAY_S after its Node registered, so several CA loops (5 s apart) run inside it. Each case has its own CA
and provider (one `nvswitch` group of at most 3 HGX A100 nodes, from zero; scale-down only after UNNEEDED, longer
than a case) over the shared control plane with our extender,
scheduler and webhook: one case registers nodes with the labels, the other without, and the second shows the first
can fail. Skips, naming why, without shared/autoscaler, shared/kube or etcd."""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from gputopo.contract import DEFAULT_KEYS
from sim.ca_provider import NodeGroupSpec, parse_provider_id
from tests.extender.conftest import A100
from tests.helpers.autoscaler import Autoscaler, product_for_ca, running_autoscaler
from tests.helpers.controlplane import ControlPlane
from tests.helpers.realnode import plan_of

pytestmark = [pytest.mark.timeout(360)]

NS = "ca-window"
GPU = "nvidia.com/gpu"
PUBLISH_DELAY_S = 30.0  # a new node's plugin starts this long after its Node registered Ready
BIND_S = 120.0 + PUBLISH_DELAY_S  # CA's 30 s young-pod wait + loops + a node starting + the delay (scaled by load)
GROUP = NodeGroupSpec("nvswitch", A100, 0, 3, gpu_type="a100")
# longer than a case: with the 15 s of the other real-CA file, CA removed the nodes of the case without labels as
# empty (no pod fits a node without GPUs) before their window ended, added them again, and the pod never bound
UNNEEDED = "5m"
PLAN = re.compile(r"Final scale-up plan: \[\{(\S+) (\d+)->(\d+) ")


@dataclass
class Setup:
    cp: ControlPlane
    binary: Path


@pytest.fixture(scope="module")
def setup(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Setup]:
    """The CA binary and the shared control plane with the product installed as the chart deploys it."""
    with product_for_ca(request, tmp_path_factory, NS) as (cp, binary):
        yield Setup(cp, binary)


@dataclass
class Watch:
    """What the test saw while it waited for the pod: every node the provider ever started (in order), and when
    (monotonic) and at which CA log offset each one's Node first carried our providerID (registered, Ready) and
    first had its GPUs and fabric label (described)."""

    members: list[str] = field(default_factory=list)
    registered: dict[str, tuple[float, int]] = field(default_factory=dict)
    described: dict[str, tuple[float, int]] = field(default_factory=dict)


def _pod(name: str) -> dict[str, Any]:
    """All 8 GPUs of a node, NVLink asked (the webhook gives it our scheduler and the fabric affinity)."""
    return {"metadata": {"name": name, "annotations": {DEFAULT_KEYS.require_nvlink: "true"}},
            "spec": {"terminationGracePeriodSeconds": 0, "containers": [{
                "name": "train", "image": "registry.invalid/none:0", "resources": {"limits": {GPU: "8"}}}]}}


def _bound(cp: ControlPlane, name: str) -> str | None:
    return cp.request("GET", f"/api/v1/namespaces/{NS}/pods/{name}")["spec"].get("nodeName")  # type: ignore[no-any-return]


def _scale_up_through_the_window(s: Setup, **options: Any) -> tuple[Autoscaler, Watch, str, str]:
    """Under a CA whose new nodes publish PUBLISH_DELAY_S late (and `options` for running_autoscaler), create one
    pending pod and watch the provider's members and their Nodes until the pod binds; the pod binds only once a node
    published its GPUs, so the first node's window is over by then. Returns CA, the watch, the pod's node and CA's
    log from the pod on."""
    cp, name = s.cp, "window-8"
    watch = Watch()
    with running_autoscaler(cp, s.binary, (GROUP,), unneeded=UNNEEDED, publish_delay_s=PUBLISH_DELAY_S,
                            **options) as ca:
        mark = ca.proc.log.stat().st_size

        def look() -> str | None:
            for m in ca.provider.members(GROUP.id):
                if m not in watch.members:
                    watch.members.append(m)
            now, offset = time.monotonic(), ca.proc.log.stat().st_size
            for node in cp.list_items("/api/v1/nodes"):
                node_name = node["metadata"]["name"]
                if parse_provider_id((node.get("spec") or {}).get("providerID") or "") is None:
                    continue
                watch.registered.setdefault(node_name, (now, offset))
                if (node["status"].get("allocatable", {}).get(GPU) == "8"
                        and DEFAULT_KEYS.fabric_label in (node["metadata"].get("labels") or {})):
                    watch.described.setdefault(node_name, (now, offset))
            return _bound(cp, name)

        try:
            cp.request("POST", f"/api/v1/namespaces/{NS}/pods", _pod(name))
            ca.wait(f"{name} bound", look, BIND_S)
            look()
            node = _bound(cp, name)
            assert node is not None
            assert plan_of(cp.request("GET", f"/api/v1/namespaces/{NS}/pods/{name}")) is not None, "bound by us"
            return ca, watch, node, _between(ca, mark, ca.proc.log.stat().st_size)
        finally:
            cp.request("DELETE", f"/api/v1/namespaces/{NS}/pods/{name}", ok=(200, 202, 404), gracePeriodSeconds=0)


def _between(ca: Autoscaler, start: int, end: int) -> str:
    """CA's log between two byte offsets (of Watch)."""
    return ca.proc.log.read_bytes()[start:end].decode(errors="replace")


def test_a_node_that_registers_with_the_gpu_label_and_the_plugin_labels_gets_no_second_node(setup: Setup) -> None:
    """With the GPU label and the plugin's labels on the registration: one 8-GPU require-nvlink pod, one node added
    (CA's only plan is `nvswitch 0->1`, the provider never started a second node), although several CA loops ran
    while that node was Ready without GPUs; the pod binds on it, through our extender, once its plugin published."""
    ca, watch, node, log = _scale_up_through_the_window(setup)
    first = watch.members[0]
    (t0, at0), (t1, at1) = watch.registered[first], watch.described[first]
    in_window = _between(ca, at0, at1)
    window, loops = t1 - t0, in_window.count("Starting main loop")
    plans = PLAN.findall(log)
    assert plans == [("nvswitch", "0", "1")], (plans, ca.log_tail())
    # CA's GPU processor counted the node as not ready yet, in every loop of the window
    starting = in_window.count(f"Overriding status of node {first}, which seems to have unready GPU")
    assert watch.members == [first] == [node], (watch, ca.log_tail())
    assert window >= PUBLISH_DELAY_S * 0.8 and loops >= 3, (window, loops)  # the window was there, and CA looked
    assert starting >= loops - 1, (starting, loops)  # a loop may straddle either end of the window
    print(f"one node ({node}); window {window:.1f} s, {loops} CA loops in it, {starting} of them with the node "
          f"as still starting")


def test_a_node_that_registers_without_them_gets_a_second_node_in_the_window(setup: Setup) -> None:
    """The counter-case, showing the case before can fail: the same with the GPU label and the plugin's labels left
    off the registration. In the window CA sees a ready node with no GPUs and no fabric label, which the pending
    pod does not fit, no node upcoming, and the group's template (the provider's) that it fits: it adds a second
    node before the first one's plugin published."""
    ca, watch, node, log = _scale_up_through_the_window(setup, registration_labels=False)
    first = watch.members[0]
    (t0, at0), (t1, at1) = watch.registered[first], watch.described[first]
    window, loops = t1 - t0, _between(ca, at0, at1).count("Starting main loop")
    in_window = PLAN.findall(_between(ca, at0, at1))
    plans = PLAN.findall(log)
    assert len(watch.members) >= 2 and in_window, (watch, plans, ca.log_tail())
    assert plans[0] == ("nvswitch", "0", "1") and all(int(b) == int(a) + 1 for _, a, b in plans), plans
    print(f"{len(watch.members)} nodes ({watch.members}) for one pod, bound on {node}; window {window:.1f} s, "
          f"{loops} CA loops in it; plans {plans}, {len(in_window)} in the window")
