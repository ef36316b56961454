"""Which job a pod belongs to, read from what the ecosystem already writes on it, and how many GPU pods the job has.

Sources, highest precedence first. The first tier present decides the job; two sources of that tier naming
different groups are a conflict (the pod cannot be in two gangs); lower tiers are ignored (a Kubeflow job's pods
also carry the PodGroup its gang scheduler made for it: one job, seen twice).

1. Ours: annotation `<prefix>/job` (the job's name in the pod's namespace). An explicit statement wins.
2. The Kubernetes Workload API (feature gate GenericWorkload, alpha since 1.35); when a pod has both fields, the
   runtime PodGroup speaks (it is made from the Workload's template, so both name one group):
   - `spec.schedulingGroup.podGroupName` (1.36): the PodGroup object of scheduling.k8s.io/v1alpha2, whose
     `spec.schedulingPolicy.gang.minCount` is the size (kubernetes/kubernetes staging/src/k8s.io/api/scheduling/
     v1alpha2/types.go; kubernetes.io/docs/concepts/workloads/pods/scheduling-group);
   - `spec.workloadRef` {name, podGroup, podGroupReplicaKey} (1.35): the Workload of scheduling.k8s.io/v1alpha1,
     size `spec.podGroups[name=podGroup].policy.gang.minCount`; each replica key is a group of its own
     (kubernetes.io/docs/concepts/workloads/pods/workload-reference; KEP-4671).
3. A gang scheduler's PodGroup: scheduler-plugins coscheduling label `scheduling.x-k8s.io/pod-group` and Volcano
   annotation `scheduling.k8s.io/group-name` (volcano.sh/apis KubeGroupNameAnnotationKey), both sized by the
   PodGroup's `spec.minMember`; Kueue's plain pod group, label `kueue.x-k8s.io/pod-group-name`, sized by the
   annotation `kueue.x-k8s.io/pod-group-total-count`.
4. The workload controller's own labels: LeaderWorkerSet `leaderworkerset.sigs.k8s.io/name` + `group-index` (one
   group per replica; size annotation `leaderworkerset.sigs.k8s.io/size`), JobSet and Kubeflow Trainer v2
   `jobset.sigs.k8s.io/jobset-name` (kubernetes-sigs/jobset api/jobset/v1alpha2), Kubeflow training-operator and
   MPI operator `training.kubeflow.org/job-name` with `operator-name`, `replica-type`, `replica-index`, `job-role`
   (kubeflow/common pkg/apis/common/v1/constants.go). None of these carries a pod count.

Size, first found: our annotation `<prefix>/job-size` (GPU pods; it may accompany any tier), the owner object that
made the pod when the caller has seen it (`owners`, extender.membership.ownership: a PyTorchJob's, MPIJob's, TFJob's,
JobSet's... GPU replicas, CPU-only ones left out), the deciding source's own count (LWS size, Kueue total count),
the group object's minimum (PodGroup minMember, Workload minCount) when the caller has seen that object
(`group_sizes`), the operators' env in the pod (TF_CONFIG, PET_NNODES), else unknown, with the reason why
(`size_note`): the planner then places the pod near the members already placed. A group minimum counts every pod
of the group, GPU-less ones too (an MPIJob's launcher): the owner, or `<prefix>/job-size`, counts right.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Protocol

from gputopo.contract import Keys

MAX_JOB_PODS = 8192
MAX_NAME = 253
_NAME_RE = re.compile(r"^[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$")
_INT_RE = re.compile(r"^\s*\+?[0-9]{1,9}\s*$")

# Label and annotation keys written by others: spelled as their projects define them.
SCHEDULER_PLUGINS_POD_GROUP = "scheduling.x-k8s.io/pod-group"
VOLCANO_GROUP = "scheduling.k8s.io/group-name"
KUEUE_GROUP = "kueue.x-k8s.io/pod-group-name"
KUEUE_TOTAL = "kueue.x-k8s.io/pod-group-total-count"
LWS_NAME = "leaderworkerset.sigs.k8s.io/name"
LWS_GROUP_INDEX = "leaderworkerset.sigs.k8s.io/group-index"
LWS_WORKER_INDEX = "leaderworkerset.sigs.k8s.io/worker-index"
LWS_SIZE = "leaderworkerset.sigs.k8s.io/size"
JOBSET_NAME = "jobset.sigs.k8s.io/jobset-name"
JOBSET_REPLICATED_JOB = "jobset.sigs.k8s.io/replicatedjob-name"
JOBSET_JOB_INDEX = "jobset.sigs.k8s.io/job-index"
JOB_COMPLETION_INDEX = "batch.kubernetes.io/job-completion-index"
KUBEFLOW_JOB = "training.kubeflow.org/job-name"
KUBEFLOW_OPERATOR = "training.kubeflow.org/operator-name"
KUBEFLOW_REPLICA_TYPE = "training.kubeflow.org/replica-type"
KUBEFLOW_REPLICA_INDEX = "training.kubeflow.org/replica-index"
KUBEFLOW_ROLE = "training.kubeflow.org/job-role"


class Source(StrEnum):
    OWN = "annotation"
    POD_GROUP = "podgroup"  # spec.schedulingGroup (scheduling.k8s.io/v1alpha2 PodGroup)
    WORKLOAD = "workload"  # spec.workloadRef (scheduling.k8s.io/v1alpha1 Workload)
    COSCHEDULING = "coscheduling"
    VOLCANO = "volcano"
    KUEUE = "kueue"
    LWS = "leaderworkerset"
    JOBSET = "jobset"
    KUBEFLOW = "kubeflow"


_TIERS: tuple[tuple[Source, ...], ...] = (
    (Source.OWN,),
    (Source.POD_GROUP, Source.WORKLOAD),
    (Source.COSCHEDULING, Source.VOLCANO, Source.KUEUE),
    (Source.LWS, Source.JOBSET, Source.KUBEFLOW),
)


class GroupKind(StrEnum):
    """Objects whose minimum is a job's size, as the caller watches them."""

    K8S_POD_GROUP = "scheduling.k8s.io/v1alpha2 PodGroup"
    K8S_WORKLOAD = "scheduling.k8s.io/v1alpha1 Workload"
    COSCHEDULING_POD_GROUP = "scheduling.x-k8s.io/v1alpha1 PodGroup"
    VOLCANO_POD_GROUP = "scheduling.volcano.sh/v1beta1 PodGroup"


