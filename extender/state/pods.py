"""What a pod asks of a node: how many GPUs (gputopo.podspec: counted as the kubelet counts them, one quantity
parser for both halves), per container, and its placement constraints (annotations).

Read straight from the Pod's JSON dict: this runs on the filter hot path, so no model classes.
"""

from __future__ import annotations

import math
import threading
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from gputopo.contract import MIG_RESOURCE_PREFIX, Keys
from gputopo.core import Topology, best_subset
from gputopo.podspec import (
    APP,
    INIT,
    SIDECAR,
    ContainerNeed,
    PodSpecError,
    container_needs,
    count_quantity,
    effective_count,
)

__all__ = ["APP", "INIT", "SIDECAR", "ContainerNeed", "Need", "PodNeeds", "PodSpecError", "RecentPods",
           "effective_count", "nominated_node", "parse_quantity", "pod_needs", "split_plan"]


@dataclass(frozen=True)
class Need:
    """The part of a pod that decides placement; hashable, so answers can be memoised on it."""

    size: int
    require_nvlink: bool = False
    min_gbps: float = 0.0
    # a shared resource other than the configured one (`nvidia.com/gpu.shared`): `size` replicas of that many
    # distinct GPUs; or a MIG resource (`nvidia.com/mig-1g.18gb`): `size` instances of that profile. None: the
    # configured resource, whole GPUs, or replicas / MIG instances on the nodes that serve that name so.
    resource: str | None = None
    # the most any one container (init containers included) asks: the kubelet calls Allocate per container, so
    # NVIDIA's failRequestsGreaterThanOne bounds this, not `size`. None (a Need made without its containers): taken
    # as `size`, as if one container asked it all, the reading that never admits what the plugin would refuse.
    container_max: int | None = None

    @property
    def constrained(self) -> bool:
        return self.size > 1 and (self.require_nvlink or self.min_gbps > 0)

    @property
    def largest_request(self) -> int:
        """The largest single Allocate request this pod makes: what a per-request limit is checked against."""
        return self.size if self.container_max is None else self.container_max


@dataclass(frozen=True)
class PodNeeds:
    uid: str
    namespace: str
    name: str
    need: Need
    containers: tuple[ContainerNeed, ...]

    @property
    def size(self) -> int:
        return self.need.size

    @property
    def key(self) -> str:
        return f"{self.namespace}/{self.name}"


def parse_quantity(value: Any, where: str) -> int:
    """A whole-number device quantity ("2", 2, "2000m", "2e0"); extended resources cannot be fractional."""
    return count_quantity(value, where)


def _dict(value: Any) -> Mapping[str, Any]:
    return value if isinstance(value, dict) else {}


def _annotation_flag(value: Any, key: str) -> bool:
    if value is None:
        return False
    text = str(value).strip().lower()
    if text in ("true", "1", "yes"):
        return True
    if text in ("false", "0", "no", ""):
        return False
    raise PodSpecError(f"annotation {key}={value!r} must be \"true\" or \"false\"")


def _annotation_gbps(value: Any, key: str) -> float:
    if value is None:
        return 0.0
    try:
        gbps = float(str(value).strip())
    except ValueError:
        raise PodSpecError(f"annotation {key}={value!r} must be a number of GB/s") from None
    if not math.isfinite(gbps) or gbps < 0:
        raise PodSpecError(f"annotation {key}={value!r} must be a finite, non-negative number of GB/s")
    return gbps


def constraints(annotations: Mapping[str, Any], keys: Keys) -> tuple[bool, float]:
    """(require-nvlink, min-allreduce-gbps) from a pod's annotations. Raises PodSpecError on an unreadable one."""
    return (_annotation_flag(annotations.get(keys.require_nvlink), keys.require_nvlink),
            _annotation_gbps(annotations.get(keys.min_gbps), keys.min_gbps))


def _shared_ask(pod: Mapping[str, Any], resource: str, size: int, shared: frozenset[str]
                ) -> tuple[str, tuple[ContainerNeed, ...], int] | None:
    """The shared resource (other than `resource`) the pod asks replicas of, if any. A pod asking for two kinds is
    refused: the plugin serves each name from its own socket, and one plan cannot name both."""
    asks = _asks(pod, sorted(shared - {resource}))
    if not asks:
        return None
    if len(asks) > 1:
        raise PodSpecError(f"asks for replicas of {asks[0][0]} and of {asks[1][0]}: a pod takes replicas of one "
                           "shared resource")
    if size:
        raise PodSpecError(f"asks for {asks[0][0]} (replicas of shared GPUs) and {resource} (whole GPUs): a pod "
                           "takes shared replicas or whole GPUs, not both")
    return asks[0]


def _asks(pod: Mapping[str, Any], names: Iterable[str]) -> list[tuple[str, tuple[ContainerNeed, ...], int]]:
    """(name, containers' needs, effective count) of each of `names` the pod asks a non-zero count of."""
    out = []
    for name in names:
        containers = container_needs(pod, name)
        count = effective_count(containers)
        if count:
            out.append((name, containers, count))
    return out


def _asked_names(pod: Mapping[str, Any], prefix: str) -> list[str]:
    """Resource names starting with `prefix` that any container requests or limits (bounded by the spec itself)."""
    spec = _dict(pod.get("spec"))
    names: set[str] = set()
    for field in ("initContainers", "containers"):
        items = spec.get(field)
        for c in items if isinstance(items, list) else ():
            res = _dict(_dict(c).get("resources"))
            for part in ("limits", "requests"):
                names.update(k for k in _dict(res.get(part)) if isinstance(k, str) and k.startswith(prefix))
    return sorted(names)


