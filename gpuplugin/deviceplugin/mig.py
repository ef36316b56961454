"""The resource manager of one MIG resource (`nvidia.com/mig-1g.10gb`, or `nvidia.com/gpu` under the single
strategy): MIG devices advertised by MIG UUID, served like whole GPUs (same streams, checks and metrics; its own
socket and registration through PluginRunner).

What differs from whole GPUs, and why:
- Allocate answers as NVIDIA's plugin does for a MIG device (docs/reference/gpu-sharing.md §2.1):
  NVIDIA_VISIBLE_DEVICES (or the CDI name) is the MIG UUID, which the container toolkit resolves to the parent GPU
  and the instance; the device nodes are the parent's /dev/nvidiaN and the GPU and compute instance capability
  nodes /dev/nvidia-caps/nvidia-cap<N> (from mig-minors), plus the control nodes of the whole-GPU path.
- The preference takes the extender's pending plan first (its ids are MIG UUIDs; gpuplugin.plan_watch gives each
  MIG resource its own plans), checked against the request as the whole-GPU path checks it; a plan that does not
  fit is logged and the node's own choice answers. That choice packs: MIG instances have no NVLink between them,
  so a container asking for several gets them on the fewest GPUs, taken from the GPUs already partly used first
  (whole free GPUs stay for bigger asks).
- Time-slicing (NVIDIA offers it on MIG devices): a shared instance is advertised as replicas `<MIG UUID>::<n>`,
  and Allocate applies the sharing config's rules (failRequestsGreaterThanOne, distinctGpus) to MIG devices.
- The set of devices changes without a restart when the GPU is re-partitioned (`set_instances`); the caller
  (gpuplugin.sharing.mig_node) keeps advertising an instance a pod still holds.
"""

from __future__ import annotations

import dataclasses
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import structlog

from gpuplugin.deviceplugin.allocation import (
    CDI_KIND,
    ContainerAllocation,
    ListStrategy,
    cdi_annotation_key,
    control_nodes,
    existing_nodes,
)
from gpuplugin.deviceplugin.devices import Device
from gpuplugin.deviceplugin.errors import AllocationRequestError
from gpuplugin.deviceplugin.preferred import FallbackReason, Preference, Source
from gpuplugin.deviceplugin.resource import DeviceState, ResourceManager, brief_ids
from gpuplugin.sharing.layout import MigShare
from gpuplugin.sharing.mig_strategy import MigInstance
from gputopo.contract import replica_id

log = structlog.get_logger(__name__)

VISIBLE_DEVICES_ENV = "NVIDIA_VISIBLE_DEVICES"


def mig_device(inst: MigInstance, numa_node: int | None = None) -> Device:
    """A MIG instance as a Device: id and uuid its MIG UUID, index and minor its parent GPU's."""
    parent_minor = inst.minor if inst.minor is not None else inst.nvml_index
    return Device(inst.uuid, inst.nvml_index, inst.uuid, parent_minor, inst.nvml_index, numa_node)


