"""Which pod a GetPreferredAllocation question is for: a plan goes only to the pod it was made for.

The kubelet does not name the pod it admits. It lists a pod in PodResources from just before admitting it, and a
container holds its devices there from the moment it was allocated; the plan watch reads that List (here through
the real client over a unix socket, against the fake kubelet service) and, when it cannot, follows the kubelet's
order: creation time, each container once."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from gpuplugin.metrics import PluginMetrics
from gpuplugin.plan_watch import PlanWatch
from gpuplugin.podresources import PodResourcesClient
from tests.fakes.kubeapi import FakeKubeApi
from tests.fakes.kubelet_podresources import PodResourcesServer
from tests.helpers.kube import k8s_pod
from tests.helpers.polling import eventually

PLAN = "gpu-topology.io/plan"
SHARED = "nvidia.com/gpu.shared"
GPUS = [f"GPU-{i}" for i in range(4)]
pytestmark = pytest.mark.usefixtures("no_leaked_threads")


def planned(name: str, ids: list[str], *, resource: str = "nvidia.com/gpu", created: str | None = None,
            containers: dict[str, list[str]] | None = None) -> dict[str, Any]:
    plan = {"v": 1, "node": "node-a", "resource": resource, "containers": containers or {"main": ids}, "gbps": 50.0}
    p = k8s_pod(name, 0, "node-a", {PLAN: json.dumps(plan)})
    if containers:
        p["spec"]["initContainers"] = [{"name": c, "image": "registry.invalid/none:0"} for c in containers
                                       if c.startswith("init")]
        p["spec"]["containers"] = [{"name": c, "image": "registry.invalid/none:0"} for c in containers
                                   if not c.startswith("init")]
    if created:
        p["metadata"]["creationTimestamp"] = created
    return p


class Kubelet:
    """The kubelet's PodResources service on a real socket, with the pods it knows and the devices they hold."""

    def __init__(self, server: PodResourcesServer, socket: Path) -> None:
        self.service = server.service
        self.client = PodResourcesClient(str(socket), timeout_s=2.0)

    def knows(self, name: str, held: dict[str, list[str]] | None = None, resource: str = SHARED) -> None:
        self.service.set_pod("default", name, {"main": {resource: held["main"]}} if held else {"main": {}})


@pytest.fixture
def kubelet(tmp_path: Path) -> Iterator[Kubelet]:
    socket = tmp_path / "kubelet.sock"
    with PodResourcesServer(str(socket)) as server:
        k = Kubelet(server, socket)
        yield k
        k.client.close()


def start_watch(api: Any, view: Callable[[], Any] | None, metrics: PluginMetrics | None = None) -> PlanWatch:
    pw = PlanWatch(api, "node-a", backoff_initial_s=0.02, backoff_max_s=0.1, metrics=metrics or PluginMetrics(),
                   shared_resources=lambda: [SHARED], kubelet_view=view)
    pw.start()
    assert pw.wait_synced(10)
    return pw


def wait_for(watch: PlanWatch, names: set[str]) -> None:
    assert eventually(lambda: {p.name for p in watch.pending()} == names, timeout=10.0, interval=0.01), \
        watch.pending()


def test_replicas_go_to_the_pod_being_admitted_not_to_an_older_plan(fake: FakeKubeApi, api: Any,
                                                                     kubelet: Kubelet) -> None:
    """Time-slicing: GPU replicas stay available after an allocation, so an admitted pod's plan still fits. It was
    handed to the next pod too, and replicas piled up on GPUs already shared while the planned ones stayed idle."""
    fake.add_pod(planned("c3-000", ["GPU-0", "GPU-3"], resource=SHARED))
    fake.add_pod(planned("c3-001", ["GPU-1", "GPU-2"], resource=SHARED))
    watch = start_watch(api, lambda: kubelet.client.pods(0.5))
    try:
        wait_for(watch, {"c3-000", "c3-001"})
        shared = watch.for_resource(SHARED)
        kubelet.knows("c3-000")
        assert shared.pending_plan(GPUS, [], 2) == ["GPU-0", "GPU-3"]
        kubelet.knows("c3-000", {"main": ["GPU-0::0", "GPU-3::0"]})
        kubelet.knows("c3-001")
        assert shared.pending_plan(GPUS, [], 2) == ["GPU-1", "GPU-2"]
    finally:
        watch.stop()


def test_a_plan_never_goes_to_a_pod_the_kubelet_is_not_admitting(fake: FakeKubeApi, api: Any,
                                                                   kubelet: Kubelet) -> None:
    metrics = PluginMetrics()
    fake.add_pod(planned("older", ["GPU-0", "GPU-1"], created="2026-12-01T10:00:00Z"))
    fake.add_pod(planned("newer", ["GPU-2", "GPU-3"], created="2026-12-01T10:00:05Z"))
    watch = start_watch(api, lambda: kubelet.client.pods(0.5), metrics)
    try:
        wait_for(watch, {"older", "newer"})
        # the kubelet got the newer pod first (bound first, in its own batch): it is the one being admitted
        kubelet.knows("newer")
        assert watch.pending_plan(GPUS, [], 2) == ["GPU-2", "GPU-3"]
        # a pod without a plan is being admitted (the kubelet lists neither planned pod as waiting): no plan
        kubelet.knows("newer", {"main": ["GPU-2", "GPU-3"]}, resource="nvidia.com/gpu")
        assert watch.pending_plan(GPUS[:2], [], 2) is None
        sample = metrics.registry.get_sample_value("gpuplugin_plan_lookups_total",
                                                   {"result": "miss", "reason": "not_admitting"})
        assert sample == 1.0
        kubelet.knows("older")
        assert watch.pending_plan(GPUS[:2], [], 2) == ["GPU-0", "GPU-1"]
    finally:
        watch.stop()


