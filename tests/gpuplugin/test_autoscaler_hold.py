"""The autoscaler hold, published by NodePublisher on the in-process kube-apiserver: on a node whose GPU request
ratio the Cluster Autoscaler misreads (shared replicas, MIG), the Node says "do not remove" to CA and Karpenter while
enough physical GPUs are in use, and only the plugin's own annotations are ever removed."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import structlog

from gpuplugin.autoscaler_hold import AutoscalerHold
from gpuplugin.publisher import NodePublisher
from gputopo.contract import CA_SCALE_DOWN_DISABLED, KARPENTER_DO_NOT_DISRUPT, Keys
from gputopo.core.codec import Mig, MigGpuInfo, MigInstance, SharedGpu, SharedResource, Sharing
from gputopo.core.topology import Topology
from gputopo.discovery.loader import load_topology_file
from tests.fakes.kubeapi import FakeKubeApi
from tests.fixtures.nvml import HGX, RECORDINGS
from tests.gpuplugin.publisher.conftest import NODE, node_object
from tests.helpers.polling import eventually

PREFIX = "gpu-topology.io"
KEYS = Keys(PREFIX)
OWNER = f"{PREFIX}/autoscaler-hold"
CA, KP = CA_SCALE_DOWN_DISABLED, KARPENTER_DO_NOT_DISRUPT


@pytest.fixture(scope="module")
def topo() -> Topology:
    return load_topology_file(HGX)


class Node:
    """What the plugin knows of its GPUs, changed by a test between publishes."""

    def __init__(self, topo: Topology) -> None:
        self.topo = topo
        self.lock = threading.Lock()
        self.whole_used: set[str] = set()
        self.replicas_used: dict[str, int] = {}  # GPU id -> replicas held
        self.shared: bool = False
        self.mig: Mig | None = None

    def used(self) -> list[str]:
        with self.lock:
            return sorted(self.whole_used)

    def sharing(self) -> Sharing | None:
        with self.lock:
            if not self.shared:
                return None
            gpus = tuple(SharedGpu(g, 4, self.replicas_used.get(g, 0)) for g in self.topo.ids)
            return Sharing("time-slicing", False, (SharedResource("nvidia.com/gpu.shared", gpus),))

    def hold_replicas(self, count: int) -> None:
        with self.lock:
            self.replicas_used = {g: 1 for g in self.topo.ids[:count]}


def publisher(api: Any, node: Node, threshold: float = 0.5, **options: Any) -> NodePublisher:
    options.setdefault("poll_interval_s", 0.05)
    options.setdefault("min_interval_s", 0.0)
    options.setdefault("backoff_initial_s", 0.01)
    options.setdefault("backoff_max_s", 0.05)
    return NodePublisher(api, NODE, KEYS, node.topo, None, node.used, lambda: (), sharing=node.sharing,
                         mig=lambda: node.mig, autoscaler_hold=AutoscalerHold(KEYS, threshold), **options)


def annotations(fake: FakeKubeApi) -> dict[str, str]:
    return (fake.node(NODE) or {})["metadata"].get("annotations", {})


def hold(fake: FakeKubeApi) -> dict[str, str | None]:
    ann = annotations(fake)
    return {k: ann.get(k) for k in (CA, KP, OWNER)}


HELD = {CA: "true", KP: "true", OWNER: f"{CA},{KP}"}
FREE = {CA: None, KP: None, OWNER: None}


def test_shared_gpus_hold_the_node_at_the_threshold_and_release_it_below(
    fake: FakeKubeApi, api: Any, topo: Topology
) -> None:
    """8 time-sliced GPUs renamed to nvidia.com/gpu.shared: CA sees no nvidia.com/gpu request at all (0 %)."""
    fake.add_node(node_object())
    node = Node(topo)
    node.shared = True
    node.hold_replicas(3)  # 3 of 8 GPUs busy: below half
    pub = publisher(api, node)
    assert pub.publish_once() is True
    assert hold(fake) == FREE
    node.hold_replicas(4)  # 4 of 8: at the threshold
    with structlog.testing.capture_logs() as logs:
        assert pub.publish_once() is True
    assert hold(fake) == HELD
    assert [(e["event"], e["share"]) for e in logs if "autoscaler_hold" in e["event"]] == [
        ("plugin.autoscaler_hold.set", 0.5)]
    assert pub.publish_once() is False  # nothing changed: no patch
    node.hold_replicas(3)
    with structlog.testing.capture_logs() as logs:
        assert pub.publish_once() is True
    assert hold(fake) == FREE
    assert [(e["event"], e["share"]) for e in logs if "autoscaler_hold" in e["event"]] == [
        ("plugin.autoscaler_hold.lifted", 0.375)]
    assert annotations(fake)["example.com/keep"] == "me"


def test_whole_gpus_alone_never_hold_the_node(fake: FakeKubeApi, api: Any, topo: Topology) -> None:
    """Without sharing or MIG, CA's own nvidia.com/gpu ratio is right: the plugin stays out of it."""
    fake.add_node(node_object())
    node = Node(topo)
    node.whole_used = set(topo.ids)
    publisher(api, node).publish_once()
    assert hold(fake) == FREE


