"""What the extender knows of DRA nodes: the devices our DRA driver publishes per node (ResourceSlices) and which of
them claims hold (ResourceClaims' status.allocation), fed by two watches (extender.state.cluster).

kube-scheduler's DRA allocator hands out the first free device in published order (docs/reference/dra-api.md §6),
and the driver publishes each group best first for the GPUs free at its last republish (docs/dra.md). So what a pod
gets on a node is known here without the node's topology: the first free GPU set of the asked size (the claim
templates' tiers), or the first N free ring-ordered singles (`nvidia.com/gpu: N` through the DeviceClass's
extendedResourceName), each with the set's `allreduceGBps` attribute. extender.placement.dra turns that into scores.

Only our driver's pools are read, each at its highest generation and only once complete (every slice of that
generation seen), as the allocator reads them; devices are named by their GPUs (`gpu-3`, `one-3`, `set-0-1-2-3`),
so a claim's allocated device names say which GPUs it holds. Tainted devices are never offered. Shared GPUs and
MIG instances are left out: the extender does not rank nodes for them.

`pending` is the extender's own bookkeeping of the set it expects a pod to get on the node it ranked first, held
until a claim owned by that pod shows an allocation, or for `pending_s`: within a burst kube-scheduler allocates the
next pod before the previous pod's allocation is written, so without it the next pod is ranked on a view that still
shows those GPUs free.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from gputopo.contract import parse_dra_device
from gputopo.kube.fetching import ApiResource

SLICES = ApiResource("resource.k8s.io", "v1", "resourceslices", "ResourceSlice")
CLAIMS = ApiResource("resource.k8s.io", "v1", "resourceclaims", "ResourceClaim")
DEFAULT_PENDING_S = 10.0

GpuSet = tuple[int, ...]


def _int_attr(attrs: Mapping[str, Any], key: str, driver: str) -> int | None:
    for k in (key, f"{driver}/{key}"):
        v = attrs.get(k)
        if isinstance(v, dict) and isinstance(v.get("int"), int):
            return int(v["int"])
    return None


@dataclass(frozen=True)
class DraNode:
    """One node's pool as the allocator sees it: untainted devices in published order."""

    name: str
    rings: GpuSet  # gpu-<i> singles: nvidia.com/gpu: N through the extended-resource class
    ones: GpuSet  # one-<i> singles: the "1 GPU" template
    sets: Mapping[int, tuple[tuple[GpuSet, int], ...]]  # size -> ((members, allreduce GB/s), ...)
    gbps: Mapping[GpuSet, int] = field(compare=False)  # every published set, tainted or not

    @property
    def gpus(self) -> int:
        return len(set(self.rings) | set(self.ones))

    def gbps_of(self, gpus: Iterable[int]) -> float:
        """Estimated all-reduce GB/s of these GPUs: the published set's attribute; for a combination not published
        as a set, the slowest of its published pairs (0 when one is missing); 0 for one GPU."""
        members = tuple(sorted(gpus))
        if len(members) < 2:
            return 0.0
        hit = self.gbps.get(members)
        if hit is not None:
            return float(hit)
        pairs = [self.gbps.get((a, b)) for i, a in enumerate(members) for b in members[i + 1:]]
        return float(min(pairs)) if pairs and None not in pairs else 0.0  # type: ignore[type-var]


@dataclass
class _Pool:
    node: str
    slices: dict[str, dict[str, Any]] = field(default_factory=dict)  # name -> spec
    view: DraNode | None = None
    dirty: bool = True


@dataclass(frozen=True)
class ClaimInfo:
    namespace: str
    name: str
    uid: str
    owners: frozenset[str]  # uids of the owning pods
    requests: tuple[Mapping[str, Any], ...]  # spec.devices.requests
    allocated: tuple[tuple[str, str], ...]  # (pool, device) of our driver
    reserved_for: frozenset[str]  # pod uids in status.reservedFor

    @property
    def is_allocated(self) -> bool:
        return bool(self.allocated)