def test_after_a_restart_the_kubelet_says_which_containers_are_allocated(fake: FakeKubeApi, api: Any,
                                                                        kubelet: Kubelet) -> None:
    """A pod stays Pending through minutes of image pulls after its admission; a restarted plugin has no memory of
    what it handed out, and its plan, still fitting, must not go to a second pod."""
    fake.add_pod(planned("pulling", ["GPU-0"], resource=SHARED))
    fake.add_pod(planned("next", ["GPU-1"], resource=SHARED))
    kubelet.knows("pulling", {"main": ["GPU-0::0"]})
    kubelet.knows("next")
    watch = start_watch(api, lambda: kubelet.client.pods(0.5))
    try:
        wait_for(watch, {"pulling", "next"})
        assert watch.for_resource(SHARED).pending_plan(GPUS, [], 1) == ["GPU-1"]
    finally:
        watch.stop()


def test_containers_are_answered_in_the_kubelets_order(fake: FakeKubeApi, api: Any) -> None:
    """Init containers first, then the others, each once: a plan's JSON order is not the kubelet's."""
    fake.add_pod(planned("multi", [], containers={"worker": ["GPU-2", "GPU-3"], "init-warm": ["GPU-0", "GPU-1"]}))
    watch = start_watch(api, None)
    try:
        wait_for(watch, {"multi"})
        assert watch.pending_plan(GPUS, [], 2) == ["GPU-0", "GPU-1"]
        assert watch.pending_plan(GPUS, [], 2) == ["GPU-2", "GPU-3"]
        assert watch.pending_plan(GPUS, [], 2) is None
    finally:
        watch.stop()


def test_without_the_kubelets_list_the_kubelets_order_stands(fake: FakeKubeApi, api: Any, tmp_path: Path) -> None:
    """No PodResources (socket gone, rate limit): pods by creation time, each plan once; said once, counted."""
    metrics = PluginMetrics()
    fake.add_pod(planned("second", ["GPU-2", "GPU-3"], resource=SHARED, created="2026-12-01T10:00:05Z"))
    fake.add_pod(planned("first", ["GPU-0", "GPU-1"], resource=SHARED, created="2026-12-01T10:00:00Z"))
    absent = PodResourcesClient(str(tmp_path / "no-kubelet.sock"), timeout_s=0.2)
    watch = start_watch(api, lambda: absent.pods(0.2), metrics)
    try:
        wait_for(watch, {"first", "second"})
        shared = watch.for_resource(SHARED)
        assert shared.pending_plan(GPUS, [], 2) == ["GPU-0", "GPU-1"]
        assert shared.pending_plan(GPUS, [], 2) == ["GPU-2", "GPU-3"]
        assert shared.pending_plan(GPUS, [], 2) is None
        assert metrics.registry.get_sample_value("gpuplugin_plan_kubelet_view_failures_total") == 3.0
    finally:
        watch.stop()
        absent.close()


def test_the_kubelet_list_names_pods_without_devices_too(kubelet: Kubelet) -> None:
    kubelet.knows("waiting")
    kubelet.knows("holding", {"main": ["GPU-1::2"]})
    assert kubelet.client.pods() == {("default", "waiting"): {"main": {}},
                                     ("default", "holding"): {"main": {SHARED: ("GPU-1::2",)}}}
    kubelet.service.fail_next(grpc.StatusCode.RESOURCE_EXHAUSTED)
    with pytest.raises(Exception, match="RESOURCE_EXHAUSTED"):
        kubelet.client.pods()


def test_a_pod_the_kubelet_admits_before_this_watch_delivers_it_still_gets_its_plan(
        fake: FakeKubeApi, api: Any, kubelet: Kubelet) -> None:
    """The kubelet and the plugin watch the same apiserver; the kubelet can be first. The question waits (bounded)
    for the watch to bring the pod the kubelet lists, instead of answering without its plan."""
    watch = start_watch(api, lambda: kubelet.client.pods(0.5))
    try:
        kubelet.knows("late")
        timer = threading.Timer(0.2, lambda: fake.add_pod(planned("late", ["GPU-1", "GPU-2"])))
        timer.start()
        assert watch.pending_plan(GPUS, [], 2) == ["GPU-1", "GPU-2"]
        timer.join()
        # a pod the kubelet still lists that the apiserver no longer has is waited for once, not per question
        watch.watch_lag_wait_s = 0.3
        kubelet.knows("ghost")
        started = time.monotonic()
        assert watch.pending_plan(GPUS, [], 1) is None
        assert watch.pending_plan(GPUS, [], 1) is None
        assert time.monotonic() - started < 0.3 + 0.25
    finally:
        watch.stop()
