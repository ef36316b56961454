"""A job plan's slots from reservation to release, through the verbs against the in-process kube-apiserver: later
pods take their slots, single pods never get them, and slots end on timeout, job deletion, a member bound outside
the plan and a planned node's deletion (the rest planned again with the pods already placed)."""

from __future__ import annotations

from typing import Any

import httpx

from gputopo.contract import parse_plan
from sim.scheduler import gpu_pod
from tests.extender.jobs.conftest import (
    DGX_A100,
    PREFIX,
    WAIT,
    cluster,
    job_slots,
    k8s_node,
    kubeflow_pod,
    pod_group,
    rated,
)
from tests.fakes.kubeapi.groups import FakeGroupsKubeApi
from tests.helpers.scheduler import bind_body, cache_args

NAMES = ["n1", "n2", "n3"]


def filter_(client: httpx.Client, pod: dict[str, Any], names: list[str] = NAMES) -> dict[str, Any]:
    r = client.post("/filter", json=cache_args(pod, names))
    assert r.status_code == 200
    return r.json()


def bind(client: httpx.Client, pod: dict[str, Any], node: str) -> str:
    return client.post("/bind", json=bind_body(pod, node)).json()["Error"]


def setup(fake: FakeGroupsKubeApi, workers: int, gpus: int, *, group: bool = True,
          job: str = "train-7") -> list[dict[str, Any]]:
    """Nodes of one rack and the job's pods, labelled with their PodGroup; the PodGroup itself when `group`."""
    t = rated(DGX_A100, 100.0)
    for name in NAMES:
        fake.add_node(k8s_node(name, t, rack="r1"))
    if group:
        fake.add_group(pod_group(job, workers))
    return [fake.add_pod(kubeflow_pod(job, i, gpus)) for i in range(workers)]


def test_later_pods_take_their_slots_and_single_pods_never_do(groups_fake: FakeGroupsKubeApi, groups_api) -> None:
    pods = setup(groups_fake, 4, 2)
    single = groups_fake.add_pod(gpu_pod("single", 2))
    with cluster(groups_api) as (ext, client):
        assert ext.cache.wait_for(lambda: ext.cache.groups.sizes, WAIT)
        out = filter_(client, pods[0])
        assert len(out["NodeNames"]) == 1
        home = out["NodeNames"][0]
        assert job_slots(ext) == {home: 8}  # the whole job reserved at its first pod: 4 slots of 2 GPUs
        reason = out["FailedNodes"][next(n for n in NAMES if n != home)]
        assert reason == (f"job ml/train-7: not in its plan (0/4 workers placed, 4 planned on node {home}; "
                          "est. 25.8 GB/s)")
        scores = client.post("/prioritize", json=cache_args(pods[0], NAMES)).json()
        assert {h["Host"]: h["Score"] for h in scores} == {n: 10 if n == home else 0 for n in NAMES}

        # a single pod sees the slots as taken, and a bind of it there finds no GPUs
        assert home not in filter_(client, single)["NodeNames"]
        assert "cannot take pod" in bind(client, single, home)

        for pod in pods:
            assert filter_(client, pod)["NodeNames"] == [home]
            assert bind(client, pod, home) == ""
        plans = [parse_plan(groups_fake.pod("ml", p["metadata"]["name"])["metadata"]["annotations"][f"{PREFIX}/plan"])
                 for p in pods]
        assert {p.node for p in plans} == {home}
        assert len(set().union(*(p.ids for p in plans))) == 8  # the 4 slots, each taken once
        assert job_slots(ext) == {} and ext.jobs.open_slots() == 0
        assert bind(client, single, home) != ""  # still nothing for it there: the job's pods hold the node
        assert bind(client, single, next(n for n in NAMES if n != home)) == ""
        text = client.get("/metrics").text
    assert 'gpu_extender_job_plans_total{outcome="planned"} 1.0' in text
    assert 'gpu_extender_reservations_ended_total{why="claimed"} 4.0' in text


def test_slots_end_on_timeout_and_the_job_is_planned_again(groups_fake: FakeGroupsKubeApi, groups_api) -> None:
    pods = setup(groups_fake, 2, 4)
    now = [0.0]
    with cluster(groups_api, clock=lambda: now[0], reservation_timeout_s=30) as (ext, client):
        assert ext.cache.wait_for(lambda: ext.cache.groups.sizes, WAIT)
        home = filter_(client, pods[0])["NodeNames"][0]
        assert job_slots(ext) == {home: 8}
        now[0] += 31
        assert len(ext.cache.expire_reservations()) == 2  # nothing reserved forever
        assert job_slots(ext) == {}
        assert bind(client, pods[0], home) == ""  # its slot is gone: placed on its own merits, still one node
        out = filter_(client, pods[1])  # the rest planned again, next to the pod placed
        assert out["NodeNames"] == [home]
        assert bind(client, pods[1], home) == ""
        text = client.get("/metrics").text
    assert 'gpu_extender_reservations_ended_total{why="timeout"} 2.0' in text


