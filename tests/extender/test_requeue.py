"""Refused pods are touched (one annotation) when a hold of ours ends by time alone, so kube-scheduler retries
them at once (extender.requeue; the real kube-scheduler's side is tests/integration/test_autoscaling_real.py).
Against the fake apiserver over real HTTP: only pods refused since the last end are touched, a bound pod is not,
a pod gone is dropped, a touch the apiserver failed is tried again, and the set stays bounded."""

from __future__ import annotations

import kubernetes.client
from prometheus_client import CollectorRegistry, Counter

from extender.requeue import Requeue
from gputopo.contract import DEFAULT_KEYS
from tests.fakes.kubeapi import FakeKubeApi
from tests.helpers.kube import k8s_pod
from tests.helpers.polling import eventually

KEY = DEFAULT_KEYS.requeued


def _counter() -> Counter:
    return Counter("requeued", "test", ["outcome"], registry=CollectorRegistry())


def _annotations(fake: FakeKubeApi, name: str) -> dict[str, str]:
    pod = fake.pod("default", name)
    assert pod is not None
    return pod["metadata"].get("annotations") or {}


def test_refused_pods_are_touched_once_a_hold_ends(fake: FakeKubeApi, api: kubernetes.client.ApiClient) -> None:
    for name in ("a", "b", "c"):
        fake.add_pod(k8s_pod(name, 4))
    counter = _counter()
    with Requeue(api, DEFAULT_KEYS, counter, clock=lambda: 1_800_000_000.0) as requeue:
        requeue.ended("timeout")  # nothing refused yet: nothing to do
        requeue.refused("uid-a", "default", "a")
        requeue.refused("uid-b", "default", "b")
        requeue.refused("uid-gone", "default", "gone")
        requeue.placed("uid-b")  # bound since: not touched
        requeue.ended("timeout")
        assert eventually(lambda: KEY in _annotations(fake, "a"), 10)
        assert _annotations(fake, "a")[KEY] == "2027-01-15T08:00:00Z"
        assert eventually(lambda: counter.labels("gone")._value.get() == 1, 10)
        assert KEY not in _annotations(fake, "b") and KEY not in _annotations(fake, "c")
        assert eventually(lambda: counter.labels("touched")._value.get() == 1, 10)
        assert requeue.waiting == 0


def test_a_failed_touch_is_tried_again(fake: FakeKubeApi, api: kubernetes.client.ApiClient) -> None:
    fake.add_pod(k8s_pod("a", 4))
    counter = _counter()
    fake.fail_next(1, 500, method="PATCH")
    with Requeue(api, DEFAULT_KEYS, counter) as requeue:
        requeue.refused("uid-a", "default", "a")
        requeue.ended("timeout")
        assert eventually(lambda: KEY in _annotations(fake, "a"), 20)
        # the counter moves once the patch has returned, a moment after the apiserver stored it
        assert eventually(lambda: counter.labels("touched")._value.get() == 1, 10)
        assert counter.labels("failed")._value.get() == 1


def test_the_refused_set_is_bounded(api: kubernetes.client.ApiClient) -> None:
    requeue = Requeue(api, DEFAULT_KEYS, _counter(), limit=3)
    for i in range(10):
        requeue.refused(f"uid-{i}", "default", f"p{i}")
    requeue.refused("", "default", "no-uid")
    assert requeue.waiting == 3



def test_a_pod_refused_before_a_node_published_its_gpus_is_touched_when_it_does(
        fake: FakeKubeApi, api: kubernetes.client.ApiClient) -> None:
    """kube-scheduler may retry a pod on the Node event of a new node before the extender's watch has its GPUs:
    refused then ("publishes no GPU topology"), it would wait for kube-scheduler's 5-minute flush."""
    from extender.config import ExtenderConfig
    from extender.service import Extender
    from extender.verbs import Verbs
    from gputopo.discovery.loader import load_topology_file
    from tests.extender.conftest import A100
    from tests.helpers.kube import k8s_node
    from tests.helpers.scheduler import cache_args

    fake.add_node(k8s_node("fresh", None))  # registered, its plugin not published yet
    pod = fake.add_pod(k8s_pod("waiting", 4))
    ext = Extender.cluster(api, ExtenderConfig())
    ext.start()
    try:
        assert ext.sync is not None and ext.sync.wait_synced(10)
        out = Verbs(ext, plan_in_thread=False).filter(cache_args(pod, ["fresh"]))
        assert out["NodeNames"] == [] and "fresh" in out["FailedAndUnresolvableNodes"]
        published = k8s_node("fresh", load_topology_file(A100))
        fake.update_node("fresh", lambda n: {**n, "metadata": {**n["metadata"],
                                                              "annotations": published["metadata"]["annotations"]}})
        assert eventually(lambda: KEY in _annotations(fake, "waiting"), 10), "the refused pod was never touched"
    finally:
        ext.stop()
