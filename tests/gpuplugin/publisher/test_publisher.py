"""NodePublisher against the in-process kube-apiserver (real HTTP, real JSON) and a fake kubelet PodResources."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import Any

import kubernetes.client
import pytest

from gpuplugin.health import HealthMonitor
from gpuplugin.podresources import PodResourcesClient, PodResourcesError
from gpuplugin.publisher import NodePublisher, sanitize_label_value, start_publisher
from gputopo.contract import Keys
from gputopo.core.codec import state_from_json, topology_from_json
from gputopo.core.topology import Topology
from gputopo.discovery.loader import load_topology_file
from gputopo.discovery.nvml_replay import ReplayNvmlBackend, load_event_stream
from gputopo.kube.errors import NotFound
from tests.fakes.kubeapi import FakeKubeApi
from tests.fakes.kubelet_podresources import PodResourcesServer
from tests.fixtures.nvml import EVENTS, HGX, canonical, load_json
from tests.gpuplugin.publisher.conftest import NODE, node_object
from tests.helpers.polling import eventually

GPU = "nvidia.com/gpu"
PREFIX = "gpu-topology.io"


@pytest.fixture(scope="module")
def topo() -> Topology:
    return load_topology_file(HGX)


@pytest.fixture
def pods(kubelet: PodResourcesServer) -> Iterator[PodResourcesClient]:
    with PodResourcesClient(kubelet.socket_path) as client:
        yield client


class Unhealthy:
    """A mutable unhealthy-ids provider."""

    def __init__(self) -> None:
        self.ids: set[str] = set()
        self.lock = threading.Lock()

    def __call__(self) -> list[str]:
        with self.lock:
            return sorted(self.ids)

    def add(self, gpu_id: str) -> None:
        with self.lock:
            self.ids.add(gpu_id)


def make(api: kubernetes.client.ApiClient, topo: Topology, pods: PodResourcesClient,
         unhealthy: Callable[[], list[str]] | None = None, device_ids: list[str] | None = None,
         **options: Any) -> NodePublisher:
    options.setdefault("poll_interval_s", 0.05)
    options.setdefault("min_interval_s", 0.0)
    options.setdefault("backoff_initial_s", 0.01)
    options.setdefault("backoff_max_s", 0.05)
    return NodePublisher(api, NODE, Keys(PREFIX), topo, device_ids, lambda: pods.used_ids(GPU),
                         unhealthy or (lambda: []), **options)


def annotations(fake: FakeKubeApi) -> dict[str, str]:
    return (fake.node(NODE) or {})["metadata"].get("annotations", {})


def labels(fake: FakeKubeApi) -> dict[str, str]:
    return (fake.node(NODE) or {})["metadata"].get("labels", {})


def patches(fake: FakeKubeApi) -> int:
    return sum(1 for r in fake.requests if r.method == "PATCH" and r.path == f"/api/v1/nodes/{NODE}")


def node_state(fake: FakeKubeApi) -> Any:
    return state_from_json(annotations(fake)[f"{PREFIX}/state"])


def test_first_publication_writes_topology_state_and_labels_and_keeps_the_rest(
    fake: FakeKubeApi, api: Any, topo: Topology, kubelet: PodResourcesServer, pods: PodResourcesClient
) -> None:
    fake.add_node(node_object())
    kubelet.service.set_pod("ml", "train", {"main": {GPU: [topo.ids[0], topo.ids[1]]}})
    pub = make(api, topo, pods)
    assert pub.publish_once() is True
    ann = annotations(fake)
    assert topology_from_json(ann[f"{PREFIX}/topology"]) == topo
    state = node_state(fake)
    assert (state.generation, state.used, state.unhealthy) == (1, {topo.ids[0], topo.ids[1]}, frozenset())
    assert ann["example.com/keep"] == "me"
    lab = labels(fake)
    assert lab[f"{PREFIX}/fabric"] == "nvswitch"
    assert lab[f"{PREFIX}/gpu-model"] == "NVIDIA-A100-SXM4-80GB"
    assert lab[f"{PREFIX}/gpu-count"] == "8"
    assert lab["team"] == "ml"
    assert pub.state == state


def test_patches_only_on_change_and_each_change_bumps_the_generation(
    fake: FakeKubeApi, api: Any, topo: Topology, kubelet: PodResourcesServer, pods: PodResourcesClient
) -> None:
    fake.add_node(node_object())
    pub = make(api, topo, pods)
    assert pub.publish_once() is True
    assert [pub.publish_once() for _ in range(3)] == [False, False, False]
    assert patches(fake) == 1
    kubelet.service.set_pod("ml", "a", {"main": {GPU: [topo.ids[3]]}})
    assert pub.publish_once() is True
    assert node_state(fake).generation == 2 and node_state(fake).used == {topo.ids[3]}
    kubelet.service.remove_pod("ml", "a")
    assert pub.publish_once() is True
    assert (node_state(fake).generation, node_state(fake).used) == (3, frozenset())
    assert patches(fake) == 3
    gets = sum(1 for r in fake.requests if r.method == "GET")
    assert gets == 1  # the Node is read once; afterwards each patch reply says what it carries


def test_a_restarted_publisher_republishes_from_podresources_not_from_memory(
    fake: FakeKubeApi, api: Any, topo: Topology, kubelet: PodResourcesServer, pods: PodResourcesClient
) -> None:
    fake.add_node(node_object())
    kubelet.service.set_pod("ml", "a", {"main": {GPU: [topo.ids[0]]}})
    kubelet.service.set_pod("ml", "b", {"main": {GPU: [topo.ids[1], topo.ids[2]]}})
    first = make(api, topo, pods)
    first.publish_once()
    first.publish_once()
    # While it is down, a pod ends and another starts.
    kubelet.service.remove_pod("ml", "a")
    kubelet.service.set_pod("ml", "c", {"main": {GPU: [topo.ids[7]]}})
    fake.clear_requests()
    second = make(api, topo, pods)
    assert second.publish_once() is True
    state = node_state(fake)
    assert state.used == {topo.ids[1], topo.ids[2], topo.ids[7]}
    assert state.generation == 2  # continues from what the Node carried
    # A third start with nothing changed reads the Node and leaves it alone.
    fake.clear_requests()
    assert make(api, topo, pods).publish_once() is False
    assert patches(fake) == 0


def test_a_tampered_state_annotation_is_overwritten_with_the_truth(
    fake: FakeKubeApi, api: Any, topo: Topology, kubelet: PodResourcesServer, pods: PodResourcesClient
) -> None:
    fake.add_node(node_object())
    kubelet.service.set_pod("ml", "a", {"main": {GPU: [topo.ids[4]]}})
    make(api, topo, pods).publish_once()
    fake.update_node(NODE, {"metadata": {"annotations": {f"{PREFIX}/state": "{not json"}}})
    assert make(api, topo, pods).publish_once() is True
    assert node_state(fake).used == {topo.ids[4]}


def test_podresources_unavailable_publishes_nothing_rather_than_a_guess(
    fake: FakeKubeApi, api: Any, topo: Topology, kubelet: PodResourcesServer, pods: PodResourcesClient
) -> None:
    fake.add_node(node_object())
    kubelet.service.set_pod("ml", "a", {"main": {GPU: [topo.ids[4]]}})
    pub = make(api, topo, pods)
    pub.publish_once()
    kubelet.service.remove_pod("ml", "a")
    import grpc

    kubelet.service.fail_next(grpc.StatusCode.UNAVAILABLE)
    with pytest.raises(PodResourcesError):
        pub.publish_once()
    assert node_state(fake).used == {topo.ids[4]}
    assert patches(fake) == 1


def test_server_errors_and_conflicts_are_retried_until_published(
    fake: FakeKubeApi, api: Any, topo: Topology, pods: PodResourcesClient
) -> None:
    fake.add_node(node_object())
    fake.fail_next(2, 500, method="PATCH")
    fake.fail_next(1, 409, method="PATCH")
    fake.fail_next(1, 503, method="GET")
    with make(api, topo, pods, poll_interval_s=30.0) as pub:
        assert pub.wait_for_state(lambda s: s.generation == 1, timeout=10)
    assert patches(fake) == 4
    assert f"{PREFIX}/topology" in annotations(fake)


def test_a_missing_node_is_retried_until_it_exists(
    fake: FakeKubeApi, api: Any, topo: Topology, pods: PodResourcesClient
) -> None:
    pub = make(api, topo, pods)
    with pytest.raises(NotFound):
        pub.publish_once()
    with pub:
        assert fake.wait_for_requests(lambda r: r.method == "GET" and r.path.endswith(NODE), n=3, timeout=10)
        fake.add_node(node_object())
        assert pub.wait_for_state(lambda s: s.generation == 1, timeout=10)
    assert topology_from_json(annotations(fake)[f"{PREFIX}/topology"]) == topo


def test_health_changes_reach_the_node_state(
    fake: FakeKubeApi, api: Any, topo: Topology, pods: PodResourcesClient
) -> None:
    """A replayed lost GPU: HealthMonitor -> trigger -> the state annotation lists it as unhealthy."""
    fake.add_node(node_object())
    backend = ReplayNvmlBackend(canonical(HGX), load_event_stream(load_json(EVENTS / "gpu-lost.json")))
    backend.init()
    ids = {i: topo.ids[i] for i in range(topo.size)}
    holder: dict[str, NodePublisher] = {}
    monitor = HealthMonitor(backend, ids, lambda changed, healthy: holder["p"].trigger(), clock=backend.clock,
                            probe_interval_s=5.0, recovery_s=None)
    holder["p"] = pub = make(api, topo, pods, unhealthy=monitor.unhealthy_ids, poll_interval_s=30.0)
    with pub:
        assert pub.wait_for_state(lambda s: s.generation == 1, timeout=10)
        with monitor:
            assert backend.wait_drained(20)
        want = {topo.ids[3], topo.ids[5]}
        assert pub.wait_for_state(lambda s: s.unhealthy == want, timeout=10)
    assert node_state(fake).unhealthy == {topo.ids[3], topo.ids[5]}


def test_rapid_changes_are_coalesced_into_few_patches(
    fake: FakeKubeApi, api: Any, topo: Topology, pods: PodResourcesClient
) -> None:
    fake.add_node(node_object())
    bad = Unhealthy()
    with make(api, topo, pods, unhealthy=bad, poll_interval_s=60.0, min_interval_s=0.5) as pub:
        assert pub.wait_for_state(lambda s: s.generation == 1, timeout=10)
        for gpu_id in topo.ids:
            bad.add(gpu_id)
            pub.trigger()
        assert pub.wait_for_state(lambda s: s.unhealthy == set(topo.ids), timeout=10)
    assert patches(fake) < 1 + topo.size


def test_index_ids_are_published_and_uuids_from_health_are_mapped_to_them(
    fake: FakeKubeApi, api: Any, topo: Topology, kubelet: PodResourcesServer, pods: PodResourcesClient
) -> None:
    fake.add_node(node_object())
    index_ids = [str(i) for i in range(topo.size)]
    kubelet.service.set_pod("ml", "a", {"main": {GPU: ["0", "3"]}})
    pub = make(api, topo, pods, unhealthy=lambda: [topo.ids[5]], device_ids=index_ids)
    pub.publish_once()
    published = topology_from_json(annotations(fake)[f"{PREFIX}/topology"])
    assert published.ids == tuple(index_ids)
    assert published.links == topo.links
    assert (node_state(fake).used, node_state(fake).unhealthy) == ({"0", "3"}, {"5"})


def test_start_publisher_follows_the_resource_managers_health(
    fake: FakeKubeApi, api: Any, topo: Topology, kubelet: PodResourcesServer
) -> None:
    from gpuplugin.deviceplugin.resource import ResourceManager

    fake.add_node(node_object())
    manager = ResourceManager(topo)
    cfg = SimpleNamespace(node_name=NODE, keys=Keys(PREFIX), resource_name=GPU,
                          pod_resources_socket=kubelet.socket_path)
    publication = start_publisher(cfg, manager, api=api, poll_interval_s=30.0, min_interval_s=0.0)
    assert publication is not None
    try:
        assert publication.publisher.wait_for_state(lambda s: s.generation == 1, timeout=10)
        manager.set_health([topo.ids[6]], False)
        assert publication.publisher.wait_for_state(lambda s: s.unhealthy == {topo.ids[6]}, timeout=10)
    finally:
        publication.stop()
    assert node_state(fake).unhealthy == {topo.ids[6]}


@pytest.mark.parametrize(
    ("raw", "clean"),
    [("NVIDIA H200", "NVIDIA-H200"), ("Tesla V100-SXM2-32GB", "Tesla-V100-SXM2-32GB"), (" (weird) ", "weird"),
     ("x" * 80, "x" * 63), ("NVIDIA RTX 6000 Ada Generation", "NVIDIA-RTX-6000-Ada-Generation"), ("--", "")],
)
def test_model_names_become_valid_label_values(raw: str, clean: str) -> None:
    assert sanitize_label_value(raw) == clean


def test_bad_arguments_are_refused(api: Any, topo: Topology, pods: PodResourcesClient) -> None:
    with pytest.raises(ValueError, match="node name"):
        NodePublisher(api, "", Keys(PREFIX), topo, None, lambda: [], lambda: [])
    with pytest.raises(ValueError, match="prefix"):
        NodePublisher(api, NODE, Keys("a/b"), topo, None, lambda: [], lambda: [])
    with pytest.raises(ValueError, match="device ids"):
        NodePublisher(api, NODE, Keys(PREFIX), topo, ["0"], lambda: [], lambda: [])


def test_a_trigger_with_follow_publishes_each_change_as_podresources_shows_it(
    fake: FakeKubeApi, api: Any, topo: Topology, kubelet: PodResourcesServer, pods: PodResourcesClient
) -> None:
    """A pod ended (issue 14, item 7; issue 20, item 6): publish now, then keep reading PodResources closely, so
    the release goes out when the kubelet lets go of the devices rather than at the next slow poll; after the
    window, the slow poll again."""
    fake.add_node(node_object())
    kubelet.service.set_pod("ml", "done", {"main": {GPU: [topo.ids[0]]}})
    with make(api, topo, pods, poll_interval_s=3600.0, follow_poll_s=0.02) as pub:
        assert pub.wait_for_state(lambda s: s.used == {topo.ids[0]}, timeout=10)
        calls = kubelet.service.list_calls
        pub.trigger(follow_s=0.5)
        eventually(lambda: kubelet.service.list_calls >= calls + 3, 10, interval=0.01)
        assert pub.state is not None and pub.state.used == {topo.ids[0]}  # the kubelet still lists the pod...
        kubelet.service.remove_pod("ml", "done")  # ...and lets go of it within the window
        assert pub.wait_for_state(lambda s: s.used == set(), timeout=10)
        time.sleep(0.6)  # the window is over
        calls = kubelet.service.list_calls
        time.sleep(0.3)
        assert kubelet.service.list_calls == calls, "still polling fast after the window"


# -- the "mig" member (issue 23) --------------------------------------------------------------------------------------


def _h200_mig() -> tuple[Topology, tuple[Any, ...]]:
    """The replayed H200 recording with MIG on some GPUs: the whole GPUs' topology and NodeDiscovery.mig."""
    from gputopo.discovery.nvml import discover_node
    from gputopo.discovery.recording import replay_backend
    from tests.fixtures.nvml import RECORDINGS

    found = discover_node(replay_backend(load_json(RECORDINGS / "synthetic-hgx-h200-141gb-8gpu-mig-mixed.json")))
    return found.topology, found.mig