@dataclass(frozen=True, slots=True)
class GroupRef:
    kind: GroupKind
    namespace: str
    name: str
    pod_group: str | None = None  # a Workload's pod group


GroupSizes = Mapping[GroupRef, int]


@dataclass(frozen=True, slots=True)
class OwnerSize:
    """A pod's job size as its owner object (or, failing that, its env) gives it."""

    pods: int | None  # None: unknown
    said: str  # where it was read, or why it is unknown
    from_env: bool = False


class OwnerSizes(Protocol):
    """The owner objects seen (extender.membership.ownership): a pod's job size from the object that made its pods."""

    def size_of(self, pod: Mapping[str, Any]) -> OwnerSize: ...


class MembershipError(ValueError):
    """A pod's job cannot be read; the message names the field and the value."""


class ConflictingGroups(MembershipError):
    """Two sources of the deciding tier put the pod in different groups."""


class BadJobSize(MembershipError):
    """A job size that is not a whole number of pods in 1..MAX_JOB_PODS."""


class BadJobName(MembershipError):
    """A job or group name that is not a name (empty, too long, odd characters)."""


class MixedGpuCounts(MembershipError):
    """Members of one job ask different GPU counts: a job plan gives every member the same slot size."""


@dataclass(frozen=True, slots=True)
class JobRef:
    """A job's identity: unique per namespace and source (a JobSet and a PyTorchJob may share a name)."""

    namespace: str
    source: Source
    name: str

    @property
    def key(self) -> str:
        return f"{self.namespace}/{self.source.value}/{self.name}"

    def __str__(self) -> str:
        return f"{self.namespace}/{self.name}"


