"""Cluster mode against FakeKubeApi: the cache follows list/watch, bind POSTs Bindings, reservations hold and end."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

import httpx
import kubernetes.client

from extender.config import ExtenderConfig
from extender.service import Extender
from gputopo.contract import parse_plan
from tests.extender.conftest import A100, DGX1, PCIE, running, topo
from tests.fakes.kubeapi import FakeKubeApi
from tests.helpers.clients import thread_clients
from tests.helpers.kube import PREFIX, k8s_node, k8s_pod, node_annotations, set_state
from tests.helpers.scheduler import bind_body, cache_args

PLAN = f"{PREFIX}/plan"
SYNC_OPTIONS = {"watch_timeout_s": 60, "backoff_initial_s": 0.02, "backoff_max_s": 0.1}


@contextmanager
def cluster(api: kubernetes.client.ApiClient, **config: Any) -> Iterator[tuple[Extender, httpx.Client]]:
    ext = Extender.cluster(api, ExtenderConfig(**config), sync_options=SYNC_OPTIONS)
    with running(ext) as client:
        assert ext.sync is not None and ext.sync.wait_synced(10)
        assert client.get("/readyz").status_code == 200
        yield ext, client


def filter_names(client: httpx.Client, pod: dict[str, Any], names: list[str]) -> dict[str, Any]:
    r = client.post("/filter", json=cache_args(pod, names))
    assert r.status_code == 200
    return r.json()


def test_cache_follows_nodes_and_ignores_garbage(fake: FakeKubeApi, api) -> None:
    a = topo(A100)
    fake.add_node(k8s_node("n1", a, used=[0, 1]))
    fake.add_node(k8s_node("garbage", a, annotations={f"{PREFIX}/topology": '{"v": 1, "gpus": "lots"}'}))
    fake.add_node(k8s_node("bad-state", a, annotations={f"{PREFIX}/state": "not json"}))
    fake.add_node(k8s_node("deep", a, annotations={f"{PREFIX}/topology": "[" * 100_000}))
    fake.add_node({"metadata": {"name": "cpu-only"}})
    four = k8s_node("allocatable-4", a)
    four["status"]["allocatable"]["nvidia.com/gpu"] = "4"  # the kubelet offers fewer than the topology has
    fake.add_node(four)
    pod = fake.add_pod(k8s_pod("p", 7))
    with cluster(api) as (ext, client):
        out = filter_names(client, pod, ["n1", "garbage", "bad-state", "cpu-only", "allocatable-4", "deep"])
        assert out["FailedNodes"] == {"n1": "needs 7 GPUs, 6 free: GPU 0,1 in use"}
        unres = out["FailedAndUnresolvableNodes"]
        assert unres["allocatable-4"] == "needs 7 GPUs, node has 4 in total"
        assert "unreadable" in unres["deep"]
        assert "topology annotation gpu-topology.io/topology is unreadable" in unres["garbage"]
        assert "state annotation gpu-topology.io/state is unreadable" in unres["bad-state"]
        assert "publishes no GPU topology" in unres["cpu-only"]

        set_state(fake, "n1", ["GPU0"])
        assert ext.cache.wait_for(lambda: ext.cache.nodes["n1"].used_ids == {"GPU0"}, 10)
        assert filter_names(client, pod, ["n1"])["NodeNames"] == ["n1"]

        fake.update_node("garbage", {"metadata": {"annotations": node_annotations(a)}})
        fake.delete_node("n1")
        assert ext.cache.wait_for(lambda: "n1" not in ext.cache.nodes and ext.cache.nodes["garbage"].topo, 10)
        out = filter_names(client, pod, ["n1", "garbage"])
        assert out["NodeNames"] == ["garbage"] and "unknown" in out["FailedAndUnresolvableNodes"]["n1"]


def test_bind_posts_the_binding_with_the_plan_and_reserves_until_the_state_shows_it(fake: FakeKubeApi, api) -> None:
    a = topo(A100)
    fake.add_node(k8s_node("n1", a))
    p1, p2 = fake.add_pod(k8s_pod("p1", 4)), fake.add_pod(k8s_pod("p2", 6))
    with cluster(api) as (ext, client):
        assert client.post("/bind", json=bind_body(p1, "n1")).json() == {"Error": ""}
        bound = fake.pod("default", "p1")
        assert bound["spec"]["nodeName"] == "n1"
        plan = parse_plan(bound["metadata"]["annotations"][PLAN])
        assert plan.node == "n1" and plan.resource == "nvidia.com/gpu" and len(plan.ids) == 4
        assert bound["metadata"]["annotations"][f"{PREFIX}/allreduce-gbps"] == f"{plan.gbps:.1f}"
        posts = [r for r in fake.requests if r.method == "POST"]
        assert [r.path for r in posts] == ["/api/v1/namespaces/default/pods/p1/binding"]

        # the node's state still shows nothing used: the reservation keeps the plan's GPUs away from p2
        reason = filter_names(client, p2, ["n1"])["FailedNodes"]["n1"]
        assert reason.startswith("needs 6 GPUs, 4 free:") and "reserved for pods being bound" in reason
        set_state(fake, "n1", sorted(plan.ids))
        assert ext.cache.wait_for(lambda: ext.reservations.count() == 0, 10)
        reason = filter_names(client, p2, ["n1"])["FailedNodes"]["n1"]
        assert "in use" in reason and "reserved" not in reason
        text = client.get("/metrics").text
    assert 'gpu_extender_reservations_ended_total{why="settled"} 1.0' in text
    assert 'gpu_extender_bind_total{outcome="bound"} 1.0' in text
    assert 'gpu_extender_kube_watch_events_total{kind="nodes",type="MODIFIED"}' in text  # its watches, its prefix
    names = {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line and not line.startswith("#")}
    assert all(n.startswith("gpu_extender_") for n in names), sorted(names)  # nothing of the plugin's


def test_api_errors_release_the_reservation(fake: FakeKubeApi, api) -> None:
    a = topo(A100)
    fake.add_node(k8s_node("n1", a))
    pods = [fake.add_pod(k8s_pod(f"p{i}", 8)) for i in range(3)]
    with cluster(api) as (ext, client):
        for status, pod, needle in ((409, pods[0], "conflicted"), (404, pods[1], "not found"),
                                    (500, pods[2], "failed")):
            fake.fail_next(1, status, path_regex="/binding")
            error = client.post("/bind", json=bind_body(pod, "n1")).json()["Error"]
            assert needle in error, error
            assert ext.reservations.count() == 0
            assert filter_names(client, pod, ["n1"])["NodeNames"] == ["n1"]  # all 8 GPUs free again
        assert client.post("/bind", json=bind_body(pods[0], "n1")).json() == {"Error": ""}
        text = client.get("/metrics").text
    for outcome in ("conflict", "not_found", "api_error"):
        assert f'gpu_extender_bind_total{{outcome="{outcome}"}} 1.0' in text


def test_a_retried_bind_of_a_bound_pod_answers_consistently(fake: FakeKubeApi, api) -> None:
    a = topo(A100)
    fake.add_node(k8s_node("n1", a))
    fake.add_node(k8s_node("n2", a))
    p1, p2, p3 = (fake.add_pod(k8s_pod(f"p{i}", 2)) for i in (1, 2, 3))
    with cluster(api) as (ext, client):
        assert client.post("/bind", json=bind_body(p1, "n1")).json() == {"Error": ""}
        plan = fake.pod("default", "p1")["metadata"]["annotations"][PLAN]
        assert client.post("/bind", json=bind_body(p1, "n1")).json() == {"Error": ""}
        assert fake.pod("default", "p1")["metadata"]["annotations"][PLAN] == plan

        # a stale cache (watch cut and failing) meets pods that were bound meanwhile: the 409 is resolved by
        # reading the pod back
        fake.fail_next(10_000, 500, path_regex=r"/pods\?.*watch=true")
        fake.drop_watches()
        earlier = json.dumps({"v": 1, "node": "n1", "resource": "nvidia.com/gpu",
                              "containers": {"main": ["GPU6", "GPU7"]}, "gbps": 240.0})
        fake.update_pod("default", "p2", {"spec": {"nodeName": "n1"}, "metadata": {"annotations": {PLAN: earlier}}})
        fake.update_pod("default", "p3", {"spec": {"nodeName": "n2"}})
        assert client.post("/bind", json=bind_body(p2, "n1")).json() == {"Error": ""}
        # its actual plan is reserved, not the one this attempt chose
        assert {r.uid: r.ids for r in ext.reservations.on_node("n1")}[p2["metadata"]["uid"]] == {"GPU6", "GPU7"}
        error = client.post("/bind", json=bind_body(p3, "n1")).json()["Error"]
        assert "conflicted" in error and "it is bound to n2" in error
        assert {r.uid for r in ext.reservations.all()} == {p1["metadata"]["uid"], p2["metadata"]["uid"]}


def test_pods_that_go_away_release_their_gpus(fake: FakeKubeApi, api) -> None:
    a = topo(A100)
    fake.add_node(k8s_node("n1", a))
    p1, p2 = fake.add_pod(k8s_pod("p1", 2)), fake.add_pod(k8s_pod("p2", 2))
    with cluster(api, reservation_timeout_s=600) as (ext, client):
        for p in (p1, p2):
            assert client.post("/bind", json=bind_body(p, "n1")).json() == {"Error": ""}
        assert ext.reservations.count() == 2
        fake.delete_pod("default", "p1")
        fake.update_pod("default", "p2", {"status": {"phase": "Failed"}})
        assert ext.cache.wait_for(lambda: ext.reservations.count() == 0, 10)


def test_a_bound_pods_plan_outlives_the_reservation_timeout(fake: FakeKubeApi, api) -> None:
    """Issue 14, item 5: the kubelet is slow or down longer than --reservation-timeout. The bound pod's planned
    GPUs stay out of the free set until the node's state shows them used (or the pod ends); only the reservation
    of a pod that was never bound times out."""
    a = topo(A100)
    fake.add_node(k8s_node("n1", a))
    bound, lost, late = (fake.add_pod(k8s_pod(name, n)) for name, n in (("bound", 4), ("lost", 4), ("late", 5)))
    now = [0.0]
    ext = Extender.cluster(api, ExtenderConfig(reservation_timeout_s=1.0), sync_options=SYNC_OPTIONS,
                           clock=lambda: now[0], expiry_interval_s=3600)
    with running(ext) as client:
        assert ext.sync is not None and ext.sync.wait_synced(10)
        assert client.post("/bind", json=bind_body(bound, "n1")).json() == {"Error": ""}
        fake.fail_next(1, 504, path_regex="/pods/lost/binding")  # the apiserver never applies this one
        assert "stay reserved" in client.post("/bind", json=bind_body(lost, "n1")).json()["Error"]
        assert ext.reservations.count() == 2
        now[0] += 3600  # an hour later: the node's state still shows nothing used
        assert [r.name for r in ext.cache.expire_reservations()] == ["lost"]
        plan = parse_plan(fake.pod("default", "bound")["metadata"]["annotations"][PLAN])
        reason = filter_names(client, late, ["n1"])["FailedNodes"]["n1"]
        assert reason.startswith("needs 5 GPUs, 4 free:") and "reserved for pods being bound" in reason
        # the same after an extender restart would rebuild it from the pod: touch the pod, nothing changes
        fake.update_pod("default", "bound", {"metadata": {"labels": {"touched": "yes"}}})
        assert ext.cache.wait_for(lambda: "touched" in str(fake.pod("default", "bound")), 10)
        assert {r.name for r in ext.reservations.all()} == {"bound"}
        set_state(fake, "n1", sorted(plan.ids))  # the kubelet is back: the state accounts for the GPUs
        assert ext.cache.wait_for(lambda: ext.reservations.count() == 0, 10)
        assert 'gpu_extender_reservations_ended_total{why="timeout"} 1.0' in client.get("/metrics").text
        assert 'gpu_extender_reservations_ended_total{why="settled"} 1.0' in client.get("/metrics").text


def test_a_plan_seen_bound_after_its_reservation_timed_out_is_reserved_again(fake: FakeKubeApi, api) -> None:
    a = topo(A100)
    fake.add_node(k8s_node("n1", a))
    slow = fake.add_pod(k8s_pod("slow", 8))
    now = [0.0]
    ext = Extender.cluster(api, ExtenderConfig(reservation_timeout_s=1.0), sync_options=SYNC_OPTIONS,
                           clock=lambda: now[0], expiry_interval_s=3600)
    with running(ext) as client:
        assert ext.sync is not None and ext.sync.wait_synced(10)
        fake.fail_next(1, 504, path_regex="/pods/slow/binding")
        assert "stay reserved" in client.post("/bind", json=bind_body(slow, "n1")).json()["Error"]
        now[0] += 3600
        assert len(ext.cache.expire_reservations()) == 1
        plan = json.dumps({"v": 1, "node": "n1", "resource": "nvidia.com/gpu",
                           "containers": {"main": [g.id for g in a.gpus]}, "gbps": 240.0})
        fake.update_pod("default", "slow", {"spec": {"nodeName": "n1"}, "metadata": {"annotations": {PLAN: plan}}})
        assert ext.cache.wait_for(lambda: ext.reservations.count() == 1, 10)  # applied late after all


def test_relist_after_410_catches_up(fake: FakeKubeApi, api) -> None:
    a = topo(A100)
    fake.add_node(k8s_node("n1", a))
    pod = fake.add_pod(k8s_pod("p", 8))
    with cluster(api) as (ext, client):
        fake.expire_history()
        fake.fail_next(1, 410, path_regex=r"/nodes\?.*watch=true")
        fake.add_node(k8s_node("n2", a))
        fake.update_node("n1", {"spec": {"unschedulable": True}})
        fake.drop_watches()
        assert ext.cache.wait_for(lambda: "n2" in ext.cache.nodes and ext.cache.nodes["n1"].unschedulable, 10)
        out = filter_names(client, pod, ["n1", "n2"])
        assert ext.sync is not None and ext.sync.nodes.stats.relists >= 1
    assert out["NodeNames"] == ["n2"] and "cordoned" in out["FailedAndUnresolvableNodes"]["n1"]


def _plans_on(fake: FakeKubeApi) -> list[tuple[str, str, frozenset[str]]]:
    out = []
    for p in fake.pods():
        text = (p["metadata"].get("annotations") or {}).get(PLAN)
        if text:
            plan = parse_plan(text)
            assert plan.node == p["spec"]["nodeName"]
            out.append((p["metadata"]["uid"], plan.node, plan.ids))
    return out


def test_restart_rebuilds_reservations_from_plan_annotations(fake: FakeKubeApi, api) -> None:
    d = topo(DGX1)
    fake.add_node(k8s_node("n1", d, used=[0]))
    pods = [fake.add_pod(k8s_pod(f"p{i}", 2 if i < 3 else 1)) for i in range(4)]  # 7 free: 2+2+2+1
    with cluster(api) as (ext, client):
        for p in pods[:3]:
            assert client.post("/bind", json=bind_body(p, "n1")).json() == {"Error": ""}
    held = {uid: ids for uid, _, ids in _plans_on(fake)}
    # the plugin published p0's GPUs as used; p1 and p2 are still in flight when the extender comes back
    set_state(fake, "n1", sorted({"GPU0"} | held[pods[0]["metadata"]["uid"]]))
    with cluster(api) as (ext, client):
        assert {r.uid: r.ids for r in ext.reservations.all()} == {
            p["metadata"]["uid"]: held[p["metadata"]["uid"]] for p in pods[1:3]}
        assert client.post("/bind", json=bind_body(pods[3], "n1")).json() == {"Error": ""}
        out = filter_names(client, k8s_pod("x", 1) | {"metadata": {"uid": "x", "name": "x"}}, ["n1"])
    taken = Counter(g for _, _, ids in _plans_on(fake) for g in ids)
    assert max(taken.values()) == 1 and "GPU0" not in taken
    assert out["FailedNodes"]["n1"].startswith("needs 1 GPU, 0 free")


def test_1000_concurrent_binds_on_100_nodes_with_a_restart_never_share_a_gpu(fake: FakeKubeApi, api) -> None:
    a, d = topo(A100), topo(DGX1)
    names = [f"n{i}" for i in range(100)]
    for i, name in enumerate(names):
        fake.add_node(k8s_node(name, a if i % 2 else d))
    sizes = [1, 1, 2, 4]
    pods = [fake.add_pod(k8s_pod(f"p{i}", sizes[i % 4])) for i in range(1000)]

    def bind_all(client: httpx.Client, batch: list[dict[str, Any]]) -> list[str]:
        with thread_clients(client.base_url) as mine, ThreadPoolExecutor(32) as pool:
            return list(pool.map(lambda k: mine().post("/bind", json=bind_body(batch[k], names[k % 100])).json()[
                "Error"], range(len(batch))))

    with cluster(api) as (_, client):
        first = bind_all(client, pods[:500])
    with cluster(api) as (ext, client):  # restart with plans in flight: nothing shows them used
        assert ext.reservations.count() == sum(1 for e in first if e == "")
        second = bind_all(client, pods[500:])
    errors = first + second
    plans = _plans_on(fake)
    assert len(plans) == errors.count("") > 500
    assert all("cannot take pod" in e for e in errors if e), [e for e in errors if e][:3]
    taken = Counter((node, g) for _, node, ids in plans for g in ids)
    assert max(taken.values()) == 1  # zero GPUs assigned twice


def test_preempt_meta_victims_compare_costs_with_the_cached_priorities(fake: FakeKubeApi, api) -> None:
    """Issue 14, item 6 in nodeCacheCapable mode: victims come as UIDs; their priorities come from the pod cache."""
    fake.add_node(k8s_node("pcie", topo(PCIE)))
    fake.add_node(k8s_node("nvswitch", topo(A100)))
    victims: dict[str, list[str]] = {"pcie": [], "nvswitch": []}
    with cluster(api) as (ext, client):
        for node in victims:
            for i in range(2):
                pod = k8s_pod(f"{node}-{i}", 4)
                pod["spec"]["priority"] = 100
                pod = fake.add_pod(pod)
                assert client.post("/bind", json=bind_body(pod, node)).json() == {"Error": ""}
                victims[node].append(pod["metadata"]["uid"])
        assert ext.cache.wait_for(lambda: all(r.plan is not None for r in ext.cache.pods.values()), 10)
        urgent = fake.add_pod(k8s_pod("urgent", 8))
        body = {"Pod": urgent, "NodeNameToVictims": None, "NodeNameToMetaVictims": {
            node: {"Pods": [{"UID": u} for u in uids], "NumPDBViolations": 0} for node, uids in victims.items()}}
        kept = client.post("/preempt", json=body).json()["NodeNameToMetaVictims"]
    assert list(kept) == ["nvswitch"]
