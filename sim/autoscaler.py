"""The Cluster Autoscaler (CA) as pure functions: what CA believes fits, and when it grows or shrinks a node group.

CA never calls a scheduler extender: it re-runs kube-scheduler's in-tree PreFilter/Filter plugins on a snapshot
(docs/reference/autoscaling.md 1.2). `fits` is that check for the plugins that decide GPU placement (NodeUnschedulable,
TaintToleration, NodeAffinity, NodeResourcesFit), on Kubernetes-shaped dicts, so a benchmark or a control-plane test
can ask "would CA think this pod fits this node?" without CA. The rest are CA's scale-up and scale-down rules with
their defaults (section 4 of the reference); no I/O, no clock: callers pass `now`.

Not modelled in `fits`: NodePorts, volume plugins, InterPodAffinity, PodTopologySpread (none decide GPU fit here).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from decimal import Decimal, InvalidOperation
from typing import Any

from gputopo.podspec import affinity_matches, expression_matches, term_matches  # noqa: F401 (part of this model)

# -- defaults (docs/reference/autoscaling.md section 4) --------------------------------------------------------------
SCAN_INTERVAL_S = 10.0  # --scan-interval
POD_BUFFER_S = 2.0  # unschedulablePodTimeBuffer
GPU_POD_BUFFER_S = 30.0  # unschedulablePodWithGpuTimeBuffer: GPU nodes are expensive, pods arrive in batches
MAX_NODE_STARTUP_S = 15 * 60.0  # MaxNodeStartupTime: a starting node counts as upcoming capacity this long
SCALE_DOWN_UNNEEDED_S = 10 * 60.0  # --scale-down-unneeded-time
SCALE_DOWN_DELAY_AFTER_ADD_S = 10 * 60.0  # --scale-down-delay-after-add
GPU_UTILIZATION_THRESHOLD = 0.5  # --scale-down-gpu-utilization-threshold (GPU request ratio only)
MAX_SCALE_DOWN_PARALLELISM = 10  # --max-scale-down-parallelism: empty nodes removed at once
MAX_DRAIN_PARALLELISM = 1  # --max-drain-parallelism: non-empty nodes drained at once

# GPU resource names CA knows (utils/gpu/gpu.go); the first with allocatable is the node's GPU resource.
GPU_RESOURCES = ("nvidia.com/gpu", "habana.ai/gaudi", "gpu.intel.com/xe", "amd.com/gpu", "microsoft.com/directx")
SAFE_TO_EVICT = "cluster-autoscaler.kubernetes.io/safe-to-evict"
SAFE_TO_EVICT_LOCAL_VOLUMES = "cluster-autoscaler.kubernetes.io/safe-to-evict-local-volumes"
TO_BE_DELETED_TAINT = "ToBeDeletedByClusterAutoscaler"
UNSCHEDULABLE_TAINT = "node.kubernetes.io/unschedulable"

# kube-scheduler's wording (framework plugins), so tests and reports read like `kubectl describe pod`
AFFINITY_MISMATCH = "node(s) didn't match Pod's node affinity/selector"
UNSCHEDULABLE_NODE = "node(s) were unschedulable"
TOO_MANY_PODS = "Too many pods"

_FILTERED_EFFECTS = ("NoSchedule", "NoExecute")  # PreferNoSchedule is a scoring hint only
_SUFFIX = {
    "Ki": Decimal(2**10), "Mi": Decimal(2**20), "Gi": Decimal(2**30), "Ti": Decimal(2**40), "Pi": Decimal(2**50),
    "Ei": Decimal(2**60), "n": Decimal("1e-9"), "u": Decimal("1e-6"), "m": Decimal("1e-3"), "": Decimal(1),
    "k": Decimal(10**3), "M": Decimal(10**6), "G": Decimal(10**9), "T": Decimal(10**12), "P": Decimal(10**15),
    "E": Decimal(10**18),
}
_QUANTITY = re.compile(r"^([+-]?[0-9.]+(?:[eE][+-]?[0-9]+)?)(Ki|Mi|Gi|Ti|Pi|Ei|n|u|m|k|M|G|T|P|E)?$")


# -- quantities and pod requests -------------------------------------------------------------------------------------


def parse_quantity(value: Any) -> Decimal:
    """A Kubernetes quantity ("500m", "1Gi", "2", 2). Raises ValueError."""
    if isinstance(value, bool):
        raise ValueError(f"quantity {value!r} is not a number")
    if isinstance(value, int | float):
        return Decimal(str(value))
    m = _QUANTITY.match(str(value).strip())
    if not m:
        raise ValueError(f"quantity {value!r} is not a Kubernetes quantity")
    try:
        return Decimal(m.group(1)) * _SUFFIX[m.group(2) or ""]
    except InvalidOperation:
        raise ValueError(f"quantity {value!r} is not a Kubernetes quantity") from None


def amount(resource: str, value: Any) -> int:
    """The integer kube-scheduler compares: millicores for cpu, else the value rounded up (Quantity.Value)."""
    if isinstance(value, int) and not isinstance(value, bool) and resource != "cpu":
        return value  # the common case in simulations, without Decimal
    q = parse_quantity(value)
    return math.ceil(q * 1000) if resource == "cpu" else math.ceil(q)


def _dict(value: Any) -> Mapping[str, Any]:
    return value if isinstance(value, Mapping) else {}


def _list(value: Any) -> Sequence[Any]:
    return value if isinstance(value, list | tuple) else ()


def container_requests(container: Mapping[str, Any]) -> dict[str, int]:
    """Requests after API defaulting: a resource given only in limits is requested at its limit."""
    res = _dict(container.get("resources"))
    out = {k: amount(k, v) for k, v in _dict(res.get("limits")).items()}
    out.update({k: amount(k, v) for k, v in _dict(res.get("requests")).items()})
    return out


def _add(into: dict[str, int], more: Mapping[str, int]) -> None:
    for k, v in more.items():
        into[k] = into.get(k, 0) + v


def pod_requests(pod: Mapping[str, Any]) -> dict[str, int]:
    """What NodeResourcesFit charges a pod (resource.PodRequests): max(app containers + sidecars, each init container
    + the sidecars started before it), plus spec.overhead."""
    spec = _dict(pod.get("spec"))
    total: dict[str, int] = {}
    for c in _list(spec.get("containers")):
        _add(total, container_requests(_dict(c)))
    sidecars: dict[str, int] = {}
    init_peak: dict[str, int] = {}
    for c in _list(spec.get("initContainers")):
        req = container_requests(_dict(c))
        if _dict(c).get("restartPolicy") == "Always":  # sidecar: runs on beside everything after it
            _add(sidecars, req)
            step = dict(sidecars)
        else:
            step = dict(sidecars)
            _add(step, req)
        for k, v in step.items():
            init_peak[k] = max(init_peak.get(k, 0), v)
    _add(total, sidecars)
    for k, v in init_peak.items():
        total[k] = max(total.get(k, 0), v)
    _add(total, {k: amount(k, v) for k, v in _dict(spec.get("overhead")).items()})
    return {k: v for k, v in total.items() if v}


# -- the in-tree filters -------------------------------------------------------------------------------------------


def tolerates(toleration: Mapping[str, Any], taint: Mapping[str, Any]) -> bool:
    """v1.Toleration.ToleratesTaint: an empty effect matches every effect, an empty key (with Exists) every key."""
    effect = toleration.get("effect") or ""
    if effect and effect != taint.get("effect"):
        return False
    key = toleration.get("key") or ""
    if key and key != taint.get("key"):
        return False
    op = toleration.get("operator") or "Equal"
    if op == "Exists":
        return True
    if op == "Equal":
        return (toleration.get("value") or "") == (taint.get("value") or "")
    return False


def untolerated_taint(pod: Mapping[str, Any], node: Mapping[str, Any]) -> Mapping[str, Any] | None:
    """The first NoSchedule/NoExecute taint none of the pod's tolerations tolerates (TaintToleration Filter)."""
    tolerations = [_dict(t) for t in _list(_dict(pod.get("spec")).get("tolerations"))]
    for taint in _list(_dict(node.get("spec")).get("taints")):
        taint = _dict(taint)
        if taint.get("effect") not in _FILTERED_EFFECTS:
            continue
        if not any(tolerates(t, taint) for t in tolerations):
            return taint
    return None


