"""A job's size from its owner object, read from what a real kube-apiserver v1.36 returned for each kind
(fixtures/recordings/kube-apiserver-jobs), and from the operators' env where the owner cannot be read."""

from __future__ import annotations

import json
from typing import Any

import pytest
from pydantic import ValidationError

from extender.config import ExtenderConfig
from extender.membership.job import OwnerSize, Source, job_membership
from extender.membership.owners import OWNER_KINDS, OwnerError, OwnerRef, owner_shape_of, owners_of_pod, size_from_env
from extender.membership.ownership import OwnerShapes
from gputopo.contract import Keys
from gputopo.kube.fetching import ApiResource
from tests.fakes.kubeapi.jobs import recorded_object

RESOURCE = "nvidia.com/gpu"
KEYS = Keys("gpu-topology.io")

# file -> (GPU pods, GPUs per pod, CPU-only roles left out), as the recording's README tabulates the objects
RECORDED = {
    "pytorchjob-get.json": (4, 1, ()),
    "tfjob-ps-worker-get.json": (4, 1, ("PS",)),
    "tfjob-chief-worker-get.json": (3, 2, ()),
    "paddlejob-get.json": (2, 2, ()),
    "mpijob-v1-get.json": (2, 1, ("Launcher",)),
    "mpijob-v2beta1-get.json": (2, 1, ("Launcher",)),
    "trainjob-get.json": (2, 4, ()),
    "jobset-get.json": (4, 8, ("driver",)),
    "leaderworkerset-get.json": (4, 8, ()),  # per group: the leader and 3 workers
}


@pytest.mark.parametrize("name", sorted(RECORDED))
def test_recorded_objects_give_their_gpu_pods(name: str) -> None:
    shape = owner_shape_of(recorded_object(name), RESOURCE)
    pods, per_pod, left_out = RECORDED[name]
    assert (shape.gpu_pods, shape.gpus_per_pod, shape.left_out, shape.problem) == (pods, per_pod, left_out, None)
    assert shape.uid == recorded_object(name)["metadata"]["uid"]
    assert shape.ref.kind in shape.summary and (not left_out or left_out[0] in shape.summary)


@pytest.mark.parametrize("name", ["xgboostjob-get.json", "jaxjob-get.json"])
def test_a_job_asking_no_gpus_has_no_size(name: str) -> None:
    assert "no replica asks for GPUs" in (owner_shape_of(recorded_object(name), RESOURCE).problem or "")


def _pytorch(master: Any, worker: Any, replicas: Any = 3) -> dict[str, Any]:
    def spec(gpus: Any, n: Any) -> dict[str, Any]:
        return {"replicas": n, "template": {"spec": {"containers": [
            {"name": "pytorch", "resources": {"limits": {RESOURCE: gpus}}}]}}}
    return {"apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob", "metadata": {"name": "j", "namespace": "ml"},
            "spec": {"pytorchReplicaSpecs": {"Master": spec(master, 1), "Worker": spec(worker, replicas)}}}


def test_string_and_number_quantities_and_mixed_counts() -> None:
    assert owner_shape_of(_pytorch("2", 2), RESOURCE).gpu_pods == 4  # "2" and 2 alike
    mixed = owner_shape_of(_pytorch(1, 2), RESOURCE)
    assert mixed.gpus_per_pod is None and "different GPU counts" in (mixed.problem or "")
    assert owner_shape_of(_pytorch(0, 2), RESOURCE).left_out == ("Master",)