def test_mig_gpus_are_published_with_their_instances_and_what_pods_hold(
    fake: FakeKubeApi, api: Any, kubelet: PodResourcesServer, pods: PodResourcesClient
) -> None:
    from gpuplugin.mig_publication import MigAdvertised, mig_block
    from gputopo.contract import mig_resource

    whole, mig = _h200_mig()
    enabled = [g for g in mig if g.enabled]
    assert enabled
    devices = [d for g in enabled for d in g.devices]
    resources = {d.uuid: mig_resource(d.name) for d in devices if d.advertised_by_mixed}
    held = next(iter(resources))
    kubelet.service.set_pod("ml", "nb", {"main": {resources[held]: [held]}})
    mixed = MigAdvertised("mixed", resources, numa={g.uuid: 0 for g in enabled}, islands={g.uuid: 0 for g in enabled},
                          peers={g.uuid: [whole.ids[0]] for g in enabled})
    fake.add_node(node_object())
    pub = make(api, whole, pods, mig=lambda: mig_block(mig, mixed, pods.in_use()))
    assert pub.publish_once() is True
    state = node_state(fake).mig
    assert state is not None and state.strategy == "mixed" and state.reason is None
    assert [g.gpu for g in state.gpus] == [g.uuid for g in sorted(enabled, key=lambda g: g.nvml_index)]
    published = {i.uuid: i for g in state.gpus for i in g.instances}
    assert set(published) == {d.uuid for d in devices if d.name is not None and d.placement is not None}
    assert state.used_ids == {held}
    assert all(g.island == 0 and g.peers == (whole.ids[0],) and g.numa == 0 for g in state.gpus)
    for d in devices:
        i = published[d.uuid]
        assert (i.profile, i.start, i.size, i.resource) == (d.name, d.placement.start, d.placement.size,
                                                            resources.get(d.uuid))
    assert node_state(fake).used.isdisjoint({g.uuid for g in enabled})
    # the pod ends: the instance is published free at the next step, and nothing else changed
    kubelet.service.remove_pod("ml", "nb")
    assert pub.publish_once() is True and node_state(fake).mig.used_ids == frozenset()
    assert pub.publish_once() is False