@dataclass(frozen=True, slots=True)
class Membership:
    job: JobRef
    size: int | None  # GPU pods the job has, when known
    size_from: str | None  # where the size was read, for reasons ("PodGroup minMember", "annotation ...")
    group: GroupRef | None  # the object whose minimum sizes the job, when the caller must look it up
    role: str | None  # replica type or role: "worker", "master", "leader"
    index: int | None
    size_note: str | None = None  # why the size is unknown (its owner cannot be read), for reasons and logs


@dataclass(frozen=True, slots=True)
class _Claim:
    source: Source
    name: str
    size: int | None = None
    size_from: str | None = None
    group: GroupRef | None = None
    base: str | None = None  # the group's name as another source of its tier would spell it (for conflicts)

    @property
    def same_as(self) -> str:
        return self.base or self.name


def _dict(value: Any) -> Mapping[str, Any]:
    return value if isinstance(value, dict) else {}


def _name(value: Any, where: str) -> str:
    if not isinstance(value, str) or not value:
        raise BadJobName(f"{where} must be a non-empty string, got {value!r:.80}")
    if len(value) > MAX_NAME or not _NAME_RE.match(value):
        raise BadJobName(f"{where}={value[:80]!r} is not a name (1-{MAX_NAME} letters, digits, '-', '_', '.')")
    return value


def parse_size(value: Any, where: str) -> int:
    """A pod count: a whole number in 1..MAX_JOB_PODS, as an int or a decimal string."""
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise BadJobSize(f"{where} must be a whole number of pods, got {value!r:.80}")
    if isinstance(value, str):
        if not _INT_RE.match(value):
            raise BadJobSize(f"{where}={value[:80]!r} is not a whole number of pods")
        value = int(value)
    if not 1 <= value <= MAX_JOB_PODS:
        raise BadJobSize(f"{where}={value} is outside 1..{MAX_JOB_PODS} pods")
    return value


def _index(value: Any) -> int | None:
    return int(value) if isinstance(value, str) and _INT_RE.match(value) else None


def _claims(pod: Mapping[str, Any], keys: Keys, namespace: str) -> dict[Source, _Claim]:
    meta = _dict(pod.get("metadata"))
    labels, ann, spec = _dict(meta.get("labels")), _dict(meta.get("annotations")), _dict(pod.get("spec"))
    out: dict[Source, _Claim] = {}
    if keys.job in ann:
        out[Source.OWN] = _Claim(Source.OWN, _name(ann[keys.job], f"annotation {keys.job}"))
    sg = spec.get("schedulingGroup")
    if sg is not None:
        name = _name(_dict(sg).get("podGroupName"), "spec.schedulingGroup.podGroupName")
        out[Source.POD_GROUP] = _Claim(Source.POD_GROUP, name,
                                       group=GroupRef(GroupKind.K8S_POD_GROUP, namespace, name))
    wr = spec.get("workloadRef")
    if wr is not None:
        wr = _dict(wr)
        workload = _name(wr.get("name"), "spec.workloadRef.name")
        group = _name(wr.get("podGroup"), "spec.workloadRef.podGroup")
        replica = wr.get("podGroupReplicaKey")
        name = f"{workload}/{group}" + (f"/{_name(replica, 'spec.workloadRef.podGroupReplicaKey')}" if replica else "")
        out[Source.WORKLOAD] = _Claim(Source.WORKLOAD, name,
                                      group=GroupRef(GroupKind.K8S_WORKLOAD, namespace, workload, group))
    if SCHEDULER_PLUGINS_POD_GROUP in labels:
        name = _name(labels[SCHEDULER_PLUGINS_POD_GROUP], f"label {SCHEDULER_PLUGINS_POD_GROUP}")
        out[Source.COSCHEDULING] = _Claim(Source.COSCHEDULING, name,
                                          group=GroupRef(GroupKind.COSCHEDULING_POD_GROUP, namespace, name))
    if VOLCANO_GROUP in ann:
        name = _name(ann[VOLCANO_GROUP], f"annotation {VOLCANO_GROUP}")
        out[Source.VOLCANO] = _Claim(Source.VOLCANO, name, group=GroupRef(GroupKind.VOLCANO_POD_GROUP, namespace, name))
    if KUEUE_GROUP in labels:
        total = ann.get(KUEUE_TOTAL)
        size = parse_size(total, f"annotation {KUEUE_TOTAL}") if total is not None else None
        out[Source.KUEUE] = _Claim(Source.KUEUE, _name(labels[KUEUE_GROUP], f"label {KUEUE_GROUP}"), size,
                                   KUEUE_TOTAL if size else None)
    if LWS_NAME in labels:
        lws = _name(labels[LWS_NAME], f"label {LWS_NAME}")
        group_index = _index(labels.get(LWS_GROUP_INDEX))
        if group_index is None:
            raise BadJobName(f"label {LWS_GROUP_INDEX}={labels.get(LWS_GROUP_INDEX)!r:.80} is not a group index")
        raw = ann.get(LWS_SIZE)
        size = parse_size(raw, f"annotation {LWS_SIZE}") if raw is not None else None
        out[Source.LWS] = _Claim(Source.LWS, f"{lws}/{group_index}", size, LWS_SIZE if size else None, base=lws)
    if JOBSET_NAME in labels:
        out[Source.JOBSET] = _Claim(Source.JOBSET, _name(labels[JOBSET_NAME], f"label {JOBSET_NAME}"))
    if KUBEFLOW_JOB in labels:
        job = _name(labels[KUBEFLOW_JOB], f"label {KUBEFLOW_JOB}")
        operator = labels.get(KUBEFLOW_OPERATOR)  # a PyTorchJob and an MPIJob may share a name in one namespace
        name = f"{_name(operator, f'label {KUBEFLOW_OPERATOR}')}/{job}" if operator is not None else job
        out[Source.KUBEFLOW] = _Claim(Source.KUBEFLOW, name, base=job)
    return out


