"""The plugin-side PlanSource against FakeKubeApi: pending plans of this node's pods, hits and misses."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from gpuplugin.deviceplugin.plans import PlanSource
from gpuplugin.metrics import PluginMetrics
from gpuplugin.plan_watch import PlanWatch
from gputopo.contract import Plan, PlanFormatError, encode_plan, parse_plan
from tests.fakes.kubeapi import FakeKubeApi
from tests.helpers.kube import k8s_pod
from tests.helpers.polling import eventually

PLAN = "gpu-topology.io/plan"
METRICS = PluginMetrics()  # the plan watches of this module count here
IDS = [f"GPU-{i}" for i in range(8)]
# Every watch thread a test here starts must be gone when it ends (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("no_leaked_threads")


def plan_text(node: str, containers: dict[str, list[str]], resource: str = "nvidia.com/gpu") -> str:
    return json.dumps({"v": 1, "node": node, "resource": resource, "containers": containers, "gbps": 240.0})


def pod(name: str, node: str | None, plan: str | None = None, phase: str | None = None) -> dict[str, Any]:
    """A pod asking for no GPU, with the extender's plan annotation when given."""
    return k8s_pod(name, 0, node, {PLAN: plan} if plan else None, phase=phase)


def lookups(result: str, reason: str) -> float:
    labels = {"result": result, "reason": reason}
    return METRICS.registry.get_sample_value("gpuplugin_plan_lookups_total", labels) or 0.0


@pytest.fixture
def watch(fake: FakeKubeApi, api) -> Iterator[PlanWatch]:
    pw = PlanWatch(api, "node-a", backoff_initial_s=0.02, backoff_max_s=0.1, metrics=METRICS)
    with pw:
        assert pw.wait_synced(10)
        yield pw


def wait_pending(fake: FakeKubeApi, watch: PlanWatch, n: int) -> None:
    # every change goes through the watch stream; a marker pod on the node tells us the stream caught up
    marker = f"marker-{fake.resource_version}"
    fake.add_pod(pod(marker, "node-a", plan_text("node-a", {"m": ["GPU-X"]})))
    deadline_ok = _wait(lambda: any(p.name == marker for p in watch.pending()))
    fake.delete_pod("default", marker)
    assert deadline_ok and _wait(lambda: all(p.name != marker for p in watch.pending()))
    assert len(watch.pending()) == n, watch.pending()


def _wait(pred: Callable[[], bool]) -> bool:
    """Wait for the watch thread to catch up; the timeout only bounds a failure."""
    return eventually(pred, timeout=10.0, interval=0.01)


def test_it_is_a_plan_source(watch: PlanWatch) -> None:
    assert isinstance(watch, PlanSource)


def test_pending_plans_answer_the_kubelet(fake: FakeKubeApi, watch: PlanWatch) -> None:
    fake.add_pod(pod("p1", "node-a", plan_text("node-a", {"main": ["GPU-0", "GPU-1"]})))
    fake.add_pod(pod("p2", "node-a", plan_text("node-a", {"a": ["GPU-2", "GPU-3", "GPU-4", "GPU-5"],
                                                        "b": ["GPU-6", "GPU-7"]})))
    fake.add_pod(pod("other-node", "node-b", plan_text("node-b", {"main": ["GPU-0", "GPU-1"]})))
    fake.add_pod(pod("running", "node-a", plan_text("node-a", {"main": ["GPU-0"]}), phase="Running"))
    fake.add_pod(pod("unbound", None, plan_text("node-a", {"main": ["GPU-0"]})))
    wait_pending(fake, watch, 2)

    hits = lookups("hit", "")
    assert watch.pending_plan(IDS, [], 2) == ["GPU-0", "GPU-1"]  # the oldest pod first, as the kubelet admits
    # each container's plan goes out once: p2's next container is "a" (4 GPUs), so no 2-GPU plan is left to give
    assert watch.pending_plan(IDS[2:], [], 2) is None
    assert watch.pending_plan(IDS[2:], ["GPU-3"], 4) == ["GPU-2", "GPU-3", "GPU-4", "GPU-5"]
    assert watch.pending_plan(IDS[6:], [], 2) == ["GPU-6", "GPU-7"]
    assert lookups("hit", "") == hits + 3

    fake.add_pod(pod("p3", "node-a", plan_text("node-a", {"main": ["GPU-0", "GPU-1", "GPU-2", "GPU-3"]})))
    wait_pending(fake, watch, 3)
    before = {r: lookups("miss", r) for r in ("no_plan_of_size", "not_available", "lacks_must_include")}
    assert watch.pending_plan(IDS, [], 3) is None
    assert watch.pending_plan(IDS[1:], [], 4) is None
    assert watch.pending_plan(IDS, ["GPU-5"], 4) is None
    assert {r: lookups("miss", r) - before[r] for r in before} == {
        "no_plan_of_size": 1, "not_available": 1, "lacks_must_include": 1}


