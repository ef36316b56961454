"""One AdmissionReview v1 request in, its answer out: whether to set the pod's schedulerName, and the JSONPatch.

The rule (issue 13): a pod being created that asks for the managed resource, its shared name (`nvidia.com/gpu.shared`:
NVIDIA's renameByDefault), a MIG resource of its domain (`nvidia.com/mig-1g.10gb`, shared ones too, issue 23:
gputopo.contract.is_mig_resource) or one of `--extra-resources` (the names sharing configs give under `rename`),
counted as the kubelet counts it, init containers included (gputopo.podspec), and names no scheduler of its own
(none, "" or "default-scheduler") gets
`spec.schedulerName` set to the topology-aware scheduler; with `--dra-claims`, so does a pod with resource claims
(DRA mode: the extender ranks the DRA nodes for it); with `--whole-jobs`, so does a pod of a Kubeflow job
(label `training.kubeflow.org/job-name`) that asks none, such as a TFJob's parameter server, so that the extender
places it in the rack of the job's workers. A pod it gives the scheduler, or that already names it, also gets its
`require-nvlink` and `min-allreduce-gbps` annotations as required node affinity on the plugin's node labels
(extender.webhook.affinity), so that node autoscalers, which skip the extender, see them. Anything else is
answered `allowed: true` with no patch:
another scheduler's pod, a pod without GPUs, a pod labelled `<prefix>/webhook: disabled`, a pod already bound
(`spec.nodeName`), an operation or kind it does not manage. The webhook never refuses a pod: what it cannot read it
leaves alone, with a warning the client sees (`kubectl` prints it), since the API server then validates the pod.

The answer's shape is the one a real kube-apiserver v1.36 accepted (fixtures/recordings/kube-apiserver-admission):
`{"apiVersion", "kind": "AdmissionReview", "response": {"uid", "allowed": true, "patchType": "JSONPatch",
"patch": <base64 JSON>}}`, the uid copied from the request.
"""

from __future__ import annotations

import base64
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import orjson

from extender.membership.job import KUBEFLOW_JOB
from extender.webhook.affinity import topology_affinity
from gputopo.contract import DEFAULT_KEYS, Keys, is_mig_resource
from gputopo.podspec import PodSpecError, container_needs, effective_count, pod_device_count

API_VERSION = "admission.k8s.io/v1"
SHARED_SUFFIX = ".shared"  # NVIDIA's renameByDefault name of a shared resource (DefaultSharedResourceNameSuffix)
DEFAULT_SCHEDULERS = frozenset({"", "default-scheduler"})
OPT_OUT = "disabled"
MAX_UID = 128  # a UID is 36 characters; anything far longer is not one
# The API server asks webhooks to keep warnings to 120 characters and may truncate longer ones.
MAX_WARNING = 120
LEFT = "gpu-topology webhook left the pod to its scheduler"  # every warning starts so: what happened comes first

# Outcomes (the metrics label and the log field).
PATCHED = "patched"
NOT_MANAGED = "not_managed"  # another operation, kind or subresource
OTHER_SCHEDULER = "other_scheduler"
ALREADY_OURS = "already_ours"
NO_GPUS = "no_gpus"
OPTED_OUT = "opted_out"
ALREADY_BOUND = "already_bound"
UNREADABLE_POD = "unreadable_pod"
ERROR = "error"
OUTCOMES = (PATCHED, NOT_MANAGED, OTHER_SCHEDULER, ALREADY_OURS, NO_GPUS, OPTED_OUT, ALREADY_BOUND, UNREADABLE_POD,
            ERROR)


class ReviewError(ValueError):
    """The body is not an AdmissionReview request that can be answered (no request uid to answer to): HTTP 400,
    which the API server treats as a failed call (failurePolicy Ignore: the pod is admitted unchanged)."""


