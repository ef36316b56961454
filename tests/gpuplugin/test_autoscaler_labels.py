"""The `<prefix>/allreduce-gbps-<k>` labels, published by NodePublisher on the in-process kube-apiserver: autoscalers
read only labels (they never call the extender), so the labels must carry the extender's own figures."""

from __future__ import annotations

import math
from typing import Any

import pytest

from gpuplugin.publisher import NodePublisher
from gputopo.contract import Keys
from gputopo.core import Topology, best_possible_gbps
from gputopo.discovery.loader import load_topology_file
from tests.fakes.kubeapi import FakeKubeApi
from tests.fixtures.nvml import HGX
from tests.gpuplugin.publisher.conftest import NODE, node_object
from tests.helpers.paths import REPO

PREFIX = "gpu-topology.io"
KEYS = Keys(PREFIX)
PCIE = REPO / "fixtures" / "topologies" / "pcie-8x-rtx5090-2socket-sglang23020.txt"
H100_QUAD = REPO / "fixtures" / "topologies" / "hgx-h100-4gpu-nv6-nccl1617.txt"


def publisher(api: Any, topology: Topology | None) -> NodePublisher:
    return NodePublisher(api, NODE, KEYS, topology, None, lambda: (), lambda: ())


def labels(fake: FakeKubeApi) -> dict[str, str]:
    return (fake.node(NODE) or {})["metadata"].get("labels", {})


def allreduce(fake: FakeKubeApi) -> dict[str, str]:
    return {k: v for k, v in labels(fake).items() if k.startswith(f"{PREFIX}/allreduce-gbps-")}


@pytest.mark.parametrize("path", [HGX, PCIE], ids=["nvswitch", "pcie"])
def test_each_size_carries_the_empty_nodes_best_all_reduce_rounded_down(fake: FakeKubeApi, api: Any,
                                                                         path: Any) -> None:
    topology = load_topology_file(path)
    fake.add_node(node_object())
    assert publisher(api, topology).publish_once() is True
    want = {f"{PREFIX}/allreduce-gbps-{k}": str(math.floor(best_possible_gbps(topology, k)))
            for k in range(2, topology.size + 1)}
    assert allreduce(fake) == want
    assert labels(fake)[f"{PREFIX}/gpu-count"] == str(topology.size)
    assert labels(fake)["team"] == "ml"  # someone else's label is kept


def test_fabrics_differ_as_the_core_says() -> None:
    """The two fixtures above are worth comparing: on PCIe large rings are far slower than pairs; on NVSwitch not."""
    nvswitch, pcie = load_topology_file(HGX), load_topology_file(PCIE)
    assert best_possible_gbps(nvswitch, 8) == best_possible_gbps(nvswitch, 2)
    assert best_possible_gbps(pcie, 8) < best_possible_gbps(nvswitch, 8)


def test_labels_are_computed_once_and_not_repatched(fake: FakeKubeApi, api: Any) -> None:
    fake.add_node(node_object())
    pub = publisher(api, load_topology_file(HGX))
    assert pub.publish_once() is True
    assert [pub.publish_once() for _ in range(3)] == [False, False, False]


def test_a_node_without_whole_gpus_loses_every_size(fake: FakeKubeApi, api: Any) -> None:
    fake.add_node(node_object())
    assert publisher(api, load_topology_file(HGX)).publish_once() is True
    assert len(allreduce(fake)) == 7
    assert publisher(api, None).publish_once() is True  # every GPU went MIG
    assert allreduce(fake) == {}
    assert not any(k.startswith(f"{PREFIX}/") for k in labels(fake))
    assert labels(fake)["team"] == "ml"


def test_fewer_whole_gpus_remove_the_sizes_above_the_count(fake: FakeKubeApi, api: Any) -> None:
    fake.add_node(node_object())
    assert publisher(api, load_topology_file(HGX)).publish_once() is True
    quad = load_topology_file(H100_QUAD)
    assert publisher(api, quad).publish_once() is True  # a restarted plugin on a node with 4 whole GPUs left
    assert sorted(allreduce(fake)) == [f"{PREFIX}/allreduce-gbps-{k}" for k in (2, 3, 4)]
    assert allreduce(fake)[f"{PREFIX}/allreduce-gbps-4"] == str(math.floor(best_possible_gbps(quad, 4)))


def test_other_labels_that_only_look_alike_are_left_alone(fake: FakeKubeApi, api: Any) -> None:
    fake.add_node(node_object())
    fake.update_node(NODE, {"metadata": {"labels": {f"{PREFIX}/allreduce-gbps-max": "x",
                                                    "example.com/allreduce-gbps-9": "y"}}})
    assert publisher(api, None).publish_once() is True
    assert labels(fake)[f"{PREFIX}/allreduce-gbps-max"] == "x"
    assert labels(fake)["example.com/allreduce-gbps-9"] == "y"


