"""A job's size from the object its pods come from: the Kubeflow and JobSet / LeaderWorkerSet custom resources.

The operators' pods say which job they belong to (labels, ownerReferences) but not how big it is; the object that
made them does. This reads, from the shapes a kube-apiserver v1.36 serves (fixtures/recordings/kube-apiserver-jobs),
the number of GPU-requesting pods and their GPUs per pod, leaving CPU-only replicas out (an MPIJob's launcher, a
TFJob's parameter servers, a JobSet's driver):

- PyTorchJob, TFJob, XGBoostJob, PaddleJob, JAXJob (kubeflow.org/v1), MPIJob (kubeflow.org/v1 and v2beta1):
  `spec.<kind>ReplicaSpecs[role].replicas` (default 1) pods of that role's `template.spec`;
- TrainJob (trainer.kubeflow.org/v1alpha1): `spec.trainer.numNodes` pods of `spec.trainer.resourcesPerNode`;
- JobSet (jobset.x-k8s.io/v1alpha2): per replicated job, `replicas` (default 1) x `template.spec.parallelism`
  (default 1, at most `completions`) pods of `template.spec.template.spec`;
- LeaderWorkerSet (leaderworkerset.x-k8s.io/v1), per group (one job each): a leader (`leaderTemplate`, else
  `workerTemplate`) and `size` - 1 workers (`workerTemplate`).

A TrainJob's pods come from the JobSet the trainer makes of it (named like it): the JobSet, already expanded from
the runtime, is read first; the TrainJob itself where its JobSet is not (yet) seen. Quantities are taken as the
CRs store them, numbers or strings, limits without requests or both (gputopo.podspec counts them as the kubelet).

Where the owner cannot be read (its kind not installed, not granted, not watched, not seen yet), the operators'
env in the pod itself is read (`size_from_env`): TFJob's `TF_CONFIG` cluster spec (chief, master and worker
tasks; PS and evaluator left out), the training operator's PyTorchJob `PET_NNODES` (total replicas; a "min:max"
range in elastic mode is not a size) and `WORLD_SIZE` / `PET_NPROC_PER_NODE` (kubeflow/training-operator
pkg/controller.v1/pytorch/envvar.go). Env counts every task the operator lists: a master asking no GPU would make
the size one too many, so the owner is preferred.

Pure: no I/O. The watched store is extender.membership.ownership.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from extender.membership.job import (
    JOBSET_NAME,
    KUBEFLOW_JOB,
    KUBEFLOW_OPERATOR,
    LWS_NAME,
    MAX_JOB_PODS,
    MembershipError,
)
from gputopo.podspec import PodSpecError, pod_device_count

KUBEFLOW = "kubeflow.org"
TRAINER = "trainer.kubeflow.org"
JOBSET = "jobset.x-k8s.io"
LWS = "leaderworkerset.x-k8s.io"

# Every kind read, as the apiserver serves it: (group, version, plural, kind). The MPIJob of the training operator
# (v1) and of the MPI operator (v2beta1) share one CRD name, so at most one of the two is ever served. Plain tuples:
# the settings (and the webhook, which never talks to the apiserver) read the kinds without the client.
OWNER_APIS: tuple[tuple[str, str, str, str], ...] = (
    (KUBEFLOW, "v1", "pytorchjobs", "PyTorchJob"),
    (KUBEFLOW, "v1", "tfjobs", "TFJob"),
    (KUBEFLOW, "v1", "xgboostjobs", "XGBoostJob"),
    (KUBEFLOW, "v1", "paddlejobs", "PaddleJob"),
    (KUBEFLOW, "v1", "jaxjobs", "JAXJob"),
    (KUBEFLOW, "v1", "mpijobs", "MPIJob"),
    (KUBEFLOW, "v2beta1", "mpijobs", "MPIJob"),
    (TRAINER, "v1alpha1", "trainjobs", "TrainJob"),
    (JOBSET, "v1alpha2", "jobsets", "JobSet"),
    (LWS, "v1", "leaderworkersets", "LeaderWorkerSet"),
)
OWNER_KINDS: tuple[str, ...] = tuple(dict.fromkeys(kind for _, _, _, kind in OWNER_APIS))

_REPLICA_SPECS = {"PyTorchJob": "pytorchReplicaSpecs", "TFJob": "tfReplicaSpecs", "XGBoostJob": "xgbReplicaSpecs",
                  "PaddleJob": "paddleReplicaSpecs", "JAXJob": "jaxReplicaSpecs", "MPIJob": "mpiReplicaSpecs"}
# training.kubeflow.org/operator-name values (training-operator v1.9 controllers, the MPI operator v2)
_OPERATOR_KINDS = {"pytorchjob-controller": "PyTorchJob", "tfjob-controller": "TFJob",
                   "xgboostjob-controller": "XGBoostJob", "paddlejob-controller": "PaddleJob",
                   "jaxjob-controller": "JAXJob", "mpijob-controller": "MPIJob", "mpi-operator": "MPIJob"}
_GROUP_OF = {kind: group for group, _, _, kind in OWNER_APIS}
_TF_GPU_TASKS = ("chief", "master", "worker")  # PS and evaluator tasks are not in the all-reduce


class OwnerError(MembershipError):
    """An owner object whose replica specs cannot be read; the message names the object and the field."""


@dataclass(frozen=True, slots=True)
class OwnerRef:
    """An owner object, as a pod names it (ownerReference, or the label of its controller)."""

    group: str
    kind: str
    namespace: str
    name: str

    def __str__(self) -> str:
        return f"{self.kind} {self.namespace}/{self.name}"


@dataclass(frozen=True, slots=True)
class Role:
    name: str
    pods: int
    gpus: int | None  # None: the object does not say (a TrainJob whose resources come from its runtime)


@dataclass(frozen=True, slots=True)
class OwnerShape:
    """What an owner says of its job: the GPU roles (CPU-only ones listed apart) and the GPU pods they make."""

    ref: OwnerRef
    uid: str | None
    roles: tuple[Role, ...]  # GPU-requesting roles
    left_out: tuple[str, ...] = ()  # CPU-only roles
    per_group: bool = False  # LeaderWorkerSet: the counts are per group (one job per group)

    @property
    def gpu_pods(self) -> int:
        return sum(r.pods for r in self.roles)

    @property
    def gpus_per_pod(self) -> int | None:
        counts = {r.gpus for r in self.roles if r.gpus is not None}
        return counts.pop() if len(counts) == 1 else None

    @property
    def problem(self) -> str | None:
        """Why the shape gives no size: no GPU role, more pods than a job may have, or roles asking different
        GPU counts (a job plan gives each member the same number)."""
        if not self.roles:
            return f"{self.ref}: no replica asks for GPUs"
        if not 1 <= self.gpu_pods <= MAX_JOB_PODS:
            return f"{self.ref}: {self.gpu_pods} GPU pods is outside 1..{MAX_JOB_PODS}"
        if len({r.gpus for r in self.roles if r.gpus is not None}) > 1:
            said = ", ".join(f"{r.name} {r.gpus}" for r in self.roles)
            return f"{self.ref}: its replicas ask different GPU counts ({said})"
        return None

    @property
    def summary(self) -> str:
        """'MPIJob ml/x: Worker 2, 1 GPU each (Launcher left out: no GPU)', bounded by the role count."""
        k = self.gpus_per_pod
        roles = " + ".join(f"{r.name} {r.pods}" for r in self.roles[:6])
        text = f"{self.ref}{' per group' if self.per_group else ''}: {roles}" + (f", {k} GPU each" if k else "")
        if self.left_out:
            text += f" ({', '.join(self.left_out[:4])} left out: no GPU)"
        return text


def _dict(value: Any) -> Mapping[str, Any]:
    return value if isinstance(value, dict) else {}


def _count(value: Any, where: str, default: int = 1) -> int:
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_JOB_PODS:
        raise OwnerError(f"{where} must be a whole number in 0..{MAX_JOB_PODS}, got {value!r:.80}")
    return value


def _gpus(template_spec: Any, resource: str, where: str) -> int:
    try:
        return pod_device_count({"spec": _dict(template_spec)}, resource) if template_spec is not None else 0
    except PodSpecError as e:
        raise OwnerError(f"{where}: {e}") from None


def owner_shape_of(obj: Any, resource: str) -> OwnerShape:
    """The shape one watched owner object gives. Raises OwnerError naming the field that cannot be read."""
    if not isinstance(obj, dict):
        raise OwnerError("owner object must be an object")
    kind, api = obj.get("kind"), str(obj.get("apiVersion") or "")
    meta, spec = _dict(obj.get("metadata")), _dict(obj.get("spec"))
    name = meta.get("name")
    if not isinstance(name, str) or not name:
        raise OwnerError(f"{kind} without metadata.name")
    group = api.partition("/")[0]
    if kind not in _GROUP_OF or _GROUP_OF[kind] != group:
        raise OwnerError(f"{api} {kind} is not an owner kind this reads")
    ref = OwnerRef(group, str(kind), str(meta.get("namespace") or "default"), name)
    uid = meta.get("uid") if isinstance(meta.get("uid"), str) else None
    where = f"{ref}"
    gpu: list[Role] = []
    cpu: list[str] = []

    def role(role_name: str, pods: int, gpus: int | None) -> None:
        if pods == 0:
            return
        if gpus == 0:
            cpu.append(role_name)
        else:
            gpu.append(Role(role_name, pods, gpus))

    per_group = False
    if kind in _REPLICA_SPECS:
        field = _REPLICA_SPECS[str(kind)]
        specs = spec.get(field)
        if not isinstance(specs, dict):
            raise OwnerError(f"{where}: spec.{field} must be a map of replica types")
        for rtype, rspec in specs.items():
            rspec = _dict(rspec)
            at = f"{where} spec.{field}.{rtype}"
            role(str(rtype), _count(rspec.get("replicas"), f"{at}.replicas"),
                 _gpus(_dict(rspec.get("template")).get("spec"), resource, f"{at}.template"))
    elif kind == "TrainJob":
        trainer = _dict(spec.get("trainer"))
        nodes = trainer.get("numNodes")
        if nodes is None:
            raise OwnerError(f"{where}: spec.trainer.numNodes is not set (its runtime's numNodes is not read)")
        res = trainer.get("resourcesPerNode")
        gpus = _gpus({"containers": [{"name": "node", "resources": res}]}, resource,
                     f"{where} spec.trainer.resourcesPerNode") if res is not None else None
        role("node", _count(nodes, f"{where} spec.trainer.numNodes"), gpus)
    elif kind == "JobSet":
        jobs = spec.get("replicatedJobs")
        if not isinstance(jobs, list):
            raise OwnerError(f"{where}: spec.replicatedJobs must be a list")
        for i, rj in enumerate(jobs):
            rj = _dict(rj)
            at = f"{where} spec.replicatedJobs[{i}]"
            job_spec = _dict(_dict(rj.get("template")).get("spec"))
            parallel = _count(job_spec.get("parallelism"), f"{at}.template.spec.parallelism")
            completions = job_spec.get("completions")
            if completions is not None:
                parallel = min(parallel, _count(completions, f"{at}.template.spec.completions"))
            pods = _count(rj.get("replicas"), f"{at}.replicas") * parallel
            role(str(rj.get("name") or i), pods,
                 _gpus(_dict(job_spec.get("template")).get("spec"), resource, f"{at}.template.spec.template"))
    else:  # LeaderWorkerSet
        per_group = True
        lwt = _dict(spec.get("leaderWorkerTemplate"))
        size = _count(lwt.get("size"), f"{where} spec.leaderWorkerTemplate.size")
        worker = _gpus(_dict(lwt.get("workerTemplate")).get("spec"), resource,
                       f"{where} spec.leaderWorkerTemplate.workerTemplate")
        leader = (_gpus(_dict(lwt.get("leaderTemplate")).get("spec"), resource,
                        f"{where} spec.leaderWorkerTemplate.leaderTemplate")
                  if lwt.get("leaderTemplate") is not None else worker)
        if size >= 1:
            role("leader", 1, leader)
            role("worker", size - 1, worker)
    return OwnerShape(ref, uid, tuple(gpu), tuple(cpu), per_group)


@dataclass(frozen=True, slots=True)
class PodOwner:
    """An owner a pod points at: `uid` when an ownerReference gives it (a recreated object of one name differs);
    `label`, the label that names it when no ownerReference does (a JobSet's pods are owned by batch Jobs)."""

    ref: OwnerRef
    uid: str | None
    label: str | None = None


def owners_of_pod(pod: Mapping[str, Any]) -> tuple[PodOwner, ...]:
    """The owner objects a pod may come from, the surest first: its controller ownerReference of a kind read here,
    then its controller's labels (a JobSet's pods are owned by batch Jobs; a LeaderWorkerSet's by StatefulSets)."""
    meta = _dict(pod.get("metadata"))
    namespace = str(meta.get("namespace") or "default")
    labels = _dict(meta.get("labels"))
    out: list[PodOwner] = []
    refs = meta.get("ownerReferences")
    for r in refs if isinstance(refs, list) else []:
        r = _dict(r)
        kind, name, group = r.get("kind"), r.get("name"), str(r.get("apiVersion") or "").partition("/")[0]
        if isinstance(kind, str) and isinstance(name, str) and name and _GROUP_OF.get(kind) == group:
            out.append(PodOwner(OwnerRef(group, kind, namespace, name),
                                r.get("uid") if isinstance(r.get("uid"), str) else None))
    jobset = labels.get(JOBSET_NAME)
    if isinstance(jobset, str) and jobset:
        out.append(PodOwner(OwnerRef(JOBSET, "JobSet", namespace, jobset), None, JOBSET_NAME))
        out.append(PodOwner(OwnerRef(TRAINER, "TrainJob", namespace, jobset), None, JOBSET_NAME))  # trainer names it so
    lws = labels.get(LWS_NAME)
    if isinstance(lws, str) and lws:
        out.append(PodOwner(OwnerRef(LWS, "LeaderWorkerSet", namespace, lws), None, LWS_NAME))
    job, operator = labels.get(KUBEFLOW_JOB), labels.get(KUBEFLOW_OPERATOR)
    if isinstance(job, str) and job and operator in _OPERATOR_KINDS:
        kind = _OPERATOR_KINDS[str(operator)]
        out.append(PodOwner(OwnerRef(KUBEFLOW, kind, namespace, job), None, KUBEFLOW_JOB))
    first: dict[OwnerRef, PodOwner] = {}
    for o in out:  # a label naming what an ownerReference names adds nothing (and must not drop its uid check)
        first.setdefault(o.ref, o)
    return tuple(first.values())


def _env(pod: Mapping[str, Any]) -> Iterable[tuple[str, str]]:
    for c in _dict(pod.get("spec")).get("containers") or []:
        for e in _dict(c).get("env") or []:
            e = _dict(e)
            if isinstance(e.get("name"), str) and isinstance(e.get("value"), str):
                yield e["name"], e["value"]


def _whole(text: str) -> int | None:
    text = text.strip()
    return int(text) if text.isdigit() and len(text) <= 6 else None


def size_from_env(pod: Mapping[str, Any]) -> tuple[int, str] | None:
    """(pods, where it was read) from the operators' env in the pod, or None when it says nothing usable."""
    env = dict(_env(pod))
    tf = env.get("TF_CONFIG")
    if tf is not None:
        try:
            cluster = _dict(_dict(json.loads(tf[:65536])).get("cluster"))
        except ValueError:
            cluster = {}
        tasks = [(t, len(v)) for t in _TF_GPU_TASKS if isinstance(v := cluster.get(t), list) and v]
        n = sum(c for _, c in tasks)
        if 1 <= n <= MAX_JOB_PODS:
            return n, "env TF_CONFIG cluster (" + " + ".join(f"{t} {c}" for t, c in tasks) + ")"
    nnodes = _whole(env.get("PET_NNODES", ""))
    if nnodes is not None and 1 <= nnodes <= MAX_JOB_PODS:
        return nnodes, "env PET_NNODES"
    world, nproc = _whole(env.get("WORLD_SIZE", "")), _whole(env.get("PET_NPROC_PER_NODE", "1"))
    if world and nproc and world % nproc == 0 and 1 <= world // nproc <= MAX_JOB_PODS:
        return world // nproc, "env WORLD_SIZE / PET_NPROC_PER_NODE"
    return None