@dataclass(frozen=True)
class Policy:
    """What the webhook manages and what it sets."""

    scheduler_name: str
    resource: str
    opt_out_label: str
    whole_jobs: bool = False  # also the pods of a Kubeflow job that ask no GPUs (a TFJob's parameter servers)
    extra_resources: tuple[str, ...] = ()  # names sharing configs advertise under `rename`
    keys: Keys = DEFAULT_KEYS  # the constraint annotations and node labels of extender.webhook.affinity
    topology_affinity: bool = True  # constraints as node affinity (extender.webhook.affinity)
    # names GPU sharing configs advertise as replicas (the resource itself where a config does not rename it)
    replica_resources: tuple[str, ...] = ()
    dra_claims: bool = False  # also pods with resource claims (DRA mode: the extender ranks DRA nodes for them)

    @property
    def resources(self) -> tuple[str, ...]:
        """The names it manages by exact name (MIG names of the domain are matched by their form)."""
        return tuple(dict.fromkeys((self.resource, f"{self.resource}{SHARED_SUFFIX}", *self.extra_resources)))


@dataclass(frozen=True)
class Review:
    api_version: str
    uid: str
    request: Mapping[str, Any]

    @property
    def pod_name(self) -> str:
        """namespace/name, or namespace/generateName* for a pod whose name the API server has not chosen yet."""
        ns = self.request.get("namespace")
        name = self.request.get("name")
        if not name:
            meta = _dict(_dict(self.request.get("object")).get("metadata"))
            name = f"{meta.get('generateName') or ''}*"
        return f"{ns if isinstance(ns, str) else ''}/{name}"


@dataclass(frozen=True)
class Decision:
    outcome: str
    patch: tuple[dict[str, Any], ...] = ()
    warning: str | None = None
    gpus: int = 0


def _dict(value: Any) -> Mapping[str, Any]:
    return value if isinstance(value, dict) else {}


def read_review(data: Any) -> Review:
    """The review's version, uid and request. Raises ReviewError when there is nothing to answer to."""
    if not isinstance(data, dict):
        raise ReviewError("expected an AdmissionReview object")
    if data.get("kind") != "AdmissionReview" or data.get("apiVersion") != API_VERSION:
        raise ReviewError(f"expected kind AdmissionReview, apiVersion {API_VERSION} (the webhook's "
                          f"admissionReviewVersions), got {str(data.get('kind'))[:40]!r} "
                          f"{str(data.get('apiVersion'))[:40]!r}")
    request = data.get("request")
    if not isinstance(request, dict):
        raise ReviewError("AdmissionReview has no request object")
    uid = request.get("uid")
    if not isinstance(uid, str) or not uid or len(uid) > MAX_UID:
        raise ReviewError(f"request.uid must be a non-empty string of at most {MAX_UID} characters")
    return Review(API_VERSION, uid, request)


def _managed_operation(request: Mapping[str, Any]) -> bool:
    kind = _dict(request.get("kind"))
    return (request.get("operation") == "CREATE" and kind.get("group") == "" and kind.get("kind") == "Pod"
            and not request.get("subResource"))


def warning(text: str) -> str:
    """A warning as the API server passes it on: printable, one line, at most MAX_WARNING characters."""
    clean = "".join(ch if ch.isprintable() else " " for ch in text)
    return clean if len(clean) <= MAX_WARNING else clean[:MAX_WARNING - 3] + "..."


