"""Victims of a preemption stop holding GPUs the moment they are gone, in FakeKubeApi's cluster mode.

kube-scheduler deletes the victims and retries the preemptor at once; a node the extender still refuses then gets it
to preempt a second node (tests/integration/test_preemption_real.py shows it with the real components). Here, each
way the extender's view could lag: the node's published state (the plugin republishes a moment after the kubelet
lets go), and the pod watch itself (kube-scheduler's informer may see the deletion first). A pod being deleted that
still runs keeps its GPUs throughout, and no GPU is planned twice.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import kubernetes.client

from extender.config import ExtenderConfig
from extender.service import Extender
from gputopo.contract import parse_plan
from tests.extender.conftest import A100, running, topo
from tests.fakes.kubeapi import FakeKubeApi
from tests.helpers.kube import PREFIX, k8s_node, k8s_pod, set_state
from tests.helpers.scheduler import bind_body, cache_args

PLAN = f"{PREFIX}/plan"
SYNC_OPTIONS = {"watch_timeout_s": 60, "backoff_initial_s": 0.02, "backoff_max_s": 0.1}
WAIT = 10.0


@contextmanager
def cluster(api: kubernetes.client.ApiClient) -> Iterator[tuple[Extender, httpx.Client]]:
    ext = Extender.cluster(api, ExtenderConfig(), sync_options=SYNC_OPTIONS)
    with running(ext) as client:
        assert ext.sync is not None and ext.sync.wait_synced(10)
        yield ext, client


def _filter(client: httpx.Client, pod: dict[str, Any], node: str = "n1") -> str | None:
    """None when the node passes, else the reason it is refused."""
    out = client.post("/filter", json=cache_args(pod, [node])).json()
    if node in (out["NodeNames"] or []):
        return None
    return str({**out["FailedNodes"], **out["FailedAndUnresolvableNodes"]}[node])


def _nominated(pod: dict[str, Any], node: str = "n1") -> dict[str, Any]:
    """The pod as kube-scheduler sends it after preempting victims on `node` for it."""
    return {**pod, "status": {**pod.get("status", {}), "nominatedNodeName": node}}


def _victims(fake: FakeKubeApi, ext: Extender, client: httpx.Client) -> list[set[str]]:
    """Two 4-GPU pods bound to n1 through the extender; the GPU ids of their plans."""
    plans = []
    for name in ("v1", "v2"):
        pod = fake.add_pod(k8s_pod(name, 4))
        assert client.post("/bind", json=bind_body(pod, "n1")).json() == {"Error": ""}
        plans.append(set(parse_plan(fake.pod("default", name)["metadata"]["annotations"][PLAN]).ids))
    assert ext.cache.wait_for(lambda: {r.name for r in ext.cache.pods.values()} >= {"v1", "v2"}, WAIT)
    return plans


def _deleting(fake: FakeKubeApi, name: str) -> None:
    """What kube-scheduler's DELETE does to a running pod: a deletionTimestamp; the kubelet ends it later."""
    fake.update_pod("default", name, {"metadata": {"deletionTimestamp": "2026-01-01T00:00:00Z",
                                                   "deletionGracePeriodSeconds": 30}})


def test_gone_victims_free_their_gpus_before_the_plugin_republishes(fake: FakeKubeApi, api) -> None:
    fake.add_node(k8s_node("n1", topo(A100)))
    with cluster(api) as (ext, client):
        v1, v2 = _victims(fake, ext, client)
        set_state(fake, "n1", sorted(v1 | v2), generation=2)  # the kubelet admitted both: reservations settle
        assert ext.cache.wait_for(lambda: ext.reservations.count() == 0, WAIT)
        big = _nominated(fake.add_pod(k8s_pod("big", 8)))
        assert "in use" in (_filter(client, big) or "")

        _deleting(fake, "v1")  # still running: its GPUs stay
        assert ext.cache.wait_for(lambda: any(r.deleting for r in ext.cache.pods.values()), WAIT)
        assert "in use" in (_filter(client, big) or "")

        fake.delete_pod("default", "v1")  # ended: its GPUs are free though the state still lists them
        fake.delete_pod("default", "v2")
        assert ext.cache.wait_for(lambda: not ext.cache.pods.keys() - {big["metadata"]["uid"]}, WAIT)
        assert _filter(client, big) is None

        assert client.post("/bind", json=bind_body(big, "n1")).json() == {"Error": ""}
        planned = set(parse_plan(fake.pod("default", "big")["metadata"]["annotations"][PLAN]).ids)
        assert planned == v1 | v2
        one = fake.add_pod(k8s_pod("one", 1))
        assert "reserved" in (_filter(client, one) or "")
        # the state still lists the victims' GPUs: big's reservation must not settle on it, whatever else changes
        version = ext.cache.version
        fake.update_node("n1", {"metadata": {"labels": {"touched": "yes"}}})
        assert ext.cache.wait_for(lambda: ext.cache.version > version, WAIT)
        assert ext.reservations.count() == 1 and "reserved" in (_filter(client, one) or "")
        set_state(fake, "n1", [], generation=3)  # the plugin saw the victims go; big not admitted yet
        assert ext.cache.wait_for(lambda: ext.cache.nodes["n1"].generation == 3, WAIT)
        assert ext.reservations.count() == 1 and "reserved" in (_filter(client, one) or "")
        set_state(fake, "n1", sorted(planned), generation=4)  # big admitted: its reservation settles
        assert ext.cache.wait_for(lambda: ext.reservations.count() == 0, WAIT)
        assert "in use" in (_filter(client, one) or "")


