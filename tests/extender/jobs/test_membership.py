"""Job membership from what the ecosystem writes on pods: every source, the precedence, sizes, and bad input."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from extender.membership import job as m
from extender.membership.job import (
    BadJobName,
    BadJobSize,
    ConflictingGroups,
    GroupKind,
    GroupRef,
    JobRef,
    MembershipError,
    MixedGpuCounts,
    Source,
    common_gpu_count,
    group_sizes_of,
    job_membership,
)
from gputopo.contract import Keys

KEYS = Keys()


def pod(labels: dict[str, str] | None = None, annotations: dict[str, Any] | None = None,
        spec: dict[str, Any] | None = None, namespace: str = "ml") -> dict[str, Any]:
    return {
        "metadata": {"name": "p", "namespace": namespace, "labels": labels or {}, "annotations": annotations or {}},
        "spec": {"containers": [{"name": "c"}], **(spec or {})},
    }


PYTORCH_WORKER = {m.KUBEFLOW_JOB: "train-7", m.KUBEFLOW_OPERATOR: "pytorchjob-controller",
                  m.KUBEFLOW_REPLICA_TYPE: "Worker", m.KUBEFLOW_REPLICA_INDEX: "2"}
MPI_WORKER = {m.KUBEFLOW_JOB: "mpi-1", m.KUBEFLOW_OPERATOR: "mpi-operator", m.KUBEFLOW_ROLE: "worker",
              m.KUBEFLOW_REPLICA_INDEX: "0"}
JOBSET_POD = {m.JOBSET_NAME: "tj", m.JOBSET_REPLICATED_JOB: "node", m.JOBSET_JOB_INDEX: "0",
              m.JOB_COMPLETION_INDEX: "3"}
LWS_LEADER = {m.LWS_NAME: "vllm", m.LWS_GROUP_INDEX: "1", m.LWS_WORKER_INDEX: "0"}


@pytest.mark.parametrize(
    ("the_pod", "key", "size", "size_from", "role", "index"),
    [
        (pod(PYTORCH_WORKER), "ml/kubeflow/pytorchjob-controller/train-7", None, None, "worker", 2),
        (pod(MPI_WORKER), "ml/kubeflow/mpi-operator/mpi-1", None, None, "worker", 0),
        (pod({m.KUBEFLOW_JOB: "old"}), "ml/kubeflow/old", None, None, None, None),
        (pod(JOBSET_POD), "ml/jobset/tj", None, None, "node", 3),
        (pod(LWS_LEADER, {m.LWS_SIZE: "4"}), "ml/leaderworkerset/vllm/1", 4,
         "annotation leaderworkerset.sigs.k8s.io/size", "leader", 0),
        (pod({m.KUEUE_GROUP: "g"}, {m.KUEUE_TOTAL: "6"}), "ml/kueue/g", 6,
         "annotation kueue.x-k8s.io/pod-group-total-count", None, None),
        (pod({m.SCHEDULER_PLUGINS_POD_GROUP: "pg"}), "ml/coscheduling/pg", None, None, None, None),
        (pod({}, {m.VOLCANO_GROUP: "train-7-uid"}), "ml/volcano/train-7-uid", None, None, None, None),
        (pod(spec={"schedulingGroup": {"podGroupName": "training-worker-0"}}), "ml/podgroup/training-worker-0",
         None, None, None, None),
        (pod(spec={"workloadRef": {"name": "training-job-workload", "podGroup": "workers"}}),
         "ml/workload/training-job-workload/workers", None, None, None, None),
        (pod(spec={"workloadRef": {"name": "w", "podGroup": "workers", "podGroupReplicaKey": "1"}}),
         "ml/workload/w/workers/1", None, None, None, None),
        (pod({}, {KEYS.job: "my-job", KEYS.job_size: "4"}), "ml/annotation/my-job", 4,
         "annotation gpu-topology.io/job-size", None, None),
        (pod({"app": "web"}), None, None, None, None, None),
        ({"metadata": {}, "spec": {}}, None, None, None, None, None),
    ],
)
def test_each_source_gives_the_job_and_what_it_knows(the_pod, key, size, size_from, role, index) -> None:
    got = job_membership(the_pod, KEYS)
    if key is None:
        assert got is None
        return
    assert got is not None
    assert (got.job.key, got.size, got.size_from, got.role, got.index) == (key, size, size_from, role, index)


def test_precedence_own_then_workload_api_then_gang_scheduler_then_controller() -> None:
    layers: list[tuple[dict, dict, dict, Source]] = [
        (PYTORCH_WORKER, {}, {}, Source.KUBEFLOW),
        ({**PYTORCH_WORKER, m.SCHEDULER_PLUGINS_POD_GROUP: "train-7"}, {}, {}, Source.COSCHEDULING),
        ({**PYTORCH_WORKER, m.SCHEDULER_PLUGINS_POD_GROUP: "train-7"}, {}, {"schedulingGroup": {"podGroupName": "x"}},
         Source.POD_GROUP),
        ({**PYTORCH_WORKER, m.SCHEDULER_PLUGINS_POD_GROUP: "train-7"}, {KEYS.job: "mine"},
         {"schedulingGroup": {"podGroupName": "x"}}, Source.OWN),
    ]
    for labels, ann, spec, source in layers:
        got = job_membership(pod(labels, ann, spec), KEYS)
        assert got is not None and got.job.source is source


def test_both_workload_api_fields_mean_the_runtime_pod_group() -> None:
    spec = {"schedulingGroup": {"podGroupName": "pg-0"}, "workloadRef": {"name": "w", "podGroup": "workers"}}
    got = job_membership(pod(spec=spec), KEYS)
    assert got is not None and got.job.key == "ml/podgroup/pg-0"
    assert got.group == GroupRef(GroupKind.K8S_POD_GROUP, "ml", "pg-0")


def test_size_from_the_group_object_when_seen_and_our_annotation_over_it() -> None:
    labels = {**MPI_WORKER, m.SCHEDULER_PLUGINS_POD_GROUP: "mpi-1"}
    sizes = group_sizes_of({"apiVersion": "scheduling.x-k8s.io/v1alpha1", "kind": "PodGroup",
                            "metadata": {"name": "mpi-1", "namespace": "ml"}, "spec": {"minMember": 5}})
    got = job_membership(pod(labels), KEYS, sizes)
    assert got is not None and (got.size, got.size_from) == (5, "scheduling.x-k8s.io/v1alpha1 PodGroup minMember")
    assert job_membership(pod(labels), KEYS, {}).size is None  # not seen yet: unknown, still a member
    # the PodGroup counts the launcher too; our annotation says how many GPU pods there are
    got = job_membership(pod(labels, {KEYS.job_size: "4"}), KEYS, sizes)
    assert got is not None and (got.size, got.job.source) == (4, Source.COSCHEDULING)


def test_sizes_from_every_group_object_kind() -> None:
    k8s_pg = {"apiVersion": "scheduling.k8s.io/v1alpha2", "kind": "PodGroup",
              "metadata": {"name": "pg-0", "namespace": "ml"},
              "spec": {"schedulingPolicy": {"gang": {"minCount": 4}}}}
    basic = copy.deepcopy(k8s_pg)
    basic["spec"]["schedulingPolicy"] = {"basic": {}}
    workload = {"apiVersion": "scheduling.k8s.io/v1alpha1", "kind": "Workload",
                "metadata": {"name": "w", "namespace": "ml"},
                "spec": {"podGroups": [{"name": "driver", "policy": {"basic": {}}},
                                       {"name": "workers", "policy": {"gang": {"minCount": 8}}}]}}
    volcano = {"apiVersion": "scheduling.volcano.sh/v1beta1", "kind": "PodGroup",
               "metadata": {"name": "v", "namespace": "ml"}, "spec": {"minMember": 3}}
    assert group_sizes_of(k8s_pg) == {GroupRef(GroupKind.K8S_POD_GROUP, "ml", "pg-0"): 4}
    assert group_sizes_of(basic) == {}
    assert group_sizes_of(workload) == {GroupRef(GroupKind.K8S_WORKLOAD, "ml", "w", "workers"): 8}
    assert group_sizes_of(volcano) == {GroupRef(GroupKind.VOLCANO_POD_GROUP, "ml", "v"): 3}
    sizes = {**group_sizes_of(k8s_pg), **group_sizes_of(workload), **group_sizes_of(volcano)}
    assert job_membership(pod(spec={"schedulingGroup": {"podGroupName": "pg-0"}}), KEYS, sizes).size == 4
    assert job_membership(pod(spec={"workloadRef": {"name": "w", "podGroup": "workers"}}), KEYS, sizes).size == 8
    assert job_membership(pod({}, {m.VOLCANO_GROUP: "v"}), KEYS, sizes).size == 3
    assert job_membership(pod({}, {m.VOLCANO_GROUP: "v"}, namespace="other"), KEYS, sizes).size is None


@pytest.mark.parametrize(
    ("obj", "error", "message"),
    [
        ({"apiVersion": "scheduling.x-k8s.io/v1alpha1", "kind": "PodGroup", "metadata": {"name": "a"},
          "spec": {"minMember": 0}}, BadJobSize, r"spec.minMember=0 is outside 1..8192"),
        ({"apiVersion": "scheduling.volcano.sh/v1beta1", "kind": "PodGroup", "metadata": {"name": "a"},
          "spec": {}}, BadJobSize, "spec.minMember must be a whole number"),
        ({"apiVersion": "scheduling.k8s.io/v1alpha2", "kind": "PodGroup", "metadata": {"name": "a"},
          "spec": {"schedulingPolicy": {"gang": {"minCount": 10**7}}}}, BadJobSize, "outside 1..8192"),
        ({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "a"}}, MembershipError, "not a group kind"),
        ({"apiVersion": "scheduling.x-k8s.io/v1alpha1", "kind": "PodGroup", "metadata": {}}, BadJobName,
         "metadata.name"),
        ([], MembershipError, "must be an object"),
    ],
)
def test_bad_group_objects_are_named(obj, error, message) -> None:
    with pytest.raises(error, match=message):
        group_sizes_of(obj)


@pytest.mark.parametrize(
    ("labels", "annotations"),
    [
        ({m.SCHEDULER_PLUGINS_POD_GROUP: "a"}, {m.VOLCANO_GROUP: "b"}),
        ({m.SCHEDULER_PLUGINS_POD_GROUP: "a", m.KUEUE_GROUP: "c"}, {}),
        ({**JOBSET_POD, m.KUBEFLOW_JOB: "other"}, {}),
        ({**LWS_LEADER, m.JOBSET_NAME: "tj"}, {}),
    ],
)
def test_two_groups_of_one_kind_conflict(labels, annotations) -> None:
    with pytest.raises(ConflictingGroups, match="different groups of one kind"):
        job_membership(pod(labels, annotations), KEYS)


def test_the_same_group_seen_by_two_sources_of_a_kind_is_no_conflict() -> None:
    labels = {m.SCHEDULER_PLUGINS_POD_GROUP: "train-7", m.JOBSET_NAME: "train-7"}
    got = job_membership(pod(labels, {m.VOLCANO_GROUP: "train-7"}), KEYS)
    assert got is not None and got.job.key == "ml/coscheduling/train-7"
    got = job_membership(pod({**PYTORCH_WORKER, m.JOBSET_NAME: "train-7"}), KEYS)
    assert got is not None and got.job.source is Source.JOBSET


@pytest.mark.parametrize("value", ["0", "-1", "abc", "1e9", "4.0", "", "99999", 0, 10**6, True, 3.5, None, []])
def test_absurd_sizes_are_refused(value) -> None:
    with pytest.raises(BadJobSize):
        job_membership(pod({}, {KEYS.job: "j", KEYS.job_size: value}), KEYS)


def test_sizes_from_ecosystem_annotations_are_checked_too() -> None:
    with pytest.raises(BadJobSize, match=r"leaderworkerset\.sigs\.k8s\.io/size"):
        job_membership(pod(LWS_LEADER, {m.LWS_SIZE: "-3"}), KEYS)
    with pytest.raises(BadJobSize, match="pod-group-total-count"):
        job_membership(pod({m.KUEUE_GROUP: "g"}, {m.KUEUE_TOTAL: "lots"}), KEYS)


@pytest.mark.parametrize(
    ("labels", "annotations", "spec", "message"),
    [
        ({}, {KEYS.job: ""}, {}, "gpu-topology.io/job must be a non-empty string"),
        ({}, {KEYS.job: "a b"}, {}, "is not a name"),
        ({}, {KEYS.job: "x" * 300}, {}, "is not a name"),
        ({}, {m.VOLCANO_GROUP: "-bad-"}, {}, "scheduling.k8s.io/group-name"),
        ({m.LWS_NAME: "vllm", m.LWS_GROUP_INDEX: "x"}, {}, {}, "not a group index"),
        ({}, {}, {"schedulingGroup": {}}, "podGroupName"),
        ({}, {}, {"workloadRef": {"name": "w"}}, "spec.workloadRef.podGroup"),
    ],
)
def test_bad_names_are_refused(labels, annotations, spec, message) -> None:
    with pytest.raises(BadJobName, match=message):
        job_membership(pod(labels, annotations, spec), KEYS)


def test_a_size_without_a_job_is_refused() -> None:
    with pytest.raises(MembershipError, match="without a job"):
        job_membership(pod({}, {KEYS.job_size: "4"}), KEYS)


def test_keys_follow_the_configured_prefix() -> None:
    keys = Keys("example.com")
    got = job_membership(pod({}, {"example.com/job": "j", "example.com/job-size": "2"}), keys)
    assert got is not None and (got.job.key, got.size) == ("ml/annotation/j", 2)
    assert job_membership(pod({}, {KEYS.job: "j"}), keys) is None


def test_members_must_ask_one_gpu_count() -> None:
    job = JobRef("ml", Source.KUBEFLOW, "mpi-1")
    assert common_gpu_count(job, [("launcher", 0), ("worker-0", 2), ("worker-1", 2)]) == 2
    assert common_gpu_count(job, [("launcher", 0)]) is None
    with pytest.raises(MixedGpuCounts, match=r"job ml/mpi-1: members ask different GPU counts \(worker-0 2, w3 4\)"):
        common_gpu_count(job, [("worker-0", 2), ("worker-1", 2), ("w3", 4)])


KNOWN_LABELS = [m.SCHEDULER_PLUGINS_POD_GROUP, m.KUEUE_GROUP, m.LWS_NAME, m.LWS_GROUP_INDEX, m.LWS_WORKER_INDEX,
                m.JOBSET_NAME, m.JOBSET_REPLICATED_JOB, m.KUBEFLOW_JOB, m.KUBEFLOW_OPERATOR,
                m.KUBEFLOW_REPLICA_INDEX, m.KUBEFLOW_REPLICA_TYPE, "app"]
KNOWN_ANNOTATIONS = [KEYS.job, KEYS.job_size, m.VOLCANO_GROUP, m.KUEUE_TOTAL, m.LWS_SIZE]
VALUES = st.one_of(st.sampled_from(["a", "b", "0", "3", "-1", "", "x y", "9" * 12]), st.integers(-5, 10**5),
                   st.none(), st.text(max_size=8))


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.sampled_from(KNOWN_LABELS), VALUES),
       st.dictionaries(st.sampled_from(KNOWN_ANNOTATIONS), VALUES),
       st.sampled_from([{}, {"schedulingGroup": {"podGroupName": "pg"}}, {"schedulingGroup": 5},
                        {"workloadRef": {"name": "w", "podGroup": "g", "podGroupReplicaKey": 7}}]))
def test_any_pod_gives_a_membership_or_a_named_error(labels, annotations, spec) -> None:
    the_pod = pod(labels, annotations, spec)
    try:
        first = job_membership(the_pod, KEYS)
    except MembershipError as e:
        assert str(e)
        return
    assert job_membership(copy.deepcopy(the_pod), KEYS) == first  # deterministic
    if first is not None:
        assert first.size is None or 1 <= first.size <= m.MAX_JOB_PODS
        assert first.job.key.startswith("ml/")