def allocatable(node: Mapping[str, Any]) -> dict[str, int]:
    return {k: amount(k, v) for k, v in _dict(_dict(node.get("status")).get("allocatable")).items()}


def insufficient(requests: Mapping[str, int], alloc: Mapping[str, int], used: Mapping[str, int]) -> list[str]:
    """NodeResourcesFit: every requested resource (zero requests skipped) within allocatable minus requested; a
    resource the node does not advertise has none. The pod count is checked when the node advertises `pods`."""
    out = []
    if "pods" in alloc and used.get("pods", 0) + 1 > alloc["pods"]:
        out.append(TOO_MANY_PODS)
    for name, want in sorted(requests.items()):
        if name == "pods" or want <= 0:
            continue
        if want > alloc.get(name, 0) - used.get(name, 0):
            out.append(f"Insufficient {name}")
    return out


def fits(pod: Mapping[str, Any], node: Mapping[str, Any], used: Mapping[str, int],
         requests: Mapping[str, int] | None = None) -> str | None:
    """None when CA's in-tree filters accept `pod` on `node` with `used` (resource -> amount already requested there;
    cpu in millicores, `pods` = pods on the node), else kube-scheduler's reason. Plugins in kube-scheduler's order:
    NodeUnschedulable, TaintToleration, NodeAffinity, NodeResourcesFit. `requests` skips re-reading the pod spec."""
    if _dict(node.get("spec")).get("unschedulable"):
        cordon = {"key": UNSCHEDULABLE_TAINT, "effect": "NoSchedule"}
        if not any(tolerates(_dict(t), cordon) for t in _list(_dict(pod.get("spec")).get("tolerations"))):
            return UNSCHEDULABLE_NODE
    taint = untolerated_taint(pod, node)
    if taint is not None:
        return f"node(s) had untolerated taint {{{taint.get('key')}: {taint.get('value') or ''}}}"
    if not affinity_matches(pod, node):
        return AFFINITY_MISMATCH
    short = insufficient(pod_requests(pod) if requests is None else requests, allocatable(node), used)
    return ", ".join(short) if short else None