def test_plans_leave_when_pods_start_finish_or_go(fake: FakeKubeApi, watch: PlanWatch) -> None:
    fake.add_pod(pod("p1", "node-a", plan_text("node-a", {"main": ["GPU-0"]})))
    fake.add_pod(pod("p2", "node-a", plan_text("node-a", {"main": ["GPU-1"]})))
    fake.add_pod(pod("p3", "node-a", plan_text("node-a", {"main": ["GPU-2"]})))
    wait_pending(fake, watch, 3)
    fake.update_pod("default", "p1", {"status": {"phase": "Running"}})
    fake.delete_pod("default", "p2")
    fake.update_pod("default", "p3", {"metadata": {"deletionTimestamp": "2026-11-30T10:00:00Z"}})
    wait_pending(fake, watch, 0)
    before = lookups("miss", "no_pending_plans")
    assert watch.pending_plan(IDS, [], 1) is None
    assert lookups("miss", "no_pending_plans") == before + 1


def test_garbage_and_foreign_plans_are_ignored_and_counted(fake: FakeKubeApi, watch: PlanWatch) -> None:
    def ignored(reason: str) -> float:
        return METRICS.registry.get_sample_value("gpuplugin_plan_annotations_ignored_total", {"reason": reason}) or 0.0

    base = {r: ignored(r) for r in ("garbage", "other_node", "other_resource")}
    fake.add_pod(pod("g", "node-a", "{not json"))
    fake.add_pod(pod("n", "node-a", plan_text("node-b", {"main": ["GPU-0"]})))
    fake.add_pod(pod("r", "node-a", plan_text("node-a", {"main": ["GPU-0"]}, resource="example.com/fpga")))
    fake.add_pod(pod("ok", "node-a", plan_text("node-a", {"main": ["GPU-5"]})))
    wait_pending(fake, watch, 1)
    assert {r: ignored(r) - base[r] for r in base} == {"garbage": 1, "other_node": 1, "other_resource": 1}
    assert watch.pending_plan(IDS, [], 1) == ["GPU-5"]


def test_relist_after_410_replaces_the_pending_set(fake: FakeKubeApi, watch: PlanWatch) -> None:
    fake.add_pod(pod("p1", "node-a", plan_text("node-a", {"main": ["GPU-0"]})))
    wait_pending(fake, watch, 1)
    fake.expire_history()
    fake.fail_next(1, 410, path_regex=r"watch=true")
    fake.delete_pod("default", "p1")
    fake.add_pod(pod("p2", "node-a", plan_text("node-a", {"main": ["GPU-1"]})))
    fake.drop_watches()
    assert _wait(lambda: [p.name for p in watch.pending()] == ["p2"])


@pytest.mark.parametrize(("text", "needle"), [
    ("nope", "not JSON"), ("[" * 100_000, "not JSON"), ("[]", "object"), ('{"v": 2}', "version"),
    ('{"v": 1, "node": "", "resource": "r", "containers": {"a": ["x"]}}', "node"),
    ('{"v": 1, "node": "n", "resource": "r", "containers": {}}', "containers"),
    ('{"v": 1, "node": "n", "resource": "r", "containers": {"a": ["x", "x"]}}', "twice"),
    ('{"v": 1, "node": "n", "resource": "r", "containers": {"a": ["x"]}, "gbps": -1}', "gbps"),
])
def test_parse_plan_names_the_problem(text: str, needle: str) -> None:
    with pytest.raises(PlanFormatError, match=needle):
        parse_plan(text)


def test_plan_round_trip() -> None:
    plan = Plan("n", "nvidia.com/gpu", (("a", ("GPU-1", "GPU-0")), ("b", ("GPU-2",))), 123.456)
    back = parse_plan(encode_plan(plan))
    assert back.containers == plan.containers and back.gbps == 123.456 and back.ids == {"GPU-0", "GPU-1", "GPU-2"}


def test_a_gpu_pod_that_ends_refreshes_the_node_state_at_once(fake: FakeKubeApi, api) -> None:
    """Issue 14, item 7: the plugin's pod watch calls back when a pod holding the resource ends (deleted, or
    Succeeded/Failed), so the published state frees its GPUs without waiting for the PodResources poll. Quantities
    are read by the shared parser: "1e0" is one GPU here as in the extender."""
    ended: list[float] = []

    fake.add_pod(k8s_pod("before", "2", "node-a"))
    pw = PlanWatch(api, "node-a", backoff_initial_s=0.02, backoff_max_s=0.1, metrics=METRICS,
                   on_device_pod_ended=lambda: ended.append(time.monotonic()))
    with pw:
        assert pw.wait_synced(10)
        fake.add_pod(k8s_pod("g", "1e0", "node-a"))
        fake.add_pod(pod("cpu", "node-a"))
        fake.add_pod(k8s_pod("elsewhere", "1", "node-b"))
        fake.add_pod(k8s_pod("job", "1", "node-a"))
        for name in ("cpu", "elsewhere"):
            fake.delete_pod("default", name)
        wait_pending(fake, pw, 0)
        assert ended == []  # a CPU pod, a pod of another node: nothing to refresh
        fake.delete_pod("default", "g")
        assert _wait(lambda: len(ended) == 1)
        fake.update_pod("default", "job", {"status": {"phase": "Succeeded"}})
        assert _wait(lambda: len(ended) == 2)
        fake.delete_pod("default", "job")  # already ended: not again
        fake.delete_pod("default", "before")  # listed at the start, then deleted
        assert _wait(lambda: len(ended) == 3)
        wait_pending(fake, pw, 0)
    assert len(ended) == 3