def test_free_gpus_of_a_shared_resource_follow_the_pods(fake: FakeKubeApi, api: Any) -> None:
    """`<prefix>/free-gpus.<resource>`: how many GPUs still have a free replica, the number a pod asking k replicas
    (k distinct GPUs) needs; a full GPU and an unhealthy one do not count; the label goes with the sharing."""
    from gputopo.core.codec import SharedGpu, SharedResource, Sharing

    topology = load_topology_file(HGX)
    ids = topology.ids
    used: dict[str, int] = {}
    unhealthy: list[str] = []
    shared = [True]

    def sharing() -> Sharing | None:
        if not shared[0]:
            return None
        gpus = tuple(SharedGpu(g, 4, used.get(g, 0)) for g in ids)
        return Sharing("time-slicing", False, (SharedResource("nvidia.com/gpu.shared", gpus),))

    key = f"{PREFIX}/free-gpus.gpu.shared"
    fake.add_node(node_object())
    pub = NodePublisher(api, NODE, KEYS, topology, None, lambda: (), lambda: list(unhealthy), sharing=sharing)
    assert pub.publish_once() is True
    assert labels(fake)[key] == "8"
    used.update({ids[0]: 4, ids[1]: 4, ids[2]: 3})  # two GPUs full, one with a replica left
    unhealthy.append(ids[7])
    assert pub.publish_once() is True
    assert labels(fake)[key] == "5"
    used.update({ids[g]: 4 for g in range(2, 7)})
    assert pub.publish_once() is True
    assert labels(fake)[key] == "0"
    shared[0] = False
    assert pub.publish_once() is True
    assert key not in labels(fake)


def test_one_replica_per_container_follows_the_sharing_configs_flag(fake: FakeKubeApi, api: Any) -> None:
    """`<prefix>/one-replica-per-container.<resource>: "true"` while the config sets failRequestsGreaterThanOne:
    no replica count says the plugin refuses a container asking two, so the webhook's affinity needs this label to
    steer such pods (and the autoscaler's simulation) away. A config change that clears the flag, or ends the
    sharing, removes it; the free-gpus label stays with the sharing."""
    from gputopo.core.codec import SharedGpu, SharedResource, Sharing

    topology = load_topology_file(HGX)
    flag = [True]
    shared = [True]

    def sharing() -> Sharing | None:
        if not shared[0]:
            return None
        gpus = tuple(SharedGpu(g, 4, 0) for g in topology.ids)
        return Sharing("time-slicing", flag[0], (SharedResource("nvidia.com/gpu.shared", gpus),))

    key = f"{PREFIX}/one-replica-per-container.gpu.shared"
    free = f"{PREFIX}/free-gpus.gpu.shared"
    fake.add_node(node_object())
    pub = NodePublisher(api, NODE, KEYS, topology, None, lambda: (), lambda: (), sharing=sharing)
    assert pub.publish_once() is True
    assert labels(fake)[key] == "true"
    assert pub.publish_once() is False  # unchanged: not re-patched
    flag[0] = False  # the config changed: failRequestsGreaterThanOne false
    assert pub.publish_once() is True
    assert key not in labels(fake)
    assert labels(fake)[free] == "8"
    flag[0] = True
    assert pub.publish_once() is True
    assert labels(fake)[key] == "true"
    shared[0] = False
    assert pub.publish_once() is True
    assert key not in labels(fake) and free not in labels(fake)


def test_a_restarted_plugin_removes_the_flag_label_a_former_config_left(fake: FakeKubeApi, api: Any) -> None:
    """Decided on state, not on what this process wrote: a label left by a run whose config set the flag goes."""
    from gputopo.core.codec import SharedGpu, SharedResource, Sharing

    topology = load_topology_file(HGX)
    key = f"{PREFIX}/one-replica-per-container.gpu.shared"
    fake.add_node(node_object())
    fake.update_node(NODE, {"metadata": {"labels": {key: "true"}}})

    def sharing() -> Sharing:
        gpus = tuple(SharedGpu(g, 4, 0) for g in topology.ids)
        return Sharing("time-slicing", False, (SharedResource("nvidia.com/gpu.shared", gpus),))

    pub = NodePublisher(api, NODE, KEYS, topology, None, lambda: (), lambda: (), sharing=sharing)
    assert pub.publish_once() is True
    assert key not in labels(fake)
    assert labels(fake)["team"] == "ml"


BRIDGE = REPO / "fixtures" / "topologies" / "pcie-8x-rtxa6000-nvlinkbridge-pairs-2socket-unige-baobab.txt"


def rings(fake: FakeKubeApi) -> dict[str, str]:
    return {k: v for k, v in labels(fake).items() if k.startswith(f"{PREFIX}/nvlink-ring-")}


def test_nvlink_bridge_pairs_say_two_gpus_ring_on_nvlink_and_more_do_not(fake: FakeKubeApi, api: Any) -> None:
    """The fabric label says `nvlink` on bridge pairs: only nvlink-ring-<k> tells an autoscaler that a 4-GPU
    require-nvlink pod can never run there."""
    fake.add_node(node_object())
    assert publisher(api, load_topology_file(BRIDGE)).publish_once() is True
    assert labels(fake)[f"{PREFIX}/fabric"] == "nvlink"
    assert rings(fake) == {f"{PREFIX}/nvlink-ring-{k}": "true" if k == 2 else "false" for k in range(2, 9)}


def test_nvlink_ring_labels_follow_the_node_as_the_bandwidth_labels_do(fake: FakeKubeApi, api: Any) -> None:
    """Every size true on NVSwitch; none on a PCIe node (its fabric label already keeps such pods away); the sizes
    above a smaller count and every size on a node without whole GPUs are removed."""
    fake.add_node(node_object())
    assert publisher(api, load_topology_file(HGX)).publish_once() is True
    assert rings(fake) == {f"{PREFIX}/nvlink-ring-{k}": "true" for k in range(2, 9)}
    assert publisher(api, load_topology_file(H100_QUAD)).publish_once() is True
    assert rings(fake) == {f"{PREFIX}/nvlink-ring-{k}": "true" for k in (2, 3, 4)}
    assert publisher(api, load_topology_file(PCIE)).publish_once() is True
    assert rings(fake) == {}
    assert publisher(api, load_topology_file(HGX)).publish_once() is True
    assert publisher(api, None).publish_once() is True
    assert rings(fake) == {} and labels(fake)["team"] == "ml"