def _mig_ask(pod: Mapping[str, Any], resource: str, size: int, shared: str | None
             ) -> tuple[str, tuple[ContainerNeed, ...], int] | None:
    """The MIG resource (`<domain>/mig-<profile>`, NVIDIA's mixed strategy) the pod asks instances of, if any. One
    profile per pod, and not with whole GPUs or replicas: the plugin serves each name from its own socket, one plan
    names one resource, and MIG instances of different GPUs are not one device."""
    domain = resource.split("/", 1)[0]
    asks = _asks(pod, _asked_names(pod, f"{domain}/{MIG_RESOURCE_PREFIX}"))
    if not asks:
        return None
    if len(asks) > 1:
        raise PodSpecError(f"asks for MIG instances of {asks[0][0]} and of {asks[1][0]}: a pod takes instances of "
                           "one MIG profile")
    if size:
        raise PodSpecError(f"asks for {asks[0][0]} (MIG instances) and {resource} (whole GPUs): a pod takes MIG "
                           "instances or whole GPUs, not both")
    if shared:
        raise PodSpecError(f"asks for {asks[0][0]} (MIG instances) and {shared} (replicas of shared GPUs): a pod "
                           "takes one of them")
    return asks[0]


def pod_needs(pod: Any, resource: str, keys: Keys, shared: frozenset[str] = frozenset()) -> PodNeeds:
    """Parse the few fields of a Pod dict that placement needs; `shared` are the resource names some node shares
    (NodeCache.shared_names). Raises PodSpecError."""
    if not isinstance(pod, dict):
        raise PodSpecError("Pod must be an object")
    meta = _dict(pod.get("metadata"))
    containers = container_needs(pod, resource)
    size = effective_count(containers)
    ask = _shared_ask(pod, resource, size, shared) if shared else None
    asked: str | None = None
    if ask is not None:
        asked, containers, size = ask
    mig = _mig_ask(pod, resource, 0 if ask is not None else size, asked)
    if mig is not None:
        asked, containers, size = mig
    require_nvlink, min_gbps = constraints(_dict(meta.get("annotations")), keys)
    need = Need(size=size, require_nvlink=require_nvlink, min_gbps=min_gbps, resource=asked,
                container_max=max((c.count for c in containers), default=0))
    return PodNeeds(
        uid=str(meta.get("uid") or ""),
        namespace=str(meta.get("namespace") or "default"),
        name=str(meta.get("name") or ""),
        need=need,
        containers=tuple(c for c in containers if c.count > 0),
    )


def nominated_node(pod: Any) -> str | None:
    """status.nominatedNodeName: the node kube-scheduler preempted victims on for this pod, if any."""
    status = _dict(pod).get("status") if isinstance(pod, dict) else None
    name = _dict(status).get("nominatedNodeName")
    return name if isinstance(name, str) and name else None


def split_plan(topo: Topology, chosen: Sequence[int], containers: Sequence[ContainerNeed]) -> dict[str, list[int]]:
    """Split the chosen GPUs (indices) among the containers the way the kubelet will hand them out.

    Sidecars and app containers hold their GPUs together, so they get disjoint parts, each the best subset of what
    is left (two 4-GPU containers on a DGX-1 get one NVLink quad each). A regular init container runs before the
    app containers and the kubelet lets the next container reuse its devices, so its part lies inside the first app
    container's part when it fits there (else inside what the sidecars started before it leave).
    """
    left = sorted(chosen)
    parts: dict[str, list[int]] = {}
    sidecars_before: list[int] = []
    pending_inits: list[tuple[ContainerNeed, list[int]]] = []
    for c in containers:
        if c.count <= 0:
            continue
        if c.kind == INIT:
            pending_inits.append((c, list(sidecars_before)))
            continue
        if c.count > len(left):
            raise ValueError(f"container {c.name} needs {c.count} GPUs, {len(left)} left of the plan")
        part = list(best_subset(topo, left, c.count).gpus) if c.count < len(left) else list(left)
        parts[c.name] = part
        left = [i for i in left if i not in part]
        if c.kind == SIDECAR:
            sidecars_before.extend(part)
    first_app = next((parts[c.name] for c in containers if c.kind == APP and c.name in parts), [])
    for c, taken in pending_inits:
        pool = first_app if c.count <= len(first_app) else [i for i in chosen if i not in taken]
        if c.count > len(pool):
            raise ValueError(f"init container {c.name} needs {c.count} GPUs, {len(pool)} in the plan for it")
        parts[c.name] = list(best_subset(topo, pool, c.count).gpus) if c.count < len(pool) else sorted(pool)
    return parts


class RecentPods:
    """Pods seen in filter/prioritize/preempt bodies, by UID: bind gets only names, and in standalone mode (no
    apiserver) these bodies are the only place a pod's GPU count comes from. Bounded, oldest forgotten first."""

    def __init__(self, limit: int = 50_000) -> None:
        self.limit = limit
        self._pods: OrderedDict[str, PodNeeds] = OrderedDict()
        self._lock = threading.Lock()

    def remember(self, needs: PodNeeds) -> None:
        if not needs.uid:
            return
        with self._lock:
            self._pods[needs.uid] = needs
            self._pods.move_to_end(needs.uid)
            while len(self._pods) > self.limit:
                self._pods.popitem(last=False)

    def get(self, uid: str) -> PodNeeds | None:
        return self._pods.get(uid)