def _role_and_index(pod: Mapping[str, Any]) -> tuple[str | None, int | None]:
    labels = _dict(_dict(pod.get("metadata")).get("labels"))
    role = labels.get(KUBEFLOW_REPLICA_TYPE) or labels.get(KUBEFLOW_ROLE) or labels.get(JOBSET_REPLICATED_JOB)
    if role is None and LWS_WORKER_INDEX in labels:
        role = "leader" if labels[LWS_WORKER_INDEX] == "0" else "worker"
    index = None
    for key in (KUBEFLOW_REPLICA_INDEX, LWS_WORKER_INDEX, JOB_COMPLETION_INDEX):
        index = _index(labels.get(key))
        if index is not None:
            break
    return (str(role).lower()[:63] if isinstance(role, str) and role else None), index


def job_membership(pod: Any, keys: Keys, group_sizes: GroupSizes | None = None,
                   owners: OwnerSizes | None = None) -> Membership | None:
    """The pod's job, or None when nothing says it belongs to one. Raises MembershipError subclasses."""
    if not isinstance(pod, dict):
        raise MembershipError("Pod must be an object")
    namespace = str(_dict(pod.get("metadata")).get("namespace") or "default")
    claims = _claims(pod, keys, namespace)
    for tier in _TIERS:
        present = [claims[s] for s in tier if s in claims]
        if not present:
            continue
        if tier is not _TIERS[1] and len({c.same_as for c in present}) > 1:
            said = ", ".join(f"{c.source.value} {c.name!r}" for c in present)
            raise ConflictingGroups(f"pod is put in different groups of one kind: {said}")
        decided = present[0]
        size, size_from, note = _size(pod, keys, decided, group_sizes, owners)
        role, index = _role_and_index(pod)
        return Membership(JobRef(namespace, decided.source, decided.name), size, size_from, decided.group, role,
                          index, note)
    ann = _dict(_dict(pod.get("metadata")).get("annotations"))
    if keys.job_size in ann:
        raise MembershipError(f"annotation {keys.job_size} without a job: set {keys.job} too")
    return None


