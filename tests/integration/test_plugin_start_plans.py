"""A plugin process that starts (again, after a crash or a rollout) while a pod with an extender plan is being
admitted must hand the kubelet that plan from its first answer. The kubelet asks as soon as the plugin registers, so
the plan watch has to be listed and attached before the registration, not seconds after it (the crash sweep,
bench/plugin_crash.py, found pods admitted just after a restart getting the allocator's own choice instead)."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from tests.fakes.gpunode import GpuNode, gpu_node
from tests.helpers.kube import k8s_pod
from tests.helpers.paths import SHARED

NODE = "restart-node"
RESOURCE = "nvidia.com/gpu"
DGX1 = SHARED / "topologies" / "dgx1-v100-ucxpy.txt"
WAIT = 30.0  # liveness bound of the waits, never a performance figure


@pytest.fixture
def node() -> Iterator[GpuNode]:
    with gpu_node(NODE, DGX1, args=["--device-id-strategy", "index"]) as node:
        yield node


def test_the_first_question_after_a_restart_gets_the_plan_of_the_pod_being_admitted(node: GpuNode) -> None:
    ids = [d.id for d in node.kubelet.wait_for_devices(RESOURCE, 8, WAIT)]
    node.kill()
    # Bound while the plugin was away, and being admitted when it is back (the plugin's own choice would be 0,3).
    plan = {"v": 1, "node": NODE, "resource": RESOURCE, "containers": {"main": ["4", "7"]}, "gbps": 40.0}
    node.fake.add_pod(k8s_pod("trainer", 2, NODE, {"gpu-topology.io/plan": json.dumps(plan)}, phase="Pending"))
    node.admitting("trainer")
    node.start_again()
    node.kubelet.wait_for_registrations(RESOURCE, 2, WAIT)
    assert node.kubelet.preferred_raw(RESOURCE, ids, [], 2) == ["4", "7"], node.log_tail()