@pytest.mark.parametrize(("obj", "says"), [
    (_pytorch(1, 1, replicas="3"), "replicas must be a whole number"),
    (_pytorch(1, "lots"), "Worker.template: containers.pytorch. limits"),
    (_pytorch(1, 1, replicas=-1), "replicas must be a whole number"),
    ({"apiVersion": "kubeflow.org/v1", "kind": "TFJob", "metadata": {"name": "t"}, "spec": {"tfReplicaSpecs": []}},
     "spec.tfReplicaSpecs must be a map"),
    ({"apiVersion": "trainer.kubeflow.org/v1alpha1", "kind": "TrainJob", "metadata": {"name": "t"},
      "spec": {"trainer": {}}}, "numNodes is not set"),
    ({"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "t"}, "spec": {}}, "not an owner kind"),
    ({"apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob", "metadata": {}, "spec": {}}, "without metadata.name"),
])
def test_bad_owner_objects_are_refused_with_the_field(obj: dict[str, Any], says: str) -> None:
    with pytest.raises(OwnerError, match=says):
        owner_shape_of(obj, RESOURCE)


def _pod(labels: dict[str, str] | None = None, owner: dict[str, Any] | None = None,
         env: dict[str, str] | None = None) -> dict[str, Any]:
    return {"metadata": {"name": "p", "namespace": "ml", "labels": labels or {},
                         "ownerReferences": [owner] if owner else []},
            "spec": {"containers": [{"name": "c", "env": [{"name": k, "value": v} for k, v in (env or {}).items()],
                                     "resources": {"limits": {RESOURCE: "1"}}}]}}


def test_a_pod_names_its_owner_by_reference_or_by_its_controllers_labels() -> None:
    ref = {"apiVersion": "kubeflow.org/v2beta1", "kind": "MPIJob", "name": "pi", "uid": "u1", "controller": True}
    assert [o.ref for o in owners_of_pod(_pod(owner=ref))] == [OwnerRef("kubeflow.org", "MPIJob", "ml", "pi")]
    assert owners_of_pod(_pod(owner=ref))[0].uid == "u1"
    job_owned = _pod({"jobset.sigs.k8s.io/jobset-name": "train"},
                     {"apiVersion": "batch/v1", "kind": "Job", "name": "train-node-0", "uid": "j"})
    assert [o.ref.kind for o in owners_of_pod(job_owned)] == ["JobSet", "TrainJob"]
    lws = _pod({"leaderworkerset.sigs.k8s.io/name": "vllm"})
    assert [o.ref.kind for o in owners_of_pod(lws)] == ["LeaderWorkerSet"]
    labelled = _pod({"training.kubeflow.org/job-name": "j", "training.kubeflow.org/operator-name": "tfjob-controller"})
    assert [o.ref for o in owners_of_pod(labelled)] == [OwnerRef("kubeflow.org", "TFJob", "ml", "j")]


def test_env_sizes_tfjob_and_pytorchjob() -> None:
    tf = {"cluster": {"chief": ["c:2222"], "worker": ["w0:2222", "w1:2222"], "ps": ["p0:2222"]},
          "task": {"type": "worker", "index": 0}}
    assert size_from_env(_pod(env={"TF_CONFIG": json.dumps(tf)})) == (3, "env TF_CONFIG cluster (chief 1 + worker 2)")
    assert size_from_env(_pod(env={"PET_NNODES": "4", "WORLD_SIZE": "32"})) == (4, "env PET_NNODES")
    assert size_from_env(_pod(env={"WORLD_SIZE": "16", "PET_NPROC_PER_NODE": "8"}))[0] == 2  # type: ignore[index]
    assert size_from_env(_pod(env={"PET_NNODES": "1:4"})) is None  # elastic: a range is not a size
    assert size_from_env(_pod(env={"TF_CONFIG": "{not json"})) is None
    assert size_from_env(_pod(env={"WORLD_SIZE": "7", "PET_NPROC_PER_NODE": "2"})) is None


PYTORCH = ApiResource("kubeflow.org", "v1", "pytorchjobs", "PyTorchJob")


def _pytorch_pod(uid: str = "80c97626-d77a-4a7e-8966-22afe4273a06", env: dict[str, str] | None = None,
                 group: bool = False) -> dict[str, Any]:
    labels = {"training.kubeflow.org/job-name": "pytorch-dist-mnist-nccl",
              "training.kubeflow.org/operator-name": "pytorchjob-controller",
              "training.kubeflow.org/replica-type": "worker", "training.kubeflow.org/replica-index": "0"}
    if group:
        labels["scheduling.x-k8s.io/pod-group"] = "pytorch-dist-mnist-nccl"
    pod = _pod(labels, {"apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob", "name": "pytorch-dist-mnist-nccl",
                        "uid": uid, "controller": True, "blockOwnerDeletion": True}, env)
    pod["metadata"]["namespace"] = "ml-team"
    return pod


def test_membership_takes_the_owners_size_before_a_group_minimum_and_env() -> None:
    owners = OwnerShapes(RESOURCE)
    owners.sync(PYTORCH, [recorded_object("pytorchjob-get.json")])
    m = job_membership(_pytorch_pod(env={"PET_NNODES": "9"}, group=True), KEYS, {}, owners)
    assert m is not None and m.job.source is Source.COSCHEDULING
    assert (m.size, m.size_from) == (4, "PyTorchJob ml-team/pytorch-dist-mnist-nccl: Master 1 + Worker 3, 1 GPU each")


def test_an_unreadable_owner_keeps_the_size_unknown_and_says_why() -> None:
    owners = OwnerShapes(RESOURCE)
    owners.sync(PYTORCH, [], absent="forbidden")
    m = job_membership(_pytorch_pod(), KEYS, None, owners)
    assert m is not None and m.size is None
    assert m.size_note == ("PyTorchJob ml-team/pytorch-dist-mnist-nccl is not readable: kubeflow.org/v1 pytorchjobs "
                           "forbidden")
    with_env = job_membership(_pytorch_pod(env={"PET_NNODES": "4"}), KEYS, None, owners)
    assert with_env is not None and with_env.size == 4 and with_env.size_from is not None
    assert with_env.size_from.startswith("env PET_NNODES (PyTorchJob")
    owners.sync(PYTORCH, [recorded_object("pytorchjob-get.json")])
    other = job_membership(_pytorch_pod(uid="another-uid"), KEYS, None, owners)  # a new job of that name
    assert other is not None and other.size is None and "another object of that name" in (other.size_note or "")
    unwatched = OwnerShapes(RESOURCE, kinds=("TFJob",))
    m = job_membership(_pytorch_pod(), KEYS, None, unwatched)
    assert m is not None and m.size_note is not None and m.size_note.endswith("not watched (--job-owner-kinds)")


def test_watched_objects_come_and_go() -> None:
    owners = OwnerShapes(RESOURCE)
    obj = recorded_object("pytorchjob-get.json")
    owners.apply(PYTORCH, "ADDED", obj)
    ref = OwnerRef("kubeflow.org", "PyTorchJob", "ml-team", "pytorch-dist-mnist-nccl")
    assert owners.shapes[ref].gpu_pods == 4
    bad = json.loads(json.dumps(obj))
    bad["spec"]["pytorchReplicaSpecs"]["Worker"]["replicas"] = "three"
    owners.apply(PYTORCH, "MODIFIED", bad)  # unreadable now: no size from it
    assert ref not in owners.shapes
    owners.apply(PYTORCH, "MODIFIED", obj)
    owners.apply(PYTORCH, "DELETED", obj)
    assert ref not in owners.shapes
    full = OwnerShapes(RESOURCE, limit=1)
    full.apply(PYTORCH, "ADDED", obj)
    full.apply(PYTORCH, "ADDED", {**obj, "metadata": {**obj["metadata"], "name": "second"}})
    assert len(full) == 1
    assert owners.size_of(_pod()) == OwnerSize(None, "no owner object of a kind read here, no size in its env")


def test_the_owner_kinds_setting() -> None:
    assert ExtenderConfig().job_owner_kinds == OWNER_KINDS
    assert ExtenderConfig(job_owner_kinds="").job_owner_kinds == ()  # the chart's empty list: none watched
    assert ExtenderConfig(job_owner_kinds="PyTorchJob, MPIJob,MPIJob").job_owner_kinds == ("PyTorchJob", "MPIJob")
    with pytest.raises(ValidationError, match="unknown owner kind 'Deployment'"):
        ExtenderConfig(job_owner_kinds="PyTorchJob,Deployment")
    assert OwnerShapes(RESOURCE, kinds=()).resources == ()
