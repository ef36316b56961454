"""The contract between the node agent and the extender: names on the cluster, their defaults, and the plan format.

Both halves read and write the same annotations and labels; a name spelled in two places drifts, so every key is
built here from one prefix (`Keys`), and every default is defined once. The plan codec lives here because the
extender writes what the plugin reads: neither half owns it. docs/contracts.md shows the shapes.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from typing import Any

from gputopo.core.mig import MIG_RESOURCE_PREFIX, PROFILE_TABLES, advertised_by_mixed, resource_for

DEFAULT_PREFIX = "gpu-topology.io"
DEFAULT_RESOURCE = "nvidia.com/gpu"

PLAN_VERSION = 1
MAX_PLAN_CONTAINERS = 64
MAX_PLAN_IDS = 1024

_DNS_LABEL = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?"
_DNS_SUBDOMAIN_RE = re.compile(rf"^{_DNS_LABEL}(\.{_DNS_LABEL})*$")
_QUALIFIED_NAME_RE = re.compile(r"^([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]$")


def dns_subdomain_problem(value: str) -> str | None:
    """Why `value` is not a DNS subdomain (the form of an annotation prefix and a resource domain), or None."""
    if not value or len(value) > 253:
        return f"{value!r} must be 1-253 characters"
    if not _DNS_SUBDOMAIN_RE.match(value):
        return f"{value!r} is not a DNS subdomain (lowercase letters, digits, '-' and '.')"
    return None


def prefix_problem(prefix: str) -> str | None:
    """Why `prefix` cannot prefix annotation and label keys, or None (the part before '/' must be a DNS subdomain)."""
    problem = dns_subdomain_problem(prefix)
    return f"annotation prefix {problem}" if problem else None


def extended_resource_problem(name: str) -> str | None:
    """Why `name` is not an extended resource name (what the kubelet's Register accepts), or None.

    Extended resources are `domain/name`, outside the kubernetes.io domains, and `requests.` + name must still be
    a qualified name (the kubelet checks that form for quota)."""
    if "/" not in name:
        return f"resource name {name!r} needs a domain: domain/name"
    if "kubernetes.io/" in name:
        return f"resource name {name!r} is in a kubernetes.io domain, reserved for native resources"
    if name.startswith("requests."):
        return f"resource name {name!r} must not start with 'requests.'"
    prefix, _, local = name.rpartition("/")
    if "/" in prefix:
        return f"resource name {name!r} has more than one '/'"
    problem = dns_subdomain_problem(prefix)
    if problem:
        return f"resource name domain {problem}"
    if len(local) > 63 or not _QUALIFIED_NAME_RE.match(local):
        return (
            f"resource name {name!r}: {local!r} must be 1-63 alphanumerics, '-', '_' or '.', alphanumeric at both ends"
        )
    return None


@dataclass(frozen=True)
class Keys:
    """Every annotation and label key of the product, from one validated prefix."""

    prefix: str = DEFAULT_PREFIX

    def __post_init__(self) -> None:
        problem = prefix_problem(self.prefix)
        if problem:
            raise ValueError(problem)

    def _key(self, name: str) -> str:
        return f"{self.prefix}/{name}"

    # Node annotations (written by the plugin).
    @property
    def topology(self) -> str:
        """Node annotation: the node's GPUs, their links, NUMA nodes and NICs as versioned JSON (docs/contracts.md),
        which the extender plans on; rewritten only when the hardware changes."""
        return self._key("topology")

    @property
    def state(self) -> str:
        """Node annotation: which GPUs are used or unhealthy now (and, with sharing or MIG, replicas and instances),
        with a generation, so the extender knows what is free without asking the kubelet."""
        return self._key("state")

    def free_gpus_label(self, resource: str) -> str | None:
        """Node label: how many GPUs have a free replica of the shared resource `resource` now. A pod asking k
        replicas needs k distinct GPUs, which no count of replicas says; the webhook turns that into node
        affinity on this label (Gt k-1), so kube-scheduler's own filter and node autoscalers read it. None when
        the resource's name is too long for a label key."""
        name = f"free-gpus.{resource.rpartition('/')[2]}"
        return self._key(name) if len(name) <= 63 else None

    def is_free_gpus_label(self, key: str) -> bool:
        return key.startswith(self._key("free-gpus."))

    def one_replica_label(self, resource: str) -> str | None:
        """Node label: `"true"` while the node's sharing config sets failRequestsGreaterThanOne for the shared
        resource `resource`, so its plugin refuses a container asking more than one replica. No replica count says
        that, so node autoscalers read such a node as fitting the pod; the webhook turns a container's request of
        two or more into node affinity `DoesNotExist` on this label, which kube-scheduler's own filter and the
        autoscalers' simulation read. Absent where the flag is false. None when the name is too long for a label."""
        name = f"one-replica-per-container.{resource.rpartition('/')[2]}"
        return self._key(name) if len(name) <= 63 else None

    def is_one_replica_label(self, key: str) -> bool:
        return key.startswith(self._key("one-replica-per-container."))

    @property
    def autoscaler_hold(self) -> str:
        """Node annotation: the autoscaler annotations (CA_SCALE_DOWN_DISABLED, KARPENTER_DO_NOT_DISRUPT) the plugin
        set itself, comma-separated, so it lifts only those (gpuplugin.autoscaler_hold)."""
        return self._key("autoscaler-hold")

    @property
    def device_plugin_label(self) -> str:
        """Node label the admin sets: `enabled` opts the node in to the plugin's DaemonSet (the chart's
        plugin.optIn), `nvidia` keeps it for NVIDIA's plugin. Never written or removed by the product."""
        return self._key("device-plugin")

    # Node labels (for humans and selectors).
    @property
    def fabric_label(self) -> str:
        """Node label: `nvswitch`, `nvlink` or `pcie`, how the node's GPUs are linked; require-nvlink becomes
        node affinity on it."""
        return self._key("fabric")

    @property
    def model_label(self) -> str:
        """Node label: the GPU model, for selectors and dashboards."""
        return self._key("gpu-model")

    @property
    def count_label(self) -> str:
        """Node label: how many GPUs the node has."""
        return self._key("gpu-count")

    def allreduce_label(self, size: int) -> str:
        """Node label: the best all-reduce GB/s (an integer, rounded down) of `size` GPUs on the empty node, one per
        size from 2 to the node's GPU count. Autoscalers re-run only the in-tree filters, so a pod's
        `min-allreduce-gbps` reaches them as required node affinity on this label (Gt), which node-group templates
        can carry for scale from zero."""
        return self._key(f"allreduce-gbps-{size}")

    def nvlink_ring_label(self, size: int) -> str:
        """Node label: `"true"` or `"false"`, whether `size` GPUs of the empty node can form a ring on NVLink alone
        (gputopo.core.nvlink_ring_sizes, the extender's own test for `require-nvlink`), one per size from 2 to the
        node's GPU count. The fabric label says only that some NVLink exists: on NVLink-bridge pairs or a DGX-1
        cube mesh an autoscaler would read a node as fitting a pod the extender refuses there for good. The webhook
        adds `NotIn [false]` on it for a `require-nvlink` pod of that size (a node without the label: the extender
        alone decides, as before)."""
        return self._key(f"nvlink-ring-{size}")

    # What the plugin owns on its Node: the node is left as it was when these go (uninstall, opt-out).
    @property
    def published_annotations(self) -> tuple[str, ...]:
        """The Node annotations the plugin writes and nobody else does (the autoscaler hold aside: it names which
        of the shared autoscaler annotations it set, gpuplugin.autoscaler_hold.release)."""
        return (self.topology, self.state, self.autoscaler_hold)

    def is_published_label(self, key: str) -> bool:
        """Whether a Node label is one the plugin writes: fabric, gpu-model, gpu-count, allreduce-gbps-<k>,
        nvlink-ring-<k>, free-gpus.<resource>, one-replica-per-container.<resource>. The admin's opt-in label
        (device_plugin_label) is not: it is the admin's."""
        if key in (self.fabric_label, self.model_label, self.count_label) or self.is_free_gpus_label(key) \
                or self.is_one_replica_label(key):
            return True
        for prefix in (self._key("allreduce-gbps-"), self._key("nvlink-ring-")):
            size = key.removeprefix(prefix)
            if size != key and size.isdigit():
                return True
        return False

    # Pod annotations written by the extender at bind, and by the plugin at Allocate.
    @property
    def plan(self) -> str:
        """Pod annotation: the GPU ids per container the extender chose at bind (versioned JSON); the plugin's
        GetPreferredAllocation and Allocate honour it."""
        return self._key("plan")

    @property
    def gbps(self) -> str:
        """Pod annotation: the estimated all-reduce GB/s of the planned GPUs; also in the runtime annotations of a
        container's Allocate response."""
        return self._key("allreduce-gbps")

    @property
    def gpus(self) -> str:
        """Container annotation in the Allocate response (for the runtime, not on the Pod): the GPU ids the container
        got, comma-separated."""
        return self._key("gpus")

    @property
    def requeued(self) -> str:
        """Pod annotation: when the extender last touched a pod it had refused, so that kube-scheduler retries it:
        a refusal of ours that ended by time alone comes with no cluster event (extender.requeue)."""
        return self._key("requeued")

    @property
    def placement(self) -> str:
        """Pod annotation: why the extender chose this node and these GPUs (extender.placement.explain), next to
        the plan; for humans."""
        return self._key("placement")

    # Pod annotations a user may set.
    @property
    def require_nvlink(self) -> str:
        """Pod annotation a user may set: `"true"` places a multi-GPU pod only on GPUs joined by NVLink or NVSwitch."""
        return self._key("require-nvlink")

    @property
    def min_gbps(self) -> str:
        """Pod annotation a user may set: the least estimated all-reduce GB/s a multi-GPU pod accepts."""
        return self._key("min-allreduce-gbps")

    # Pod annotations a user may set to place the pods of one job together (extender.membership.job).
    @property
    def job(self) -> str:
        """Pod annotation a user may set: the job's name, where nothing the ecosystem writes (Kubeflow, JobSet, LWS,
        PodGroups) says it, so the job's pods are placed together."""
        return self._key("job")

    @property
    def job_size(self) -> str:
        """Pod annotation a user may set: how many GPU pods the job has, with `job`."""
        return self._key("job-size")

    # Labels a user may set (extender.webhook).
    @property
    def webhook(self) -> str:
        """Pod and namespace label a user may set: `disabled` keeps the admission webhook from setting the pod's
        schedulerName; `enabled` opts a namespace (or pod) in when the webhook runs opt-in."""
        return self._key("webhook")

    # Labels of the extender's own Pods.
    @property
    def extender_role(self) -> str:
        """Pod label of an extender replica under leader election: `leader` or `standby`. The Service
        kube-scheduler calls selects `leader`, so only the Lease holder gets its requests."""
        return self._key("extender-role")


DEFAULT_KEYS = Keys()

# Fabric label values whose GPUs have NVLink between them: what a pod's require-nvlink becomes as node affinity.
NVLINK_FABRICS = ("nvswitch", "nvlink")


# -- DRA device names ----------------------------------------------------------------------------------------------
# The DRA driver names each device by its GPUs (gpuplugin.dra.catalog.device_name): `gpu-3` and `one-3` (the two
# single-GPU groups), `set-0-1-2-3` (members ascending); the extender reads a claim's allocated device names back
# into GPUs (extender.state.slices).
DRA_RINGS = "gpu"  # group (and name prefix) of the singles whose first N free form good rings
DRA_ONE = "one"  # group (and name prefix) of the singles in the order successive 1-GPU claims take them
DRA_SET = "set"
_DRA_DEVICE_RE = re.compile(r"^(?:(gpu|one)-(\d+)|set-(\d+(?:-\d+)+))$")


def parse_dra_device(name: str) -> tuple[str, tuple[int, ...]] | None:
    """(group, GPU indices) a device name of our driver spells: ("gpu", (3,)), ("one", (3,)), ("set", (0, 1, 2,
    3)); None for any other name (shared GPUs, MIG instances, members out of order, another driver's)."""
    m = _DRA_DEVICE_RE.match(name)
    if m is None:
        return None
    if m.group(1):
        return m.group(1), (int(m.group(2)),)
    members = tuple(int(x) for x in m.group(3).split("-"))
    return (DRA_SET, members) if list(members) == sorted(set(members)) else None


# -- node autoscalers (docs/reference/autoscaling.md) --------------------------------------------------------------
# Taints the Cluster Autoscaler and Karpenter put on nodes they are removing, or may remove: nothing new is placed
# on the first kind, and the soft kind is passed over among equally good nodes so the node can empty.
CA_TO_BE_DELETED_TAINT = "ToBeDeletedByClusterAutoscaler"
CA_DELETION_CANDIDATE_TAINT = "DeletionCandidateOfClusterAutoscaler"
KARPENTER_DISRUPTED_TAINT = "karpenter.sh/disrupted"
REMOVAL_TAINTS = (CA_TO_BE_DELETED_TAINT, KARPENTER_DISRUPTED_TAINT)
SOFT_REMOVAL_TAINTS = (CA_DELETION_CANDIDATE_TAINT,)
# Node annotations each autoscaler reads as "do not remove this node voluntarily".
CA_SCALE_DOWN_DISABLED = "cluster-autoscaler.kubernetes.io/scale-down-disabled"
KARPENTER_DO_NOT_DISRUPT = "karpenter.sh/do-not-disrupt"
# CA's default --scale-down-gpu-utilization-threshold: a GPU node whose GPU request ratio is below it may go.
CA_GPU_UTILIZATION_THRESHOLD = 0.5


# -- replicas of shared GPUs (time-slicing, MPS) ------------------------------------------------------------------
# NVIDIA's device plugin names the n-th replica of a GPU `<gpu id>::<n>` (NewAnnotatedID); teams migrating keep the
# ids they see in PodResources and logs. A plan for a shared resource lists parent GPU ids, distinct: the extender
# knows how many replicas of a GPU are free, not which, and the plugin picks free replicas of those GPUs.

REPLICA_SEPARATOR = "::"


class ReplicaIdError(ValueError):
    """A device id that is not `<gpu id>::<n>`."""


def replica_id(gpu: str, n: int) -> str:
    return f"{gpu}{REPLICA_SEPARATOR}{n}"


def replica_parent(device_id: str) -> tuple[str, int]:
    """The GPU id and replica number of a replica id; raises ReplicaIdError for anything else."""
    gpu, sep, n = device_id.rpartition(REPLICA_SEPARATOR)
    if not sep or not gpu or not n.isdigit() or (len(n) > 1 and n[0] == "0"):
        raise ReplicaIdError(f"device id {device_id[:200]!r} is not a replica id <gpu id>::<n>")
    return gpu, int(n)


# -- MIG (issue 23) ------------------------------------------------------------------------------------------------
# NVIDIA's names: under the mixed strategy a MIG device is `<domain>/mig-<profile>` with `+` written as `.`
# (gputopo.core.mig.resource_for), under single the configured resource. Both halves build and recognise the name
# here; a plan for a MIG resource lists MIG UUIDs, the device ids NVIDIA's plugin uses for MIG devices.

MIG_STRATEGY_NONE, MIG_STRATEGY_SINGLE, MIG_STRATEGY_MIXED = "none", "single", "mixed"
MIG_NOT_ADVERTISED = "MIG devices are not advertised by this plugin (MIG strategy none)"


def mig_resource(profile: str, domain: str = DEFAULT_RESOURCE.split("/", 1)[0]) -> str:
    """`1g.18gb+me` -> `nvidia.com/mig-1g.18gb.me`; MigError for a name the mixed strategy advertises nothing as."""
    return f"{domain}/{resource_for(profile)}"


def is_mig_resource(name: str, domain: str = DEFAULT_RESOURCE.split("/", 1)[0]) -> bool:
    """Whether `name` has the form of a mixed-strategy MIG resource in `domain` (the profile may still be unknown:
    gputopo.core.mig.profile_for_resource says so, naming it)."""
    return name.startswith(f"{domain}/{MIG_RESOURCE_PREFIX}") and len(name) > len(domain) + 1 + len(
        MIG_RESOURCE_PREFIX)


def mig_resource_suffixes() -> tuple[str, ...]:
    """Every resource NVIDIA's mixed strategy advertises for the models of gputopo.core.mig's tables, without a
    domain (`mig-1g.10gb`, `mig-1g.10gb.me`), sorted: what kube-scheduler's managedResources must list, since it
    matches extender resources by exact name (deploy/ is generated from this: scripts/gen_managed_resources.py)."""
    return tuple(sorted({resource_for(p.name) for t in PROFILE_TABLES for p in t.profiles
                         if advertised_by_mixed(p.name)}))


def mig_none_reason(gpus: int) -> str:
    """The reason a node with MIG GPUs under strategy `none` publishes (the issue: out, but said on the node)."""
    return f"{MIG_NOT_ADVERTISED}: {gpus} MIG-enabled GPU{'s' if gpus != 1 else ''} left out"


# -- the plan -----------------------------------------------------------------------------------------------------


class PlanFormatError(ValueError):
    """A plan annotation that is not the versioned JSON of docs/contracts.md."""


@dataclass(frozen=True)
class Plan:
    """GPU ids per container on one node, with the all-reduce estimate of their union."""

    node: str
    resource: str
    containers: tuple[tuple[str, tuple[str, ...]], ...]
    gbps: float

    @property
    def ids(self) -> frozenset[str]:
        return frozenset(i for _, ids in self.containers for i in ids)

    def container_ids(self) -> dict[str, list[str]]:
        return {name: list(ids) for name, ids in self.containers}


def encode_plan(plan: Plan) -> str:
    """Compact JSON for the `<prefix>/plan` pod annotation."""
    body = {
        "v": PLAN_VERSION,
        "node": plan.node,
        "resource": plan.resource,
        "containers": {name: list(ids) for name, ids in plan.containers},
        "gbps": round(plan.gbps, 3),
    }
    return json.dumps(body, separators=(",", ":"))


def parse_plan(text: Any) -> Plan:
    """Read a plan annotation; raises PlanFormatError naming what is wrong (someone else may have written it)."""
    if not isinstance(text, (str, bytes)):
        raise PlanFormatError(f"plan annotation must be a string, got {type(text).__name__}")
    try:
        data = json.loads(text)
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        raise PlanFormatError(f"plan annotation is not JSON: {e}") from None
    if not isinstance(data, dict):
        raise PlanFormatError("plan JSON must be an object")
    version = data.get("v")
    if version != PLAN_VERSION or isinstance(version, bool):
        raise PlanFormatError(f"plan JSON version {version!r} is not {PLAN_VERSION}")
    node, resource = data.get("node"), data.get("resource")
    if not isinstance(node, str) or not node:
        raise PlanFormatError("plan 'node' must be a non-empty string")
    if not isinstance(resource, str) or not resource:
        raise PlanFormatError("plan 'resource' must be a non-empty string")
    raw = data.get("containers")
    if not isinstance(raw, dict) or not raw or len(raw) > MAX_PLAN_CONTAINERS:
        raise PlanFormatError(f"plan 'containers' must map 1-{MAX_PLAN_CONTAINERS} container names to id lists")
    containers = []
    total = 0
    for name, ids in raw.items():
        if not name:
            raise PlanFormatError("plan container name must not be empty")
        if not isinstance(ids, list) or not ids or not all(isinstance(i, str) and i for i in ids):
            raise PlanFormatError(f"plan container {name!r} must list non-empty GPU id strings")
        if len(set(ids)) != len(ids):
            raise PlanFormatError(f"plan container {name!r} lists a GPU twice")
        total += len(ids)
        containers.append((name, tuple(ids)))
    if total > MAX_PLAN_IDS:
        raise PlanFormatError(f"plan lists {total} GPU ids, more than {MAX_PLAN_IDS}")
    gbps = data.get("gbps", 0.0)
    if isinstance(gbps, bool) or not isinstance(gbps, (int, float)) or not math.isfinite(gbps) or gbps < 0:
        raise PlanFormatError("plan 'gbps' must be a non-negative number")
    return Plan(node, resource, tuple(containers), float(gbps))
