"""The plugin process as it runs on a node: `gpuplugin run` with Kubernetes credentials (a kubeconfig pointing at the
in-process API server), the kubelet simulator, and the kubelet's PodResources socket. It must publish the Node's
topology and state, and hand the kubelet the extender's plan for a pod bound to this node."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

import httpx
import pytest

from gputopo.core import state_from_json, topology_from_json
from sim.ports import free_port
from tests.fakes.gpunode import GpuNode, gpu_node
from tests.helpers.kube import k8s_pod
from tests.helpers.paths import SHARED
from tests.helpers.polling import eventually

NODE = "dgx1-node"
RESOURCE = "nvidia.com/gpu"
DGX1 = SHARED / "topologies" / "dgx1-v100-ucxpy.txt"
WAIT = 20.0  # liveness bound of the waits, never a performance figure


@pytest.fixture
def node_env() -> Iterator[GpuNode]:
    with gpu_node(NODE, DGX1, args=["--device-id-strategy", "index"]) as node:
        yield node


@pytest.fixture
def polling_node() -> Iterator[GpuNode]:
    """PodResources read every 0.2 s (not the default 10): a new allocation reaches the Node's state quickly. Not
    for the force-deleted pod's test, which proves a release is published fast whatever the slow poll."""
    with gpu_node(NODE, DGX1, args=["--device-id-strategy", "index", "--pod-resources-poll-interval", "0.2"]) as node:
        yield node


def test_publishes_topology_and_state_and_honours_a_plan(polling_node: GpuNode) -> None:
    node_env = polling_node
    fake, podres, kubelet, proc = node_env.fake, node_env.podres, node_env.kubelet, node_env.process
    devices = kubelet.wait_for_devices(RESOURCE, 8, timeout=30)
    ids = [d.id for d in devices]
    assert ids == [str(i) for i in range(8)]

    def annotations() -> dict:
        return (fake.node(NODE) or {}).get("metadata", {}).get("annotations", {})

    assert eventually(lambda: "gpu-topology.io/topology" in annotations(), WAIT), proc.poll()
    topo = topology_from_json(annotations()["gpu-topology.io/topology"])
    assert topo.ids == tuple(ids) and topo.fabric == "nvlink"
    labels = fake.node(NODE)["metadata"]["labels"]
    assert labels["gpu-topology.io/fabric"] == "nvlink" and labels["gpu-topology.io/gpu-count"] == "8"

    # The extender bound a pod here with a plan that is not the plugin's own first choice for 2 GPUs (0,3).
    plan = {"v": 1, "node": NODE, "resource": RESOURCE, "containers": {"main": ["4", "7"]}, "gbps": 40.0}
    fake.add_pod(k8s_pod("trainer", 2, NODE, {"gpu-topology.io/plan": json.dumps(plan)}, phase="Pending"))
    node_env.admitting("trainer")
    assert eventually(lambda: kubelet.preferred_raw(RESOURCE, ids, [], 2) == ["4", "7"], WAIT)
    kubelet.allocate(RESOURCE, ["4", "7"])

    # The kubelet now reports them allocated: the state annotation follows PodResources.
    podres.service.set_pod("default", "trainer", {"main": {RESOURCE: ["4", "7"]}})
    assert eventually(lambda: state_from_json(annotations().get("gpu-topology.io/state", '{"v":1}')).used
                      == frozenset({"4", "7"}), timeout=30)
    # A plan that is no longer inside the available set is not handed out: the plugin's own best instead.
    rest = [x for x in ids if x not in ("4", "7")]
    assert kubelet.preferred_raw(RESOURCE, rest, [], 2) == ["0", "3"]


def test_a_force_deleted_pods_gpus_are_published_free_as_soon_as_the_kubelet_lets_go(node_env: GpuNode) -> None:
    """Issue 20, item 6: the API forgets a force-deleted pod at once, the kubelet lets go of its devices a moment
    later; the release must reach the Node then, not a second or more later, when the scheduler has already placed
    pods around GPUs that were free. 0.5 s is a generous bound for a shared test machine (bench.publish_release
    measures it)."""
    fake, podres = node_env.fake, node_env.podres
    podres.service.set_pod("default", "trainer", {"main": {RESOURCE: ["4", "7"]}})
    fake.add_pod(k8s_pod("trainer", 2, NODE, phase="Running"))

    def used() -> frozenset[str] | None:
        raw = (fake.node(NODE) or {}).get("metadata", {}).get("annotations", {}).get("gpu-topology.io/state")
        return state_from_json(raw).used if raw else None

    assert eventually(lambda: used() == {"4", "7"}, WAIT), node_env.log_tail()
    time.sleep(1.5)  # the plan watch has seen the pod, and the last patch is not so recent that it waits
    fake.delete_pod("default", "trainer")  # kubectl delete --force --grace-period=0
    time.sleep(0.3)  # the kubelet is still stopping it
    podres.service.remove_pod("default", "trainer")
    released = time.monotonic()
    assert eventually(lambda: used() == frozenset(), WAIT, interval=0.005), node_env.log_tail()
    latency = time.monotonic() - released
    assert latency < 0.5, f"the release reached the Node {latency:.2f} s after the kubelet let go"


def test_metrics_show_every_component_of_the_process_on_one_registry() -> None:
    """/metrics of a running plugin holds its own series, the plan watch's, the kube watch's and the runtime's, all
    under the plugin's one prefix (they once sat on the global registry, out of its sight)."""
    port = free_port()
    with gpu_node(NODE, DGX1, args=["--metrics-port", str(port)]) as node:
        node.kubelet.wait_for_devices(RESOURCE, 8, timeout=30)
        url = f"http://127.0.0.1:{port}/metrics"
        # A pod arriving on the node, once the plan watch listed the node's pods, is an event of its pod watch.
        assert eventually(lambda: "kube.watch.synced" in node.log_tail(), WAIT), node.log_tail()
        node.fake.add_pod(k8s_pod("p", 0, NODE))

        def text() -> str:
            try:
                return httpx.get(url, timeout=5).text
            except httpx.HTTPError:
                return ""

        assert eventually(lambda: 'gpuplugin_kube_watch_events_total{kind="pods"' in text(), WAIT), node.log_tail()
        body = text()
    names = {line.split("{")[0].split(" ")[0] for line in body.splitlines() if line and not line.startswith("#")}
    for expected in ("gpuplugin_registrations_total", "gpuplugin_pending_plans", "gpuplugin_devices",
                     "gpuplugin_kube_watch_events_total", "process_cpu_seconds_total", "python_info"):
        assert expected in names, expected
    foreign = sorted(n for n in names if not n.startswith(("gpuplugin_", "process_", "python_")))
    assert foreign == [], foreign
