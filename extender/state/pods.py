"""What a pod asks of a node: how many GPUs (gputopo.podspec: counted as the kubelet counts them, one quantity
parser for both halves), per container, and its placement constraints (annotations).

Read straight from the Pod's JSON dict: this runs on the filter hot path, so no model classes. A pod's containers
are gone over once (PodAsks), and what they ask is kept by the pod's UID (PodNeedsCache, on the NodeCache) for every
verb and the pod watch: the requests of extended resources cannot change after the pod is created.
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
    count_quantity,
    effective_count,
)

__all__ = ["APP", "INIT", "SIDECAR", "ContainerNeed", "Need", "PodAsks", "PodNeeds", "PodNeedsCache", "PodSpecError",
           "RecentPods", "effective_count", "nominated_node", "parse_quantity", "pod_needs", "split_plan"]


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


class _Raw:
    """One container's extended-resource quantities as written: name -> (value, where to name it in an error)."""

    __slots__ = ("kind", "name", "values")

    def __init__(self, name: str, kind: str, values: dict[str, tuple[Any, str]]) -> None:
        self.name, self.kind, self.values = name, kind, values


def _raw_values(container: Mapping[str, Any], where: str) -> dict[str, tuple[Any, str]]:
    """Every extended resource (`domain/name`: every name placement reads is one) the container limits or requests,
    the limit taking precedence (gputopo.podspec's rule). cpu, memory and the like are left out: kept for every pod
    of a large cluster, they would be most of the memory the cache holds."""
    res = _dict(container.get("resources"))
    out: dict[str, tuple[Any, str]] = {}
    for part in ("requests", "limits"):  # limits last: a limit overrides the request
        for k, v in _dict(res.get(part)).items():
            if isinstance(k, str) and "/" in k:
                out[k] = (v, f"{where} {part}[{k}]")
    return out


