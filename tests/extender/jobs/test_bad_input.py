"""Bad jobs through the verbs: every node refuses the pod with one bounded sentence naming the job or the pod and
the field (kube-scheduler counts equal reasons into one line of the FailedScheduling event), and nothing is
reserved for it."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from tests.extender.jobs.conftest import DGX_A100, PREFIX, WAIT, cluster, k8s_node, kubeflow_pod, pod_group, rated
from tests.fakes.kubeapi.groups import FakeGroupsKubeApi
from tests.helpers.scheduler import cache_args

NAMES = ["n1", "n2", "n3"]


def refusals(client: httpx.Client, pod: dict[str, Any]) -> tuple[dict[str, str], dict[str, str]]:
    r = client.post("/filter", json=cache_args(pod, NAMES))
    assert r.status_code == 200
    out = r.json()
    assert out["NodeNames"] == [] and out["Error"] == ""
    return out["FailedNodes"], out["FailedAndUnresolvableNodes"]


def one_reason(reasons: dict[str, str]) -> str:
    assert set(reasons) == set(NAMES)
    assert len(set(reasons.values())) == 1, reasons  # one line in the event, however many nodes
    reason = next(iter(reasons.values()))
    assert len(reason) <= 400
    return reason


@pytest.fixture
def nodes(groups_fake: FakeGroupsKubeApi) -> FakeGroupsKubeApi:
    t = rated(DGX_A100, 100.0)
    for name in NAMES:
        groups_fake.add_node(k8s_node(name, t, rack="r1"))
    return groups_fake


@pytest.mark.parametrize(("labels", "annotations", "needle"), [
    ({}, {"scheduling.k8s.io/group-name": "other"},  # Volcano and coscheduling name different gangs
     "pod is put in different groups of one kind: coscheduling 'train-7', volcano 'other'"),
    ({}, {f"{PREFIX}/job-size": "lots"}, "annotation gpu-topology.io/job-size='lots' is not a whole number of pods"),
    ({}, {f"{PREFIX}/job-size": "0"}, "annotation gpu-topology.io/job-size=0 is outside 1..8192 pods"),
    ({"training.kubeflow.org/job-name": "x" * 63 + "."}, {}, "label training.kubeflow.org/job-name="),
    ({"scheduling.x-k8s.io/pod-group": "g" * 253}, {f"{PREFIX}/job": "-bad-"}, "annotation gpu-topology.io/job="),
])
def test_unreadable_jobs_are_refused_by_every_node_naming_the_field(nodes: FakeGroupsKubeApi, groups_api,
                                                                     labels: dict[str, str],
                                                                     annotations: dict[str, str],
                                                                     needle: str) -> None:
    pod = nodes.add_pod(kubeflow_pod("train-7", 0, 2, labels=labels, annotations=annotations))
    with cluster(groups_api) as (ext, client):
        failed, unresolvable = refusals(client, pod)
        assert failed == {}
        reason = one_reason(unresolvable)
        assert reason.startswith("pod ml/train-7-worker-0: ") and needle in reason, reason
        scores = client.post("/prioritize", json=cache_args(pod, NAMES)).json()
        assert [h["Score"] for h in scores] == [0, 0, 0]
        assert ext.reservations.count() == 0


def test_members_asking_different_gpu_counts_are_refused_naming_both(nodes: FakeGroupsKubeApi, groups_api) -> None:
    nodes.add_group(pod_group("train-7", 2))
    two = nodes.add_pod(kubeflow_pod("train-7", 0, 2))
    four = nodes.add_pod(kubeflow_pod("train-7", 1, 4))
    with cluster(groups_api) as (ext, client):
        assert ext.cache.wait_for(lambda: len(ext.cache.pods) == 2 and ext.cache.groups.sizes, WAIT)
        for pod in (two, four):
            reason = one_reason(refusals(client, pod)[1])
            assert "job ml/train-7: members ask different GPU counts" in reason, reason
            assert "ml/train-7-worker-0 2" in reason and "ml/train-7-worker-1 4" in reason
        assert ext.reservations.count() == 0


def test_a_pod_unlike_its_jobs_plan_is_refused(nodes: FakeGroupsKubeApi, groups_api) -> None:
    """The cache has not seen the second pod yet (it was just created): the plan made for the first says it."""
    nodes.add_group(pod_group("train-7", 2))
    with cluster(groups_api) as (ext, client):
        assert ext.cache.wait_for(lambda: ext.cache.groups.sizes, WAIT)
        first = kubeflow_pod("train-7", 0, 2)
        first["metadata"]["uid"] = "uid-0"
        client.post("/filter", json=cache_args(first, NAMES))
        other = kubeflow_pod("train-7", 1, 4)
        other["metadata"]["uid"] = "uid-1"
        reason = one_reason(refusals(client, other)[1])
        assert "pod ml/train-7-worker-1 asks 4 GPUs, the job's plan is for pods of 2" in reason, reason


def test_a_job_that_fits_nowhere_is_refused_with_the_shortfall_and_reserves_nothing(nodes: FakeGroupsKubeApi,
                                                                                      groups_api) -> None:
    nodes.add_group(pod_group("train-7", 4))
    pod = nodes.add_pod(kubeflow_pod("train-7", 0, 8))
    with cluster(groups_api) as (ext, client):
        assert ext.cache.wait_for(lambda: ext.cache.groups.sizes, WAIT)
        failed, unresolvable = refusals(client, pod)
        assert unresolvable == {}  # more room later (pods end, nodes join) can fix it
        assert one_reason(failed) == "job ml/train-7: needs 4 more workers of 8 GPUs, the cluster has room for 3 now"
        assert ext.reservations.count() == 0
        text = client.get("/metrics").text
    assert 'gpu_extender_job_plans_total{outcome="unplaceable"} 1.0' in text


def test_a_podgroup_whose_minimum_is_not_a_count_gives_no_size(nodes: FakeGroupsKubeApi, groups_api) -> None:
    nodes.add_group(pod_group("train-7", "many"))
    nodes.add_group(pod_group("train-8", 2))
    pod = nodes.add_pod(kubeflow_pod("train-7", 0, 2))
    with cluster(groups_api) as (ext, client):
        assert ext.cache.wait_for(lambda: len(ext.cache.groups.sizes) == 1, WAIT)
        r = client.post("/filter", json=cache_args(pod, NAMES)).json()
        assert len(r["NodeNames"]) == 1  # planned pod by pod, as a job of unknown size
        assert "(0/? workers placed, 1 planned on node" in next(iter(r["FailedNodes"].values()))


def test_a_job_refused_again_for_the_same_reason_is_logged_once_at_info(nodes: FakeGroupsKubeApi,
                                                                         groups_api) -> None:
    """kube-scheduler retries a refused pod every few seconds (and a real autoscaling day refused one job over a
    thousand times in six minutes): the reason is news once, the repeats are debug."""
    import structlog

    nodes.add_group(pod_group("train-7", 4))
    pod = nodes.add_pod(kubeflow_pod("train-7", 0, 8))
    with cluster(groups_api) as (ext, client), structlog.testing.capture_logs() as logs:
        assert ext.cache.wait_for(lambda: ext.cache.groups.sizes, WAIT)
        for _ in range(5):
            refusals(client, pod)
    said = [e for e in logs if e["event"] == "extender.job.unplaceable"]
    assert [e["log_level"] for e in said] == ["info", "debug", "debug", "debug", "debug"], said