# -- GPU nodes, utilisation, drainability --------------------------------------------------------------------------


def gpu_resource(alloc: Mapping[str, int]) -> str | None:
    """The node's GPU resource as CA names it (first known name with allocatable), or None for a CPU node."""
    return next((r for r in GPU_RESOURCES if alloc.get(r, 0) > 0), None)


def gpu_utilization(alloc: Mapping[str, int], used: Mapping[str, int]) -> float:
    """GPU request ratio, what CA scales GPU nodes down on; CPU and memory ignored (utilization/info.go)."""
    name = gpu_resource(alloc)
    return used.get(name, 0) / alloc[name] if name else 0.0


def blocks_removal(pod: Mapping[str, Any]) -> str | None:
    """Why this pod keeps CA from draining its node (drainability rules), or None. Modelled: safe-to-evict "false";
    no controller; local storage (hostPath, emptyDir not in memory) unless safe-to-evict "true" or the volume is
    listed in safe-to-evict-local-volumes. Not modelled: PDBs, kube-system pods."""
    meta = _dict(pod.get("metadata"))
    ann = _dict(meta.get("annotations"))
    safe = str(ann.get(SAFE_TO_EVICT, "")).lower()
    if safe == "false":
        return f"pod annotated {SAFE_TO_EVICT}: \"false\""
    if safe == "true":
        return None
    if not _list(meta.get("ownerReferences")):
        return "pod has no controller"
    allowed = {v.strip() for v in str(ann.get(SAFE_TO_EVICT_LOCAL_VOLUMES, "")).split(",") if v.strip()}
    for vol in _list(_dict(pod.get("spec")).get("volumes")):
        vol = _dict(vol)
        local = "hostPath" in vol or ("emptyDir" in vol and _dict(vol.get("emptyDir")).get("medium") != "Memory")
        if local and vol.get("name") not in allowed:
            return f"pod has local storage (volume {vol.get('name')})"
    return None


# -- scale-up ------------------------------------------------------------------------------------------------------


def too_young(now: float, pending_since: Iterable[tuple[float, bool]]) -> bool:
    """CA's wait for more pods: no scale-up (nor scale-down) this loop when the oldest pending pod is under 2 s old,
    or the oldest GPU-requesting one under 30 s (static_autoscaler.go)."""
    items = list(pending_since)
    if not items:
        return False
    if now - min(t for t, _ in items) < POD_BUFFER_S:
        return True
    gpu = [t for t, is_gpu in items if is_gpu]
    return bool(gpu) and now - min(gpu) < GPU_POD_BUFFER_S


def requests_gpu(requests: Mapping[str, int]) -> bool:
    return any(requests.get(r, 0) > 0 for r in GPU_RESOURCES)


@dataclass
class SimNode:
    """A node in CA's snapshot: the Kubernetes-shaped dict and what is requested on it (mutated by simulations)."""

    name: str
    node: Mapping[str, Any]
    used: dict[str, int]


def place_in_snapshot(pod: Mapping[str, Any], requests: Mapping[str, int], nodes: Sequence[SimNode]) -> SimNode | None:
    """First node that fits, charged with the pod: how CA's filter-out-schedulable and drain simulations pack."""
    for n in nodes:
        if fits(pod, n.node, n.used, requests) is None:
            _add(n.used, requests)
            n.used["pods"] = n.used.get("pods", 0) + 1
            return n
    return None