def _size(pod: Mapping[str, Any], keys: Keys, claim: _Claim, group_sizes: GroupSizes | None,
          owners: OwnerSizes | None) -> tuple[int | None, str | None, str | None]:
    """(size, where it was read, why it is unknown). The owner object comes before the deciding source's count and
    the group minimum: it counts the GPU pods only (a PodGroup's minMember counts an MPIJob's launcher too), and its
    LeaderWorkerSet groups leave a leader asking no GPU out. Env (read by `owners` where the owner cannot be) comes
    after both."""
    ann = _dict(_dict(pod.get("metadata")).get("annotations"))
    if keys.job_size in ann:
        return parse_size(ann[keys.job_size], f"annotation {keys.job_size}"), f"annotation {keys.job_size}", None
    owned = owners.size_of(pod) if owners is not None else None
    if owned is not None and owned.pods is not None and not owned.from_env:
        return owned.pods, owned.said, None
    if claim.size is not None:
        return claim.size, f"annotation {claim.size_from}", None
    if claim.group is not None and group_sizes is not None:
        known = group_sizes.get(claim.group)
        if known is not None:
            k8s = claim.group.kind in (GroupKind.K8S_POD_GROUP, GroupKind.K8S_WORKLOAD)
            where = f"{claim.group.kind.value} {'minCount' if k8s else 'minMember'}"
            return parse_size(known, f"{where} of {claim.group.name}"), where, None
    if owned is not None and owned.pods is not None:
        return owned.pods, owned.said, None
    return None, None, owned.said if owned is not None else None


def group_sizes_of(obj: Any) -> dict[GroupRef, int]:
    """The sizes one watched group object gives (empty for a group without a gang minimum). Raises
    MembershipError on an object of a known kind whose minimum is not a pod count."""
    if not isinstance(obj, dict):
        raise MembershipError("group object must be an object")
    api, kind = obj.get("apiVersion"), obj.get("kind")
    meta, spec = _dict(obj.get("metadata")), _dict(obj.get("spec"))
    namespace = str(meta.get("namespace") or "default")
    name = _name(meta.get("name"), f"{kind} metadata.name")
    if kind == "PodGroup" and api == "scheduling.x-k8s.io/v1alpha1":
        ref = GroupRef(GroupKind.COSCHEDULING_POD_GROUP, namespace, name)
        return {ref: parse_size(spec.get("minMember"), f"PodGroup {name} spec.minMember")}
    if kind == "PodGroup" and api == "scheduling.volcano.sh/v1beta1":
        ref = GroupRef(GroupKind.VOLCANO_POD_GROUP, namespace, name)
        return {ref: parse_size(spec.get("minMember"), f"PodGroup {name} spec.minMember")}
    if kind == "PodGroup" and api == "scheduling.k8s.io/v1alpha2":
        gang = _dict(_dict(spec.get("schedulingPolicy")).get("gang"))
        if not gang:
            return {}  # basic policy: a group without a minimum
        ref = GroupRef(GroupKind.K8S_POD_GROUP, namespace, name)
        return {ref: parse_size(gang.get("minCount"), f"PodGroup {name} spec.schedulingPolicy.gang.minCount")}
    if kind == "Workload" and api == "scheduling.k8s.io/v1alpha1":
        out: dict[GroupRef, int] = {}
        groups = spec.get("podGroups")
        for i, group in enumerate(groups if isinstance(groups, list) else []):
            group = _dict(group)
            gang = _dict(_dict(group.get("policy")).get("gang"))
            if gang:
                pg = _name(group.get("name"), f"Workload {name} spec.podGroups[{i}].name")
                where = f"Workload {name} spec.podGroups[{i}].policy.gang.minCount"
                out[GroupRef(GroupKind.K8S_WORKLOAD, namespace, name, pg)] = parse_size(gang.get("minCount"), where)
        return out
    raise MembershipError(f"{api}/{kind} is not a group kind this reads")


def common_gpu_count(job: JobRef, members: Iterable[tuple[str, int]]) -> int | None:
    """The one GPU count the job's GPU members ask (pods asking none, such as a launcher, are not members of the
    plan), or None when no member asks any. Raises MixedGpuCounts naming two pods that disagree."""
    first: tuple[str, int] | None = None
    for name, count in members:
        if count <= 0:
            continue
        if first is None:
            first = (name, count)
        elif count != first[1]:
            raise MixedGpuCounts(
                f"job {job}: members ask different GPU counts ({first[0]} {first[1]}, {name} {count}); "
                "a job plan gives each member the same number of GPUs"
            )
    return first[1] if first else None