def _claim_info(obj: Mapping[str, Any], driver: str) -> ClaimInfo | None:
    meta = obj.get("metadata") or {}
    name, ns = meta.get("name"), meta.get("namespace")
    if not isinstance(name, str) or not isinstance(ns, str):
        return None
    owners = frozenset(str(o.get("uid")) for o in meta.get("ownerReferences") or []
                       if isinstance(o, dict) and o.get("kind") == "Pod" and o.get("uid"))
    requests = tuple(r for r in ((obj.get("spec") or {}).get("devices") or {}).get("requests") or []
                     if isinstance(r, dict))
    status = obj.get("status") or {}
    results = (((status.get("allocation") or {}).get("devices") or {}).get("results")) or []
    allocated = tuple((str(r.get("pool")), str(r.get("device"))) for r in results
                      if isinstance(r, dict) and r.get("driver") == driver)
    reserved = frozenset(str(r.get("uid")) for r in status.get("reservedFor") or []
                         if isinstance(r, dict) and r.get("uid"))
    return ClaimInfo(ns, name, str(meta.get("uid") or ""), owners, requests, allocated, reserved)


class DraView:
    """Thread-safe: the watches write, the verbs read. Readers get immutable DraNode views and used-GPU sets."""

    def __init__(self, driver: str, *, pending_s: float = DEFAULT_PENDING_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.driver = driver
        self.pending_s = pending_s
        self.clock = clock
        self._lock = threading.Lock()
        self._pools: dict[str, _Pool] = {}  # pool name -> pool
        self._slice_pool: dict[str, str] = {}  # slice name -> pool name
        self._node_pool: dict[str, str] = {}  # node name -> pool name
        self._claims: dict[tuple[str, str], ClaimInfo] = {}
        self._used: dict[str, dict[tuple[str, str], frozenset[int]]] = {}  # pool -> claim -> GPUs
        self._pending: dict[str, tuple[str, frozenset[int], float]] = {}  # pod uid -> (node, GPUs, until)
        self.version = 0  # bumped on every change, for callers' memos

    # -- slices -------------------------------------------------------------------------------------------------

    def sync_slices(self, items: Iterable[Mapping[str, Any]]) -> None:
        with self._lock:
            self._pools.clear()
            self._slice_pool.clear()
            self._node_pool.clear()
            for obj in items:
                self._put_slice(obj)
            self.version += 1

    def apply_slice(self, event: str, obj: Mapping[str, Any]) -> None:
        with self._lock:
            if event == "DELETED":
                self._drop_slice(str((obj.get("metadata") or {}).get("name")))
            else:
                self._put_slice(obj)
            self.version += 1

    def _drop_slice(self, name: str) -> None:
        pool_name = self._slice_pool.pop(name, None)
        pool = self._pools.get(pool_name) if pool_name is not None else None
        if pool is None:
            return
        pool.slices.pop(name, None)
        pool.dirty = True
        if not pool.slices:
            del self._pools[pool_name]  # type: ignore[arg-type]
            if self._node_pool.get(pool.node) == pool_name:
                del self._node_pool[pool.node]

    def _put_slice(self, obj: Mapping[str, Any]) -> None:
        name = (obj.get("metadata") or {}).get("name")
        spec = obj.get("spec") or {}
        if not isinstance(name, str):
            return
        if spec.get("driver") != self.driver or not isinstance(spec.get("nodeName"), str):
            self._drop_slice(name)
            return
        pool_name = str((spec.get("pool") or {}).get("name") or "")
        if self._slice_pool.get(name) not in (None, pool_name):
            self._drop_slice(name)
        pool = self._pools.setdefault(pool_name, _Pool(spec["nodeName"]))
        pool.node = spec["nodeName"]
        pool.slices[name] = spec
        pool.dirty = True
        self._slice_pool[name] = pool_name
        self._node_pool[pool.node] = pool_name

    def _view(self, pool_name: str) -> DraNode | None:
        """The pool's view (caller holds the lock): None while incomplete at its highest generation."""
        pool = self._pools.get(pool_name)
        if pool is None:
            return None
        if not pool.dirty:
            return pool.view
        pool.dirty = False
        pool.view = None
        specs = pool.slices
        gens = [int((s.get("pool") or {}).get("generation") or 0) for s in specs.values()]
        if not gens:
            return None
        top = max(gens)
        current = sorted((n, s) for n, s in specs.items() if int((s.get("pool") or {}).get("generation") or 0) == top)
        want = {int((s.get("pool") or {}).get("resourceSliceCount") or 0) for _, s in current}
        if want != {len(current)}:
            return None
        rings: list[int] = []
        ones: list[int] = []
        sets: dict[int, list[tuple[GpuSet, int]]] = {}
        gbps: dict[GpuSet, int] = {}
        for _, s in current:
            for d in s.get("devices") or []:
                if not isinstance(d, dict):
                    continue
                parsed = parse_dra_device(str(d.get("name") or ""))
                if parsed is None:
                    continue
                group, members = parsed
                tainted = any(isinstance(t, dict) and t.get("effect") in ("NoSchedule", "NoExecute")
                              for t in d.get("taints") or [])
                if group == "set":
                    value = _int_attr(d.get("attributes") or {}, "allreduceGBps", self.driver) or 0
                    gbps[members] = value
                    if not tainted:
                        sets.setdefault(len(members), []).append((members, value))
                elif not tainted:
                    (rings if group == "gpu" else ones).append(members[0])
        pool.view = DraNode(pool.node, tuple(rings), tuple(ones), {k: tuple(v) for k, v in sets.items()}, gbps)
        return pool.view

    # -- claims -------------------------------------------------------------------------------------------------

    def sync_claims(self, items: Iterable[Mapping[str, Any]]) -> None:
        with self._lock:
            self._claims.clear()
            self._used.clear()
            for obj in items:
                self._put_claim(obj)
            self.version += 1

    def apply_claim(self, event: str, obj: Mapping[str, Any]) -> None:
        with self._lock:
            if event == "DELETED":
                meta = obj.get("metadata") or {}
                self._forget_claim((str(meta.get("namespace")), str(meta.get("name"))))
            else:
                self._put_claim(obj)
            self.version += 1

    def _forget_claim(self, key: tuple[str, str]) -> None:
        old = self._claims.pop(key, None)
        if old is not None:
            for pool, _ in old.allocated:
                self._used.get(pool, {}).pop(key, None)

    def _put_claim(self, obj: Mapping[str, Any]) -> None:
        info = _claim_info(obj, self.driver)
        if info is None:
            return
        key = (info.namespace, info.name)
        self._forget_claim(key)
        self._claims[key] = info
        by_pool: dict[str, set[int]] = {}
        for pool, device in info.allocated:
            parsed = parse_dra_device(device)
            if parsed is not None:
                by_pool.setdefault(pool, set()).update(parsed[1])
        for pool, gpus in by_pool.items():
            self._used.setdefault(pool, {})[key] = frozenset(gpus)
        if info.allocated:
            for uid in info.owners | info.reserved_for:
                self._pending.pop(uid, None)

    def claim(self, namespace: str, name: str) -> ClaimInfo | None:
        with self._lock:
            return self._claims.get((namespace, name))

    # -- pending (the extender's own bookkeeping within a burst) --------------------------------------------------

    def expect(self, pod_uid: str, node: str, gpus: Iterable[int]) -> None:
        """The pod is expected to get these GPUs on this node: counted as used until a claim of the pod shows an
        allocation, or for pending_s."""
        if not pod_uid:
            return
        with self._lock:
            self._pending[pod_uid] = (node, frozenset(gpus), self.clock() + self.pending_s)
            self.version += 1

    def forget_pod(self, pod_uid: str) -> None:
        with self._lock:
            if self._pending.pop(pod_uid, None) is not None:
                self.version += 1

    # -- reads --------------------------------------------------------------------------------------------------

    def serves(self, node: str) -> bool:
        """The node has a pool of our driver (complete or not)."""
        return node in self._node_pool

    @property
    def empty(self) -> bool:
        return not self._node_pool

    def nodes(self, names: Iterable[str], *, exclude_pod: str = "") -> dict[str, tuple[DraNode, frozenset[int]]]:
        """Each named node with a complete pool: its view and the GPUs held (allocated, or pending for another pod
        than `exclude_pod`)."""
        out: dict[str, tuple[DraNode, frozenset[int]]] = {}
        now = self.clock()
        with self._lock:
            expired = [uid for uid, (_, _, until) in self._pending.items() if until <= now]
            for uid in expired:
                del self._pending[uid]
            pending: dict[str, set[int]] = {}
            for uid, (node, gpus, _) in self._pending.items():
                if uid != exclude_pod:
                    pending.setdefault(node, set()).update(gpus)
            for name in names:
                pool_name = self._node_pool.get(name)
                if pool_name is None:
                    continue
                view = self._view(pool_name)
                if view is None:
                    continue
                used: set[int] = set(pending.get(name, ()))
                for gpus in self._used.get(pool_name, {}).values():
                    used |= gpus
                out[name] = (view, frozenset(used))
        return out