class PodAsks:
    """What a pod's containers ask for, read in one pass over them; the pod's needs (whole GPUs, replicas of a shared
    resource, MIG instances, the largest per-container request) are derived from it without going over the spec
    again, and memoised per (resource, keys, shared names, constraint annotations).

    Why: a pod's extended-resource requests cannot change after it is created, yet filter, prioritize, preempt,
    bind and every watch event of the pod read them, each once per resource name (the configured one, every shared
    name, the MIG names). Errors are kept, not raised, and raised by `needs` exactly as reading the spec then would
    have (the first bad quantity of the resource read, before a malformed container after it), so a cached pod
    answers as an uncached one. Annotations (require-nvlink, min-allreduce-gbps) may change: they are read each call.
    """

    __slots__ = ("_containers", "_counts", "_derived", "_error", "_object", "name", "namespace", "uid")

    def __init__(self, pod: Any) -> None:
        self._object = isinstance(pod, dict)  # the pod itself is not kept: only what its containers ask
        meta = _dict(pod.get("metadata")) if isinstance(pod, dict) else {}
        self.uid = str(meta.get("uid") or "")
        self.namespace = str(meta.get("namespace") or "default")
        self.name = str(meta.get("name") or "")
        self._containers: list[_Raw] = []
        self._error: PodSpecError | None = None
        self._counts: dict[str, tuple[ContainerNeed, ...] | PodSpecError] = {}
        self._derived: dict[tuple[Any, ...], PodNeeds | PodSpecError] = {}
        if not isinstance(pod, dict):
            self._error = PodSpecError("Pod must be an object")
            return
        self._read(pod.get("spec"))

    def _read(self, spec: Any) -> None:
        """gputopo.podspec.container_needs' checks, in its order; stops at the first malformed container."""
        if not isinstance(spec, dict):
            self._error = PodSpecError("pod has no spec object")
            return
        seen: dict[str, str] = {}
        for field, kind in (("initContainers", INIT), ("containers", APP)):
            items = spec.get(field)
            if items is None:
                continue
            if not isinstance(items, list):
                self._error = PodSpecError(f"spec.{field} must be a list")
                return
            for i, c in enumerate(items):
                if not isinstance(c, dict):
                    self._error = PodSpecError(f"spec.{field}[{i}] must be an object")
                    return
                name = c.get("name")
                if not isinstance(name, str) or not name:
                    self._error = PodSpecError(f"spec.{field}[{i}] has no name")
                    return
                if name in seen:
                    self._error = PodSpecError(f"spec.{field}[{i}] repeats the container name {name!r} of "
                                               f"{seen[name]}: container names must be unique")
                    return
                seen[name] = f"spec.{field}[{i}]"
                k = SIDECAR if kind == INIT and c.get("restartPolicy") == "Always" else kind
                self._containers.append(_Raw(name, k, _raw_values(c, f"{field}[{name}]")))

    def _containers_of(self, resource: str) -> tuple[ContainerNeed, ...]:
        """Every container's count of `resource` (zeros included), as gputopo.podspec.container_needs gives it.
        Raises PodSpecError: a bad quantity of it, else a malformed spec."""
        got = self._counts.get(resource)
        if got is None:
            try:
                got = tuple(ContainerNeed(c.name, count_quantity(*c.values[resource]) if resource in c.values else 0,
                                          c.kind) for c in self._containers)
            except PodSpecError as e:
                got = e
            self._counts[resource] = got  # a benign race: two threads compute the same tuple
        if isinstance(got, PodSpecError):
            raise got
        if self._error is not None:
            raise self._error
        return got

    def _asked(self, names: Iterable[str]) -> list[tuple[str, tuple[ContainerNeed, ...], int]]:
        """(name, containers' needs, effective count) of each of `names` the pod asks a non-zero count of."""
        out = []
        for name in names:
            containers = self._containers_of(name)
            count = effective_count(containers)
            if count:
                out.append((name, containers, count))
        return out

    def _names(self) -> set[str]:
        """Every resource name any container limits or requests."""
        return {k for c in self._containers for k in c.values}

    def _shared_ask(self, resource: str, size: int, shared: frozenset[str]
                    ) -> tuple[str, tuple[ContainerNeed, ...], int] | None:
        """The shared resource (other than `resource`) the pod asks replicas of, if any. A pod asking for two kinds
        is refused: the plugin serves each name from its own socket, and one plan cannot name both."""
        asks = self._asked(sorted((shared - {resource}) & self._names()))  # names not asked count 0, no error
        if not asks:
            return None
        if len(asks) > 1:
            raise PodSpecError(f"asks for replicas of {asks[0][0]} and of {asks[1][0]}: a pod takes replicas of one "
                               "shared resource")
        if size:
            raise PodSpecError(f"asks for {asks[0][0]} (replicas of shared GPUs) and {resource} (whole GPUs): a pod "
                               "takes shared replicas or whole GPUs, not both")
        return asks[0]

    def _mig_ask(self, resource: str, size: int, shared: str | None
                 ) -> tuple[str, tuple[ContainerNeed, ...], int] | None:
        """The MIG resource (`<domain>/mig-<profile>`, NVIDIA's mixed strategy) the pod asks instances of, if any.
        One profile per pod, and not with whole GPUs or replicas: the plugin serves each name from its own socket,
        one plan names one resource, and MIG instances of different GPUs are not one device."""
        prefix = f"{resource.split('/', 1)[0]}/{MIG_RESOURCE_PREFIX}"
        asks = self._asked(sorted(n for n in self._names() if n.startswith(prefix)))
        if not asks:
            return None
        if len(asks) > 1:
            raise PodSpecError(f"asks for MIG instances of {asks[0][0]} and of {asks[1][0]}: a pod takes instances "
                               "of one MIG profile")
        if size:
            raise PodSpecError(f"asks for {asks[0][0]} (MIG instances) and {resource} (whole GPUs): a pod takes MIG "
                               "instances or whole GPUs, not both")
        if shared:
            raise PodSpecError(f"asks for {asks[0][0]} (MIG instances) and {shared} (replicas of shared GPUs): a "
                               "pod takes one of them")
        return asks[0]

    def needs(self, resource: str, keys: Keys, shared: frozenset[str], pod: Any) -> PodNeeds:
        """The pod's needs where `shared` are the resource names some node shares (NodeCache.shared_names); `pod` is
        its latest dict, whose annotations are read (they may have changed since). Raises PodSpecError."""
        if not self._object or not isinstance(pod, dict):
            raise PodSpecError("Pod must be an object")
        annotations = _dict(_dict(pod.get("metadata")).get("annotations"))
        flags = (annotations.get(keys.require_nvlink), annotations.get(keys.min_gbps))
        key = (resource, keys, shared, *flags)
        try:
            got = self._derived.get(key)
        except TypeError:  # an annotation value that is not a string (malformed JSON): not memoised
            return self._derive(resource, keys, shared, annotations)
        if got is None:
            try:
                got = self._derive(resource, keys, shared, annotations)
            except PodSpecError as e:
                got = e
            if len(self._derived) >= _DERIVED_LIMIT:  # shared names or annotations changed: the old ones are gone
                self._derived.clear()
            self._derived[key] = got
        if isinstance(got, PodSpecError):
            raise got
        return got

    def _derive(self, resource: str, keys: Keys, shared: frozenset[str], annotations: Mapping[str, Any]) -> PodNeeds:
        containers = self._containers_of(resource)
        size = effective_count(containers)
        ask = self._shared_ask(resource, size, shared) if shared else None
        asked: str | None = None
        if ask is not None:
            asked, containers, size = ask
        mig = self._mig_ask(resource, 0 if ask is not None else size, asked)
        if mig is not None:
            asked, containers, size = mig
        require_nvlink, min_gbps = constraints(annotations, keys)
        need = Need(size=size, require_nvlink=require_nvlink, min_gbps=min_gbps, resource=asked,
                    container_max=max((c.count for c in containers), default=0))
        return PodNeeds(uid=self.uid, namespace=self.namespace, name=self.name, need=need,
                        containers=tuple(c for c in containers if c.count > 0))