def test_busy_mig_gpus_hold_the_node(fake: FakeKubeApi, api: Any) -> None:
    """Mixed strategy on an H200 board: 4 whole GPUs (one held) beside 4 MIG GPUs with an instance held on 3: 4 of 8
    busy. CA's nvidia.com/gpu ratio would read 1 of 4 whole GPUs, 25 %."""
    fake.add_node(node_object())
    node = Node(load_topology_file(RECORDINGS / "synthetic-hgx-h200-141gb-8gpu-mig-mixed.json"))
    assert node.topo.size == 4
    node.whole_used = {node.topo.ids[0]}

    def mig_gpu(i: int, used: bool) -> MigGpuInfo:
        inst = MigInstance("1g.18gb", 0, 1, f"MIG-{i}0000000-5e7d-4000-8000-00000000000{i}", "nvidia.com/mig-1g.18gb",
                           used)
        return MigGpuInfo(f"GPU-c200000{4 + i}-5e7d-4000-8000-00000000000{4 + i}", 4 + i, None, None, "NVIDIA H200",
                          (inst,))

    node.mig = Mig("mixed", None, tuple(mig_gpu(i, used=i < 3) for i in range(4)))
    pub = publisher(api, node)
    assert pub.publish_once() is True
    assert hold(fake) == HELD
    node.mig = Mig("mixed", None, tuple(mig_gpu(i, used=i < 2) for i in range(4)))  # 3 of 8
    assert pub.publish_once() is True
    assert hold(fake) == FREE


def test_annotations_someone_else_set_are_never_touched(fake: FakeKubeApi, api: Any, topo: Topology) -> None:
    fake.add_node(node_object())
    fake.update_node(NODE, {"metadata": {"annotations": {CA: "false", KP: "true"}}})
    node = Node(topo)
    node.shared = True
    node.hold_replicas(8)
    pub = publisher(api, node)
    pub.publish_once()
    assert hold(fake) == {CA: "false", KP: "true", OWNER: None}  # both present before: not ours, not changed
    node.hold_replicas(0)
    pub.publish_once()
    assert hold(fake) == {CA: "false", KP: "true", OWNER: None}


def test_only_the_annotation_the_plugin_set_is_lifted(fake: FakeKubeApi, api: Any, topo: Topology) -> None:
    """Someone pinned the node for CA; the plugin adds Karpenter's, and on release removes Karpenter's only. A
    restarted plugin knows which one is its own from the Node."""
    fake.add_node(node_object())
    fake.update_node(NODE, {"metadata": {"annotations": {CA: "true"}}})
    node = Node(topo)
    node.shared = True
    node.hold_replicas(6)
    publisher(api, node).publish_once()
    assert hold(fake) == {CA: "true", KP: "true", OWNER: KP}
    node.hold_replicas(1)
    assert publisher(api, node).publish_once() is True  # a new process: ownership comes from the Node
    assert hold(fake) == {CA: "true", KP: None, OWNER: None}


def test_a_changed_value_is_no_longer_the_plugins(fake: FakeKubeApi, api: Any, topo: Topology) -> None:
    fake.add_node(node_object())
    node = Node(topo)
    node.shared = True
    node.hold_replicas(8)
    pub = publisher(api, node)
    pub.publish_once()
    assert hold(fake) == HELD
    fake.update_node(NODE, {"metadata": {"annotations": {KP: "false"}}})  # an operator overrides Karpenter's
    node.hold_replicas(0)
    assert pub.publish_once() is True
    assert hold(fake) == {CA: None, KP: "false", OWNER: None}


def test_threshold_zero_turns_the_hold_off_and_lifts_the_plugins_own(
    fake: FakeKubeApi, api: Any, topo: Topology
) -> None:
    fake.add_node(node_object())
    node = Node(topo)
    node.shared = True
    node.hold_replicas(8)
    publisher(api, node).publish_once()
    assert hold(fake) == HELD
    assert publisher(api, node, threshold=0.0).publish_once() is True
    assert hold(fake) == FREE
    with pytest.raises(ValueError, match="from 0 to 1"):
        AutoscalerHold(KEYS, 1.5)


def test_a_failing_apiserver_does_not_stop_the_loop(fake: FakeKubeApi, api: Any, topo: Topology) -> None:
    fake.add_node(node_object())
    node = Node(topo)
    node.shared = True
    node.hold_replicas(8)
    fake.fail_next(2, 500, method="PATCH")
    fake.fail_next(1, 409, method="PATCH")
    fake.fail_next(2, 503, method="GET")
    with publisher(api, node, poll_interval_s=0.02):
        eventually(lambda: hold(fake) == HELD, 10, interval=0.02)
        node.hold_replicas(0)
        fake.fail_next(1, 500, method="PATCH")
        eventually(lambda: hold(fake) == FREE, 10, interval=0.02)


def test_the_hold_change_is_decided_on_the_node_as_it_is_now(fake: FakeKubeApi, api: Any, topo: Topology) -> None:
    """Someone sets CA's annotation after the plugin's last patch: the plugin reads the Node again before the hold
    changes, so it does not claim (and later remove) what it did not set."""
    fake.add_node(node_object())
    node = Node(topo)
    node.shared = True
    pub = publisher(api, node)
    pub.publish_once()
    fake.update_node(NODE, {"metadata": {"annotations": {CA: "true"}}})
    node.hold_replicas(8)
    fake.clear_requests()
    pub.publish_once()
    assert hold(fake) == {CA: "true", KP: "true", OWNER: KP}
    assert [r.method for r in fake.requests] == ["GET", "PATCH"]
    fake.clear_requests()
    node.hold_replicas(7)  # a state change that leaves the hold as it is: no extra read
    pub.publish_once()
    assert [r.method for r in fake.requests] == ["PATCH"]