def test_freed_gpus_end_when_the_state_shows_them_free_or_after_the_timeout(fake: FakeKubeApi, api) -> None:
    fake.add_node(k8s_node("n1", topo(A100)))
    with cluster(api) as (ext, client):
        v1, v2 = _victims(fake, ext, client)
        set_state(fake, "n1", sorted(v1 | v2), generation=2)
        assert ext.cache.wait_for(lambda: ext.reservations.count() == 0, WAIT)
        fake.delete_pod("default", "v1")
        assert ext.cache.wait_for(lambda: ext.cache.nodes["n1"].used_ids == v2, WAIT)
        # the plugin republishes v1's GPUs free, and later someone it cannot name takes them: used again
        set_state(fake, "n1", sorted(v2), generation=3)
        assert ext.cache.wait_for(lambda: ext.cache.nodes["n1"].generation == 3, WAIT)
        set_state(fake, "n1", sorted(v1 | v2), generation=4)
        assert ext.cache.wait_for(lambda: ext.cache.nodes["n1"].used_ids == v1 | v2, WAIT)
        # a gone pod's GPUs still published used long after: someone else's
        fake.delete_pod("default", "v2")
        assert ext.cache.wait_for(lambda: ext.cache.nodes["n1"].used_ids == v1, WAIT)
        ext.cache.reservations.clock = lambda: 1e12
        ext.cache.expire_reservations()
        assert ext.cache.nodes["n1"].used_ids == v1 | v2


def test_a_preemptor_back_at_its_node_is_not_refused_on_a_lagging_watch(fake: FakeKubeApi, api) -> None:
    """kube-scheduler's informer saw the victims go; the extender's pod watch has not delivered it yet."""
    fake.add_node(k8s_node("n1", topo(A100)))
    with cluster(api) as (ext, client):
        _victims(fake, ext, client)  # no plugin: bound reservations hold the GPUs until the pods go
        big = fake.add_pod(k8s_pod("big", 8))
        assert ext.sync is not None
        ext.sync.pods.stop()  # the watch lags from here on
        _deleting(fake, "v2")
        fake.delete_pod("default", "v1")
        before = len(fake.requests)
        assert "reserved" in (_filter(client, big) or "")  # not nominated: no reason to doubt the cache
        assert not [r for r in fake.requests[before:] if r.path.endswith("/pods")]

        # nominated: the node's pods are read again; v1 is gone, v2 is being deleted but still runs
        reason = _filter(client, _nominated(big))
        assert reason is not None and "needs 8 GPUs, 4 free" in reason, reason
        lists = [r for r in fake.requests[before:] if r.path.endswith("/pods") and r.method == "GET"]
        assert len(lists) == 1 and lists[0].query.get("fieldSelector") == "spec.nodeName=n1", lists
        late = fake.pod("default", "v2")
        fake.delete_pod("default", "v2")
        assert _filter(client, _nominated(big)) is None
        assert late["metadata"]["uid"] not in ext.cache.pods
        assert ext.cache.update_pod(late) is None  # a late event of a pod known gone does not bring it back
        assert _filter(client, _nominated(big)) is None
        assert client.post("/bind", json=bind_body(big, "n1")).json() == {"Error": ""}
        assert len(parse_plan(fake.pod("default", "big")["metadata"]["annotations"][PLAN]).ids) == 8