_DERIVED_LIMIT = 8


def pod_needs(pod: Any, resource: str, keys: Keys, shared: frozenset[str] = frozenset()) -> PodNeeds:
    """Parse the few fields of a Pod dict that placement needs; `shared` are the resource names some node shares
    (NodeCache.shared_names). Raises PodSpecError. Uncached: the verbs and the cache read through PodNeedsCache."""
    return PodAsks(pod).needs(resource, keys, shared, pod)


class PodNeedsCache:
    """Each pod's PodAsks, read once and kept by UID: its extended-resource requests cannot change after creation,
    so filter, prioritize, preempt, bind and the pod watch share one reading. Bounded (least recently used
    forgotten first) and dropped when the pod is deleted (NodeCache.remove_pod); a pod without a UID is read each
    time."""

    def __init__(self, resource: str, keys: Keys, limit: int = 100_000) -> None:
        self.resource, self.keys, self.limit = resource, keys, limit
        self._asks: OrderedDict[str, PodAsks] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._asks)

    def of(self, pod: Any, shared: frozenset[str] = frozenset()) -> PodNeeds:
        """The pod's needs (PodAsks.needs with the configured resource and keys). Raises PodSpecError."""
        return self.asks(pod).needs(self.resource, self.keys, shared, pod)

    def asks(self, pod: Any) -> PodAsks:
        uid = _dict(_dict(pod).get("metadata")).get("uid") if isinstance(pod, dict) else None
        if not isinstance(uid, str) or not uid:
            return PodAsks(pod)
        with self._lock:
            got = self._asks.get(uid)
            if got is not None:
                self._asks.move_to_end(uid)
                return got
        got = PodAsks(pod)  # read outside the lock; two readers of one new pod keep the same answer
        with self._lock:
            self._asks[uid] = got
            while len(self._asks) > self.limit:
                self._asks.popitem(last=False)
        return got

    def forget(self, uid: str) -> None:
        with self._lock:
            self._asks.pop(uid, None)


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