class MigResourceManager(ResourceManager):
    def __init__(self, resource_name: str, instances: Iterable[MigInstance], *, share: MigShare | None = None,
                 numa: dict[int, int | None] | None = None, **kwargs: Any) -> None:
        super().__init__(None, gpus=(), **kwargs)
        self.resource_name = resource_name
        self._numa = dict(numa or {})
        self._instances: dict[str, MigInstance] = {}
        self.share: MigShare | None = None
        self.set_instances(instances, share)

    def _update_gauge(self) -> None:
        """The devices gauge counts whole GPUs (one gauge per process); MIG devices are in the node's state."""

    def instances(self) -> tuple[MigInstance, ...]:
        with self._lock:
            return tuple(self._instances[u] for u in sorted(self._instances))

    def set_instances(self, instances: Iterable[MigInstance], share: MigShare | None = None) -> None:
        """Serve these instances from now on (a re-partition), as replicas `<MIG UUID>::<n>` of those `share`
        shares (time-slicing); health is kept for devices served before, and every stream gets the new complete
        list at once."""
        by_uuid = {i.uuid: i for i in instances}
        devices: list[Device] = []
        for u in sorted(by_uuid):
            base = mig_device(by_uuid[u], self._numa.get(by_uuid[u].nvml_index))
            n = share.replicas.get(u) if share is not None else None
            devices += [base] if n is None else [dataclasses.replace(base, id=replica_id(u, k)) for k in range(n)]
        with self._lock:
            self._instances = by_uuid
            self.share = share
            self.devices = tuple(devices)
            self._by_id = {d.id: d for d in devices}
            self._by_uuid = {d.uuid: d for d in devices if d.id == d.uuid}
            self._healthy = {d.id: self._healthy.get(d.id, True) for d in devices}
            snap = tuple(DeviceState(d, self._healthy[d.id]) for d in devices)
            subs = list(self._subs)
        for sub in subs:
            sub.offer(snap)

    def knows(self, uuid: str) -> bool:
        with self._lock:
            return uuid in self._instances

    # ---- allocation ----

    def prewarm(self, budget: int = 4096) -> None:
        """Nothing to warm: the preference is a sort, not a search."""

    def preferred(self, available_ids: Sequence[str], must_include_ids: Sequence[str], size: int) -> Preference:
        """Fewest GPUs, partly used GPUs first: must-include ids, then, while some are missing, all from the GPU
        with the fewest available instances that can give them all (best fit), else as many as the fullest GPU
        gives (ties: lower NVML index). Never raises; unknown ids are left out and logged."""
        with self._lock:
            by_id = dict(self._by_id)
        problems = [f"unknown device id {x!r}" for x in available_ids if x not in by_id]
        avail = list(dict.fromkeys(x for x in available_ids if x in by_id))
        must = [x for x in dict.fromkeys(must_include_ids) if x in avail]
        if size <= 0 or size > len(avail):
            problems.append(f"size {size} does not fit the {len(avail)} valid available devices")
            pref = Preference(tuple(avail[: max(size, 0)]), Source.FALLBACK, FallbackReason.BAD_REQUEST,
                              tuple(problems))
        elif not problems and (planned := self._from_plan(by_id, avail, must, size)) is not None:
            return planned
        else:
            per_gpu: dict[int, list[str]] = defaultdict(list)
            # replicas: the first of each instance first, so a request spreads over distinct instances
            for x in sorted(avail, key=lambda x: (int(x.rpartition("::")[2]) if by_id[x].id != by_id[x].uuid else 0,
                                                   x)):
                if x not in must:
                    per_gpu[by_id[x].index].append(x)
            share = self.share
            if share is not None and share.distinct:
                seen = {by_id[x].uuid for x in must}
                for gpu, xs in per_gpu.items():
                    kept = []
                    for x in xs:
                        if by_id[x].uuid not in seen:
                            seen.add(by_id[x].uuid)
                            kept.append(x)
                    per_gpu[gpu] = kept
                per_gpu = defaultdict(list, {g: xs for g, xs in per_gpu.items() if xs})
            chosen = list(must[:size])
            while len(chosen) < size and per_gpu:
                left = size - len(chosen)
                fits = [g for g in per_gpu if len(per_gpu[g]) >= left]
                # one GPU can finish: the one with the fewest instances left (best fit); else the fullest one
                gpu = (min(fits, key=lambda g: (len(per_gpu[g]), g)) if fits
                       else max(per_gpu, key=lambda g: (len(per_gpu[g]), -g)))
                chosen += per_gpu.pop(gpu)[:left]
            chosen += [x for x in avail if x not in chosen][: size - len(chosen)]  # distinct ones ran out
            reason = FallbackReason.BAD_REQUEST if problems else FallbackReason.NO_PLAN
            pref = Preference(tuple(chosen), Source.ALLOCATOR, reason, tuple(problems))
        if pref.problems:
            self.metrics.preferred_fallbacks.labels(reason=FallbackReason.BAD_REQUEST.value).inc()
            log.warning("plugin.preferred.fallback", resource=self.resource_name,
                        problems=brief_ids(pref.problems, width=200), available=brief_ids(available_ids),
                        size=size, answer=list(pref.ids))
        return pref

    def _from_plan(self, by_id: dict[str, Device], avail: Sequence[str], must: Sequence[str],
                   size: int) -> Preference | None:
        """The pending plan's answer (each planned MIG UUID as its first available id: itself, or a replica of it
        under time-slicing), or None, logged, when there is no plan source, no plan, or a plan that cannot be met."""
        plans = self._plans
        if plans is None:
            return None
        by_uuid: dict[str, list[str]] = defaultdict(list)
        for x in avail:
            by_uuid[by_id[x].uuid].append(x)
        must_uuids = list(dict.fromkeys(by_id[x].uuid for x in must))
        if len(must_uuids) != len(must):  # several replicas of one instance must go: no plan of distinct UUIDs fits
            return None
        reason = FallbackReason.PLAN_REJECTED
        try:
            plan = plans.pending_plan(list(by_uuid), must_uuids, size)
        except Exception as e:  # a faulty plan source must not fail pod admission
            plan, why, reason = None, f"plan source raised {type(e).__name__}: {e}", FallbackReason.PLAN_ERROR
        else:
            why = None if plan is None else _plan_problem(plan, by_uuid, must_uuids, size)
        if plan is not None and why is None:
            chosen = [x for u in plan for x in ([m for m in must if by_id[m].uuid == u] or by_uuid[u][:1])]
            self.metrics.plan_hits.inc()
            return Preference(tuple(chosen), Source.PLAN)
        if why is not None:
            self.metrics.preferred_fallbacks.labels(reason=reason.value).inc()
            log.warning("plugin.preferred.plan_unmet", resource=self.resource_name, problem=why[:300],
                        available=brief_ids(avail), size=size, action="the node's own choice answers")
        return None

    def _allocate(self, ids: Sequence[str]) -> ContainerAllocation:
        devices = self._checked(ids)
        share = self.share
        held = Counter(d.uuid for d in devices)
        if share is not None and share.fail_requests_greater_than_one and len(devices) > 1:
            raise AllocationRequestError(f"request for '{self.resource_name}: {len(devices)}' too large: maximum "
                                         "request size for shared resources is 1")
        twice = sorted(u for u, n in held.items() if n > 1)
        if share is not None and share.distinct and twice:
            raise AllocationRequestError(
                f"request holds several replicas of MIG device {brief_ids(twice)}; {self.resource_name} gives "
                "distinct MIG devices (distinctGpus: false in the sharing config allows replicas of one)")
        with self._lock:
            instances = [self._instances[u] for u in held]
        alloc = mig_container_allocation(instances, self.list_strategy, self.keys.gpus, self.dev_root)
        if alloc.missing_nodes and (quiet := self._missing_nodes.admit()) is not None:
            log.warning("plugin.allocate.device_nodes_missing", resource=self.resource_name,
                        missing=list(alloc.missing_nodes), dev_root=str(self.dev_root), not_logged_since_last=quiet)
        return alloc