def test_deleting_the_job_releases_its_slots(groups_fake: FakeGroupsKubeApi, groups_api) -> None:
    pods = setup(groups_fake, 4, 2)
    with cluster(groups_api) as (ext, client):
        assert ext.cache.wait_for(lambda: ext.cache.groups.sizes and len(ext.cache.pods) == 4, WAIT)
        filter_(client, pods[0])
        assert sum(job_slots(ext).values()) == 8
        for p in pods:
            groups_fake.delete_pod("ml", p["metadata"]["name"])
        assert ext.cache.wait_for(lambda: not job_slots(ext), WAIT)
        assert ext.jobs.state("ml/coscheduling/train-7") is None


def test_a_member_bound_outside_the_plan_replans_the_rest_around_it(groups_fake: FakeGroupsKubeApi,
                                                                      groups_api) -> None:
    pods = setup(groups_fake, 2, 4)
    with cluster(groups_api) as (ext, client):
        assert ext.cache.wait_for(lambda: ext.cache.groups.sizes, WAIT)
        home = filter_(client, pods[0])["NodeNames"][0]
        elsewhere = next(n for n in NAMES if n != home)
        # the scheduler (another profile, a retry after a stale filter) binds the first pod elsewhere
        assert bind(client, pods[0], elsewhere) == ""
        assert job_slots(ext) == {}  # the plan's slots released; the pod's own reservation stands
        assert [r.node for r in ext.reservations.all()] == [elsewhere]
        out = filter_(client, pods[1])
        assert out["NodeNames"] == [elsewhere]  # planned again with the pod placed: one node is fastest
        assert "(1/2 workers placed, 1 planned on node " in out["FailedNodes"][home]


def test_a_deleted_planned_node_releases_its_slots_and_the_job_goes_elsewhere(groups_fake: FakeGroupsKubeApi,
                                                                               groups_api) -> None:
    pods = setup(groups_fake, 4, 2)
    with cluster(groups_api) as (ext, client):
        assert ext.cache.wait_for(lambda: ext.cache.groups.sizes, WAIT)
        home = filter_(client, pods[0])["NodeNames"][0]
        groups_fake.delete_node(home)
        assert ext.cache.wait_for(lambda: home not in ext.cache.nodes and not job_slots(ext), WAIT)
        out = filter_(client, pods[0])
        assert len(out["NodeNames"]) == 1 and out["NodeNames"][0] != home and home in out["FailedNodes"]
        text = client.get("/metrics").text
    assert 'gpu_extender_reservations_ended_total{why="node_gone"} 4.0' in text


def test_planned_nodes_the_scheduler_filtered_out_are_replaced(groups_fake: FakeGroupsKubeApi, groups_api) -> None:
    pods = setup(groups_fake, 2, 2)
    with cluster(groups_api) as (ext, client):
        assert ext.cache.wait_for(lambda: ext.cache.groups.sizes, WAIT)
        home = filter_(client, pods[0])["NodeNames"][0]
        others = [n for n in NAMES if n != home]
        out = filter_(client, pods[1], others)  # kube-scheduler's own filters removed the planned node
        assert len(out["NodeNames"]) == 1 and out["NodeNames"][0] in others
        assert list(job_slots(ext)) == out["NodeNames"]


def test_a_job_of_unknown_size_goes_pod_by_pod_near_its_members(groups_fake: FakeGroupsKubeApi,
                                                                   groups_api) -> None:
    pods = setup(groups_fake, 3, 2, group=False)  # the PodGroup object is not there (yet): no pod count anywhere
    with cluster(groups_api) as (ext, client):
        first = filter_(client, pods[0])["NodeNames"]
        assert len(first) == 1 and job_slots(ext) == {first[0]: 2}  # one slot, for this pod
        assert bind(client, pods[0], first[0]) == ""
        for pod in pods[1:]:
            assert filter_(client, pod)["NodeNames"] == first  # next to the pod placed (host path beats 12.5 GB/s)
            assert bind(client, pod, first[0]) == ""

        # a PodGroup appearing later gives the size: the next pods are planned as a whole
        groups_fake.add_group(pod_group("train-7", 4))
        assert ext.cache.wait_for(lambda: ext.cache.groups.sizes, WAIT)
        late = groups_fake.add_pod(kubeflow_pod("train-7", 3, 2))
        out = filter_(client, late)
        assert out["NodeNames"] == first and job_slots(ext) == {first[0]: 2}
        assert "(3/4 workers placed, 1 planned on node" in next(iter(out["FailedNodes"].values()))


def test_a_failed_binding_of_a_member_loses_no_gpu_and_the_pod_gets_a_slot_again(groups_fake: FakeGroupsKubeApi,
                                                                                  groups_api) -> None:
    pods = setup(groups_fake, 2, 4)
    with cluster(groups_api) as (ext, client):
        assert ext.cache.wait_for(lambda: ext.cache.groups.sizes, WAIT)
        home = filter_(client, pods[0])["NodeNames"][0]
        groups_fake.fail_next(1, 500, path_regex="/binding")
        assert "failed" in bind(client, pods[0], home)
        assert job_slots(ext) == {home: 4} and ext.reservations.count() == 1  # its slot went with the failed bind
        for pod in pods:  # the retry takes the slot left; the other pod finds none and plans itself next to it
            assert filter_(client, pod)["NodeNames"] == [home]
            assert bind(client, pod, home) == ""
        assert job_slots(ext) == {} and ext.reservations.count() == 2
        assert len(set().union(*(r.ids for r in ext.reservations.all()))) == 8
