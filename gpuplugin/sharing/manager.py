"""The resource manager of one shared resource: replicas `<gpu id>::<n>` of its GPUs, served like whole GPUs.

It is a ResourceManager (same streams, metrics and servicer; its own socket and registration through PluginRunner)
whose devices are replicas carrying their parent's health and NUMA node. What differs: health is the parent GPU's
and, under MPS, the daemon's; the preference is decided on parent GPUs (gpuplugin.sharing.preferred); Allocate
refuses what the config forbids (more than one replica under failRequestsGreaterThanOne, two replicas of one GPU
unless distinctGpus is false) and gives the container each physical GPU once, plus the MPS environment.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Iterable, Sequence
from typing import Any

import structlog

from gpuplugin.deviceplugin.allocation import ContainerAllocation
from gpuplugin.deviceplugin.devices import Device
from gpuplugin.deviceplugin.errors import AllocationRequestError, UnknownDeviceError
from gpuplugin.deviceplugin.preferred import Preference, Source
from gpuplugin.deviceplugin.resource import DeviceState, ResourceManager, brief_ids
from gpuplugin.sharing.layout import SharedSet
from gpuplugin.sharing.mps import MpsShare
from gpuplugin.sharing.preferred import Replicas, choose_replicas
from gputopo.contract import replica_id
from gputopo.core.topology import Topology
from gputopo.logs import Repeats

log = structlog.get_logger(__name__)


class SharedResourceManager(ResourceManager):
    def __init__(self, topology: Topology, shared: SharedSet, *, mps: MpsShare | None = None,
                 **kwargs: Any) -> None:
        super().__init__(topology, gpus=(), **kwargs)
        self.shared = shared
        self.resource_name = shared.name
        self.mps = mps
        by_index = {d.index: d for d in self.all_devices}
        self.parents = {i: by_index[i] for i in shared.gpus}
        replicas = [Device(replica_id(p.id, k), p.index, p.uuid, p.minor, p.nvml_index, p.numa_node)
                    for i, n in shared.replicas for p in (self.parents[i],) for k in range(n)]
        self._parent_index = {p.id: i for i, p in self.parents.items()} | {p.uuid: i for i, p in self.parents.items()}
        self._sick: set[int] = set()
        self._service_ok = mps is None  # an MPS set is unhealthy until its daemon answers
        with self._lock:
            self.devices = tuple(replicas)
            self._by_id = {d.id: d for d in replicas}
            self._by_uuid = {}
            self._healthy = {d.id: self._service_ok for d in replicas}
        self._replicas = Replicas(self._by_id, self.parents, dict(shared.replicas), shared.distinct_gpus,
                                  at_most_one=shared.fail_requests_greater_than_one)
        # a pod the node cannot admit is asked about again each time its controller recreates it
        self._fallbacks = Repeats(self.log_interval_s, self.clock)

    def _update_gauge(self) -> None:
        """The devices gauge counts whole GPUs (one gauge per process); replicas are published in the node state."""

    @property
    def parent_ids(self) -> list[str]:
        return [p.id for p in self.parents.values()]

    # ---- health: the parent GPU's, and the MPS daemon's ----

    def resolve(self, ids: Iterable[str]) -> list[Device]:
        """Replicas by replica id, or all replicas of a GPU by its advertised id or UUID (health monitors)."""
        out, unknown = [], []
        for x in ids:
            if x in self._by_id:
                out.append(self._by_id[x])
            elif x in self._parent_index:
                index = self._parent_index[x]
                out += [d for d in self.devices if d.index == index]
            else:
                unknown.append(x)
        if unknown:
            raise UnknownDeviceError(unknown)
        return out

    def knows(self, gpu: str) -> bool:
        return gpu in self._parent_index

    def set_health(self, ids: Iterable[str], healthy: bool) -> list[str]:
        gpus = {d.index for d in self.resolve(ids)}
        with self._lock:
            self._sick = self._sick - gpus if healthy else self._sick | gpus
        return self._reconcile_health()

    def set_service_health(self, ok: bool) -> list[str]:
        """The MPS daemon answers (True) or not: every replica follows."""
        self._service_ok = ok
        return self._reconcile_health()

    def _reconcile_health(self) -> list[str]:
        with self._lock:
            want = {d.id: self._service_ok and d.index not in self._sick for d in self.devices}
            changed = [x for x, ok in want.items() if self._healthy[x] != ok]
            self._healthy = want
            snap = tuple(DeviceState(d, want[d.id]) for d in self.devices)
            subs = list(self._subs)
        if changed:
            log.info("plugin.replicas.health_changed", resource=self.resource_name, devices=brief_ids(changed),
                     service=self._service_ok, sick_gpus=sorted(self._sick))
            for sub in subs:
                sub.offer(snap)
        return changed

    # ---- allocation ----

    def prewarm(self, budget: int = 4096) -> None:
        """The whole-GPU prewarm covers the parents' subsets: the allocator's memo is shared by topology."""

    def preferred(self, available_ids: Sequence[str], must_include_ids: Sequence[str], size: int) -> Preference:
        pref = choose_replicas(self.topology, self._replicas, available_ids, must_include_ids, size, self._plans)
        if pref.source is Source.PLAN:
            self.metrics.plan_hits.inc()
        elif pref.reason is not None:
            self.metrics.preferred_fallbacks.labels(reason=pref.reason.value).inc()
        if pref.problems and (quiet := self._fallbacks.admit()) is not None:
            log.warning("plugin.preferred.fallback", resource=self.resource_name,
                        problems=brief_ids(pref.problems, width=200), reason=pref.reason.value if pref.reason else None,
                        available=brief_ids(available_ids), size=size, answer=list(pref.ids),
                        not_logged_since_last=quiet)
        return pref

    def _allocate(self, ids: Sequence[str]) -> ContainerAllocation:
        devices = self._checked(ids)
        if self.shared.fail_requests_greater_than_one and len(devices) > 1:
            # NVIDIA's wording, so runbooks keyed on it keep working
            raise AllocationRequestError(f"request for '{self.resource_name}: {len(devices)}' too large: maximum "
                                         "request size for shared resources is 1")
        held = Counter(d.index for d in devices)
        if self.shared.distinct_gpus:
            twice = sorted(self.parents[i].id for i, n in held.items() if n > 1)
            if twice:
                raise AllocationRequestError(
                    f"request holds several replicas of GPU {brief_ids(twice)}; {self.resource_name} gives distinct "
                    "GPUs (distinctGpus: false in the sharing config allows replicas of one GPU)")
        parents = [self.parents[i] for i in sorted(held)]
        alloc = self._container_allocation(parents)
        if self.mps is None:
            return alloc
        env, mounts = self.mps.client([(p.uuid, held[p.index]) for p in parents])
        return dataclasses.replace(alloc, envs={**alloc.envs, **env}, mounts=alloc.mounts + mounts)