def _plan_problem(plan: object, available: Mapping[str, Sequence[str]], must: Sequence[str], size: int) -> str | None:
    """Why a MIG plan (distinct MIG UUIDs) cannot answer the request, or None."""
    if not isinstance(plan, (list, tuple)) or not all(isinstance(x, str) for x in plan):
        return f"plan is not a list of MIG UUIDs: {plan!r}"
    if len(set(plan)) != len(plan):
        return f"plan repeats MIG devices: {list(plan)}"
    if len(plan) != size:
        return f"plan has {len(plan)} MIG devices, the request asks for {size}"
    outside = [x for x in plan if x not in available]
    if outside:
        return f"plan MIG devices not available: {', '.join(outside)}"
    missing = [x for x in must if x not in plan]
    if missing:
        return f"plan lacks must-include MIG devices: {', '.join(missing)}"
    return None


def mig_container_allocation(instances: Sequence[MigInstance], strategy: ListStrategy, gpus_key: str,
                             dev_root: Path) -> ContainerAllocation:
    """What a container gets for these MIG devices; a pure function of them and the host's device nodes (the
    kubelet checkpoints and replays the answer)."""
    ordered = sorted(instances, key=lambda i: i.uuid)
    uuids = [i.uuid for i in ordered]
    annotations = {gpus_key: ",".join(uuids)}
    envs: dict[str, str] = {}
    cdi: tuple[str, ...] = ()
    names = [f"{CDI_KIND}={u}" for u in uuids]  # nvidia-ctk's CDI spec names a MIG device by its UUID too
    if strategy is ListStrategy.ENVVAR:
        envs[VISIBLE_DEVICES_ENV] = ",".join(uuids)
    elif strategy is ListStrategy.CDI_ANNOTATIONS:
        annotations[cdi_annotation_key(uuids)] = ",".join(names)
    else:
        cdi = tuple(names)
    wanted = list(dict.fromkeys(p for i in ordered for p in i.device.device_nodes))
    nodes, missing = existing_nodes(wanted, dev_root)
    unknown = [i.uuid for i in ordered if not i.device.device_nodes]
    return ContainerAllocation(envs=envs, device_nodes=nodes + control_nodes(dev_root), annotations=annotations,
                               cdi_devices=cdi, missing_nodes=missing + tuple(f"{u} (no mig-minors)" for u in unknown))