def filter_out_schedulable(pods: Sequence[tuple[Mapping[str, Any], Mapping[str, int]]], nodes: Sequence[SimNode]
                           ) -> tuple[list[int], list[int]]:
    """(indices CA places on existing or upcoming nodes, indices left for scale-up), consuming capacity in order
    (core/podlistprocessor/filter_out_schedulable.go). `nodes` are charged in place: pass copies."""
    placed, left = [], []
    for i, (pod, req) in enumerate(pods):
        (placed if place_in_snapshot(pod, req, nodes) is not None else left).append(i)
    return placed, left


@dataclass(frozen=True)
class NodeGroup:
    name: str
    template: Mapping[str, Any]  # a Node dict: labels, taints, allocatable of a new node
    min_size: int
    max_size: int
    price: float  # per node-hour, for the expander's tie-break only


@dataclass(frozen=True)
class Option:
    group: NodeGroup
    nodes: int
    pods: tuple[int, ...]  # indices of the pending pods the new nodes take


def binpack(group: NodeGroup, pods: Sequence[tuple[Mapping[str, Any], Mapping[str, int]]], room: int) -> Option | None:
    """How many template nodes the pods need (BinpackingNodeEstimator: first fit, a new node when none fits), at
    most `room`; pods that fit no empty template are left out. None when no pod fits the group."""
    new: list[SimNode] = []
    took: list[int] = []
    for i, (pod, req) in enumerate(pods):
        if fits(pod, group.template, {}, req) is not None:
            continue
        if place_in_snapshot(pod, req, new) is None:
            if len(new) >= room:
                continue
            new.append(SimNode(f"{group.name}-template-{len(new)}", group.template, {}))
            place_in_snapshot(pod, req, new[-1:])
        took.append(i)
    return Option(group, len(new), tuple(took)) if took else None


def expand(options: Sequence[Option]) -> Option | None:
    """The option CA takes. least-waste scores idle CPU and memory only, so GPU-only requests tie it; this model
    breaks ties by most pods helped, then fewest nodes, then cheapest, then name (deterministic)."""
    if not options:
        return None
    return min(options, key=lambda o: (-len(o.pods), o.nodes, o.nodes * o.group.price, o.group.name))


def scale_up(groups: Sequence[NodeGroup], sizes: Mapping[str, int],
             pods: Sequence[tuple[Mapping[str, Any], Mapping[str, int]]]) -> Option | None:
    """One loop's scale-up for the pods left after filter-out-schedulable: an option per group with room, then the
    expander's pick."""
    options = []
    for g in groups:
        room = g.max_size - sizes.get(g.name, 0)
        if room > 0:
            opt = binpack(g, pods, room)
            if opt is not None:
                options.append(opt)
    return expand(options)


# -- scale-down ----------------------------------------------------------------------------------------------------


def underutilized(alloc: Mapping[str, int], used: Mapping[str, int]) -> bool:
    """A GPU node below the GPU threshold (GPU requests only); a CPU node is out of this model's scope."""
    return gpu_resource(alloc) is not None and gpu_utilization(alloc, used) < GPU_UTILIZATION_THRESHOLD


def can_drain(pods: Sequence[tuple[Mapping[str, Any], Mapping[str, int]]], others: Sequence[SimNode]) -> bool:
    """Every pod movable: none blocks removal and each finds a place on the other nodes, consuming capacity in turn
    (simulator/cluster.go SimulateNodeRemoval). `others` are charged in place: pass copies."""
    if any(blocks_removal(p) for p, _ in pods):
        return False
    return all(place_in_snapshot(p, r, others) is not None for p, r in pods)


@dataclass
class Unneeded:
    """When each node became a scale-down candidate; a node that stops being one starts again from zero."""

    since: dict[str, float] = field(default_factory=dict)

    def update(self, now: float, candidates: Iterable[str]) -> None:
        keep = set(candidates)
        self.since = {n: self.since.get(n, now) for n in keep}

    def ready(self, now: float) -> list[str]:
        """Candidates unneeded for --scale-down-unneeded-time, longest first."""
        due = [(t, n) for n, t in self.since.items() if now - t >= SCALE_DOWN_UNNEEDED_S]
        return [n for _, n in sorted(due)]


def scale_down_allowed(now: float, last_scale_up: float | None) -> bool:
    """--scale-down-delay-after-add: no scale-down for 10 min after a scale-up."""
    return last_scale_up is None or now - last_scale_up >= SCALE_DOWN_DELAY_AFTER_ADD_S


def pick_removals(due: Sequence[str], empty: Callable[[str], bool]) -> list[str]:
    """Empty nodes in bulk (up to --max-scale-down-parallelism), else one non-empty node (--max-drain-parallelism)."""
    empties = [n for n in due if empty(n)][:MAX_SCALE_DOWN_PARALLELISM]
    if empties:
        return empties
    return [n for n in due if not empty(n)][:MAX_DRAIN_PARALLELISM]