def test_strategy_none_publishes_the_mig_gpus_unadvertised_with_the_reason(
    fake: FakeKubeApi, api: Any, pods: PodResourcesClient
) -> None:
    from gpuplugin.mig_publication import MigAdvertised, mig_block

    whole, mig = _h200_mig()
    fake.add_node(node_object())
    pub = make(api, whole, pods, mig=lambda: mig_block(mig, MigAdvertised("none"), pods.in_use()))
    assert pub.publish_once() is True
    state = node_state(fake).mig
    assert state.strategy == "none" and state.reason is not None and state.reason.startswith(
        "MIG devices are not advertised by this plugin (MIG strategy none): ")
    assert all(i.resource is None for g in state.gpus for i in g.instances)
    with pytest.raises(ValueError, match="advertises no MIG device"):
        MigAdvertised("none", {"MIG-x": "nvidia.com/mig-1g.18gb"})
    with pytest.raises(ValueError, match="is not one of none, single, mixed"):
        MigAdvertised("dynamic")
    assert mig_block([], MigAdvertised("mixed"), {}) is None


def test_a_node_of_mig_gpus_only_publishes_its_state_without_a_topology(
    fake: FakeKubeApi, api: Any, kubelet: PodResourcesServer, pods: PodResourcesClient, topo: Topology
) -> None:
    """Every GPU MIG (issue 23): no topology, no whole-GPU labels; the topology and labels of an earlier layout (the
    node had whole GPUs) are removed, so the extender reads it as a MIG-only node. A held replica of a time-sliced
    MIG device marks its MIG UUID used; a refused strategy's reason is written, bounded."""
    from gpuplugin.mig_publication import MigAdvertised, mig_block
    from gputopo.contract import mig_resource
    from gputopo.core.codec import MAX_MIG_REASON

    _, mig = _h200_mig()
    enabled = [g for g in mig if g.enabled]
    devices = [d for g in enabled for d in g.devices if d.advertised_by_mixed]
    resources = {d.uuid: mig_resource(d.name) for d in devices}
    held = devices[0].uuid
    kubelet.service.set_pod("ml", "nb", {"main": {f"{resources[held]}.shared": [f"{held}::1"]}})
    fake.add_node(node_object())
    earlier = make(api, topo, pods)
    assert earlier.publish_once() is True and f"{PREFIX}/topology" in annotations(fake)
    assert labels(fake).get(f"{PREFIX}/gpu-count") == str(topo.size)
    sick = devices[1].uuid  # an unhealthy instance is published so (the extender skips it); a foreign id is not
    pub = NodePublisher(api, NODE, Keys(PREFIX), None, None, lambda: pods.used_ids(GPU), lambda: [sick, "GPU-gone"],
                        mig=lambda: mig_block(mig, MigAdvertised("mixed", resources), pods.in_use()))
    assert pub.publish_once() is True
    assert f"{PREFIX}/topology" not in annotations(fake)
    assert not any(k.startswith(f"{PREFIX}/") for k in labels(fake))
    state = node_state(fake)
    assert state.mig is not None and state.mig.used_ids == {held} and state.used == frozenset()
    assert state.unhealthy == {sick}
    assert pub.publish_once() is False
    refused = MigAdvertised("single", reason="mig strategy single refused: " + "x" * 1000)
    pub = NodePublisher(api, NODE, Keys(PREFIX), None, None, lambda: (), lambda: (),
                        mig=lambda: mig_block(mig, refused, {}))
    assert pub.publish_once() is True
    reason = node_state(fake).mig.reason
    assert reason is not None and reason.startswith("mig strategy single refused: ") and len(reason) == MAX_MIG_REASON