def decide(request: Mapping[str, Any], policy: Policy) -> Decision:
    """Whether to set this pod's schedulerName; never raises for anything in the request."""
    if not _managed_operation(request):
        return Decision(NOT_MANAGED)
    pod = request.get("object")
    if not isinstance(pod, dict):
        return Decision(UNREADABLE_POD, warning=warning(f"{LEFT}: the review carries no pod object"))
    spec = pod.get("spec")
    if not isinstance(spec, dict):
        return Decision(UNREADABLE_POD, warning=warning(f"{LEFT}: the pod has no spec object"))
    scheduler = spec.get("schedulerName")
    if scheduler == policy.scheduler_name:
        if spec.get("nodeName") or _dict(_dict(pod.get("metadata")).get("labels")).get(policy.opt_out_label) == OPT_OUT:
            return Decision(ALREADY_OURS)
        ops, problem = _affinity(pod, policy)
        return Decision(ALREADY_OURS, tuple(ops), warning=problem)
    if scheduler is not None and not (isinstance(scheduler, str) and scheduler in DEFAULT_SCHEDULERS):
        return Decision(OTHER_SCHEDULER)  # never override another scheduler (a string or not: not ours to fix)
    labels = _dict(_dict(pod.get("metadata")).get("labels"))
    if labels.get(policy.opt_out_label) == OPT_OUT:
        return Decision(OPTED_OUT)
    if spec.get("nodeName"):
        return Decision(ALREADY_BOUND)  # no scheduler will see it
    try:
        gpus = sum(pod_device_count(pod, r) for r in (*policy.resources, *mig_resources(spec, policy.resource)))
    except PodSpecError as e:
        return Decision(UNREADABLE_POD, warning=warning(f"{LEFT}: {e}"))
    claims = spec.get("resourceClaims")
    if gpus == 0 and not (policy.whole_jobs and isinstance(labels.get(KUBEFLOW_JOB), str)) and not (
            policy.dra_claims and isinstance(claims, list) and claims):
        return Decision(NO_GPUS)
    ops, problem = _affinity(pod, policy)
    patch = ({"op": "add", "path": "/spec/schedulerName", "value": policy.scheduler_name}, *ops)
    return Decision(PATCHED, patch, warning=problem, gpus=gpus)


def _affinity(pod: Mapping[str, Any], policy: Policy) -> tuple[list[dict[str, Any]], str | None]:
    """The affinity operations for the pod's whole GPUs, and a warning when its constraint annotations are
    unreadable (the pod is still given the scheduler, whose extender refuses it with the same words)."""
    if not policy.topology_affinity:
        return [], None
    resource = policy.resource
    try:
        whole = pod_device_count(pod, resource)
        names = {f"{resource}{SHARED_SUFFIX}", *policy.replica_resources} - {resource}
        if resource in policy.replica_resources:  # a sharing config shares it unrenamed: replicas on those nodes
            names.add(resource)
        # per container: failRequestsGreaterThanOne bounds each Allocate, and the kubelet makes one per container
        needs = {name: container_needs(pod, name) for name in names}
    except PodSpecError:
        return [], None  # counted above with the other names: nothing more to say
    replicas = {name: effective_count(n) for name, n in needs.items()}
    largest = {name: max((c.count for c in n), default=0) for name, n in needs.items()}
    ops, problem = topology_affinity(pod, whole, policy.keys, replicas, largest)
    return ops, warning(f"gpu-topology webhook added no node affinity: {problem}") if problem else None


def mig_resources(spec: Mapping[str, Any], resource: str) -> list[str]:
    """The MIG resources of `resource`'s domain the pod's containers name in limits or requests (sorted; malformed
    parts are skipped here, pod_device_count names them)."""
    domain = resource.split("/", 1)[0]
    names: set[str] = set()
    for field in ("initContainers", "containers"):
        items = spec.get(field)
        for c in items if isinstance(items, list) else ():
            res = _dict(_dict(c).get("resources"))
            for part in (_dict(res.get("limits")), _dict(res.get("requests"))):
                names.update(k for k in part if isinstance(k, str) and is_mig_resource(k, domain))
    return sorted(names)


def failed(error: BaseException) -> Decision:
    """The answer when deciding itself failed: the pod goes on unchanged, and its creator is told."""
    return Decision(ERROR, warning=warning(f"{LEFT}: internal error ({type(error).__name__})"))


def answer(review: Review, decision: Decision) -> dict[str, Any]:
    """The AdmissionReview response: always allowed; the patch and the warning when there are."""
    response: dict[str, Any] = {"uid": review.uid, "allowed": True}
    if decision.patch:
        response["patchType"] = "JSONPatch"
        response["patch"] = base64.b64encode(orjson.dumps(list(decision.patch))).decode("ascii")
    if decision.warning:
        response["warnings"] = [decision.warning]
    return {"apiVersion": review.api_version, "kind": "AdmissionReview", "response": response}
