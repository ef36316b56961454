"""The resource manager: the plugin's devices, their health, and its allocation answers. No gRPC here.

The gRPC servicer is a thin translation of these methods; health monitors call `set_health`; every ListAndWatch
stream holds a `Subscription` that always offers the newest complete device list.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import structlog

from gpuplugin.deviceplugin.allocation import ContainerAllocation, ListStrategy, container_allocation
from gpuplugin.deviceplugin.devices import Device, IdStrategy, build_devices
from gpuplugin.deviceplugin.errors import AllocationRequestError, UnknownDeviceError
from gpuplugin.deviceplugin.plans import PlanSource
from gpuplugin.deviceplugin.preferred import Preference, Source, choose_preferred
from gpuplugin.metrics import PluginMetrics
from gputopo.contract import DEFAULT_KEYS, Keys
from gputopo.core.allocator import best_subset
from gputopo.core.topology import Topology
from gputopo.logs import REPEAT_INTERVAL_S, Repeats

log = structlog.get_logger(__name__)


@dataclass(frozen=True, slots=True)
class DeviceState:
    device: Device
    healthy: bool


Snapshot = tuple[DeviceState, ...]


class Subscription:
    """The newest complete device list one stream has not sent yet. Older unsent lists are dropped: every list is
    complete, so only the newest matters. Read by a thread (`next`) or by a coroutine (`next_async`, the gRPC
    server's streams: one waiting stream costs no thread); offered and closed from any thread."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._pending: Snapshot | None = None
        self._closed = False
        self._wakers: list[Callable[[], None]] = []

    def _notify(self) -> None:
        self._cond.notify_all()
        for wake in self._wakers:
            wake()

    def offer(self, snapshot: Snapshot) -> None:
        with self._cond:
            self._pending = snapshot
            self._notify()

    def _take(self) -> tuple[bool, Snapshot | None]:
        """(ready, value) under the lock: ready when closed (None) or a list is pending (taken)."""
        if self._closed:
            return True, None
        if self._pending is None:
            return False, None
        snap, self._pending = self._pending, None
        return True, snap

    def next(self, timeout: float | None = None) -> Snapshot | None:
        """Block until a list is pending (returned) or the subscription is closed or times out (None)."""
        with self._cond:
            self._cond.wait_for(lambda: self._pending is not None or self._closed, timeout)
            return self._take()[1]

    async def next_async(self) -> Snapshot | None:
        """Wait, without holding a thread, until a list is pending (returned) or the subscription is closed (None).
        Cancelling the waiting task (the client went away) leaves nothing registered."""
        loop = asyncio.get_running_loop()
        event = asyncio.Event()

        def wake() -> None:
            with contextlib.suppress(RuntimeError):  # the loop is already closed: nobody is waiting any more
                loop.call_soon_threadsafe(event.set)

        while True:
            with self._cond:
                ready, snap = self._take()
                if ready:
                    return snap
                self._wakers.append(wake)
            try:
                await event.wait()
            finally:
                with self._cond:
                    self._wakers.remove(wake)
            event.clear()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._notify()

    @property
    def closed(self) -> bool:
        return self._closed


class ResourceManager:
    """Devices of one extended resource built from a Topology, with health, preference and allocation logic.
    Subclasses serve other devices with the same streams, health and checks: replicas (gpuplugin.sharing.manager)
    and MIG instances (gpuplugin.deviceplugin.mig)."""

    def __init__(
        self,
        topology: Topology | None,
        *,
        id_strategy: IdStrategy | str = IdStrategy.UUID,
        list_strategy: ListStrategy | str = ListStrategy.ENVVAR,
        keys: Keys = DEFAULT_KEYS,
        dev_root: Path | str = "/",
        minors: Mapping[int, int] | None = None,
        nvml_indices: Mapping[int, int] | None = None,
        plans: PlanSource | None = None,
        metrics: PluginMetrics | None = None,
        log_interval_s: float = REPEAT_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
        gpus: Iterable[int] | None = None,
    ) -> None:
        self.topology = topology
        self.id_strategy = IdStrategy(id_strategy)
        self.list_strategy = ListStrategy(list_strategy)
        self.keys = keys
        self.dev_root = Path(dev_root)
        # None: devices that are not whole GPUs of a topology (MIG instances: gpuplugin.deviceplugin.mig)
        self.all_devices = () if topology is None else build_devices(topology, self.id_strategy, minors, nvml_indices)
        served = None if gpus is None else frozenset(gpus)
        self.devices = tuple(d for d in self.all_devices if served is None or d.index in served)
        self.metrics = metrics if metrics is not None else PluginMetrics()
        self._plans = plans
        self._by_id = {d.id: d for d in self.devices}
        self._by_uuid = {d.uuid: d for d in self.devices}
        self._lock = threading.Lock()
        self._healthy = {d.id: True for d in self.devices}
        self._subs: set[Subscription] = set()
        # Warnings a client can repeat without end (every Allocate, every refused stream): first, then a count.
        self.log_interval_s = log_interval_s
        self.clock = clock
        self._missing_nodes = Repeats(log_interval_s, clock)
        self._update_gauge()

    # ---- devices and health ----

    def snapshot(self) -> Snapshot:
        with self._lock:
            return tuple(DeviceState(d, self._healthy[d.id]) for d in self.devices)

    def healthy_ids(self) -> list[str]:
        with self._lock:
            return [d.id for d in self.devices if self._healthy[d.id]]

    def unhealthy_ids(self) -> list[str]:
        with self._lock:
            return [d.id for d in self.devices if not self._healthy[d.id]]

    def resolve(self, ids: Iterable[str]) -> list[Device]:
        """Devices by advertised id or by GPU UUID (health monitors know UUIDs). Raises UnknownDeviceError."""
        out, unknown = [], []
        for x in ids:
            dev = self._by_id.get(x) or self._by_uuid.get(x)
            if dev is None:
                unknown.append(x)
            else:
                out.append(dev)
        if unknown:
            raise UnknownDeviceError(unknown)
        return out

    def set_health(self, ids: Iterable[str], healthy: bool) -> list[str]:
        """Mark devices (advertised ids or UUIDs) healthy or not; return the advertised ids that changed. Any change
        sends every ListAndWatch stream a new complete list at once. Unknown ids raise before anything changes."""
        devices = self.resolve(ids)
        with self._lock:
            changed = [d.id for d in devices if self._healthy[d.id] != healthy]
            for dev_id in changed:
                self._healthy[dev_id] = healthy
            snap = tuple(DeviceState(d, self._healthy[d.id]) for d in self.devices)
            subs = list(self._subs)
        if changed:
            to = "healthy" if healthy else "unhealthy"
            self.metrics.health_transitions.labels(to=to).inc(len(changed))
            self._update_gauge()
            log.info("plugin.device.health_changed", devices=changed, health=to)
            for sub in subs:
                sub.offer(snap)
        return changed

    def _update_gauge(self) -> None:
        unhealthy = len(self.unhealthy_ids())
        self.metrics.devices.labels(health="healthy").set(len(self.devices) - unhealthy)
        self.metrics.devices.labels(health="unhealthy").set(unhealthy)

    def subscribe(self) -> Subscription:
        """A subscription that already holds the current list (ListAndWatch sends it at once)."""
        sub = Subscription()
        with self._lock:
            self._subs.add(sub)
            sub.offer(tuple(DeviceState(d, self._healthy[d.id]) for d in self.devices))
        return sub

    def unsubscribe(self, sub: Subscription) -> None:
        sub.close()
        with self._lock:
            self._subs.discard(sub)

    def close(self) -> None:
        """End every stream's subscription (shutdown)."""
        with self._lock:
            subs, self._subs = list(self._subs), set()
        for sub in subs:
            sub.close()

    def set_gpus(self, gpus: Iterable[int]) -> None:
        """Serve these GPUs (topology indices) from now on: a sharing config moved GPUs between whole and shared.
        Health is kept for GPUs served before; every stream gets the new complete list at once."""
        served = frozenset(gpus)
        with self._lock:
            self.devices = tuple(d for d in self.all_devices if d.index in served)
            self._by_id = {d.id: d for d in self.devices}
            self._by_uuid = {d.uuid: d for d in self.devices}
            self._healthy = {d.id: self._healthy.get(d.id, True) for d in self.devices}
            snap = tuple(DeviceState(d, self._healthy[d.id]) for d in self.devices)
            subs = list(self._subs)
        self._update_gauge()
        for sub in subs:
            sub.offer(snap)

    # ---- allocation ----

    def set_plan_source(self, plans: PlanSource | None) -> None:
        self._plans = plans

    def prewarm(self, budget: int = 4096) -> None:
        """Fill the allocator's memo with the questions this node will be asked, so GetPreferredAllocation answers
        from it (a cold search at 16 GPUs costs milliseconds; a memo hit microseconds). Up to 10 GPUs that is every
        free set and size (at most 5,120 questions); beyond, the free sets this node reaches when pods of the
        common sizes take the allocator's own choices, breadth first, up to `budget` questions."""
        start = time.perf_counter()
        everything = frozenset(d.index for d in self.devices)
        asked = 0
        if len(everything) <= 10:
            members = sorted(everything)
            for mask in range(1, 1 << len(members)):
                free = [members[i] for i in range(len(members)) if mask >> i & 1]
                for size in range(1, len(free) + 1):
                    best_subset(self.topology, free, size)
                    asked += 1
        else:
            seen = {everything}
            frontier = [everything]
            while frontier and asked < budget:
                free = frontier.pop(0)
                for size in range(1, len(free) + 1):
                    chosen = best_subset(self.topology, free, size).gpus
                    asked += 1
                    rest = free - set(chosen)
                    if size in (1, 2, 4, 8) and rest and rest not in seen:
                        seen.add(rest)
                        frontier.append(rest)
        log.info("plugin.allocator.prewarmed", gpus=len(everything), questions=asked,
                 seconds=round(time.perf_counter() - start, 3))

    def preferred(self, available_ids: Sequence[str], must_include_ids: Sequence[str], size: int) -> Preference:
        """One container's preference. Never raises: problems are logged and counted, and answered validly."""
        pref = choose_preferred(self.topology, self._by_id, available_ids, must_include_ids, size, self._plans)
        if pref.source is Source.PLAN:
            self.metrics.plan_hits.inc()
        elif pref.reason is not None:
            self.metrics.preferred_fallbacks.labels(reason=pref.reason.value).inc()
        if pref.problems:
            log.warning(
                "plugin.preferred.fallback",
                problems=brief_ids(pref.problems, width=200),
                reason=pref.reason.value if pref.reason else None,
                available=brief_ids(available_ids),
                must_include=brief_ids(must_include_ids),
                size=size,
                answer=list(pref.ids),
            )
        return pref

    def allocate(self, ids: Sequence[str]) -> ContainerAllocation:
        """The response for one container. Raises AllocationRequestError for empty, repeated, unknown or
        unhealthy ids (the kubelet only asks for healthy devices it was told about, so this means a bug or a race)."""
        try:
            alloc = self._allocate(ids)
        except AllocationRequestError:
            self.metrics.allocations.labels(result="invalid").inc()
            raise
        self.metrics.allocations.labels(result="ok").inc()
        return alloc

    def _allocate(self, ids: Sequence[str]) -> ContainerAllocation:
        return self._container_allocation(self._checked(ids))

    def _container_allocation(self, devices: Sequence[Device]) -> ContainerAllocation:
        """What the container gets for these GPUs; device nodes the host lacks are logged, rate-limited."""
        alloc = container_allocation(
            self.topology, devices, self.list_strategy, self.id_strategy, self.keys, self.dev_root
        )
        if alloc.missing_nodes and (quiet := self._missing_nodes.admit()) is not None:
            log.warning("plugin.allocate.device_nodes_missing", missing=list(alloc.missing_nodes),
                        dev_root=str(self.dev_root), not_logged_since_last=quiet)
        return alloc

    def _checked(self, ids: Sequence[str]) -> list[Device]:
        """The devices of an Allocate request; raises AllocationRequestError for empty, repeated, unknown or
        unhealthy ids."""
        if not ids:
            raise AllocationRequestError("allocate request names no devices")
        dups = sorted(x for x, n in Counter(ids).items() if n > 1)  # linear: a request may hold 100k+ ids
        if dups:
            raise AllocationRequestError(f"allocate request repeats device ids: {brief_ids(dups)}")
        unknown = [x for x in ids if x not in self._by_id]
        if unknown:
            raise AllocationRequestError(f"unknown device ids: {brief_ids(unknown)}")
        devices = [self._by_id[x] for x in ids]
        with self._lock:
            sick = [d.id for d in devices if not self._healthy[d.id]]
        if sick:
            raise AllocationRequestError(f"unhealthy device ids: {brief_ids(sick)}")
        return devices


def brief_ids(ids: Sequence[str], most: int = 8, width: int = 64) -> str:
    """Ids for an error message or a log line, bounded: a refusal travels back as gRPC trailing metadata, which
    clients cap (16 KiB in grpc-core), a log line lands on the node's disk, and a hostile request can name any
    number of ids of any length."""
    shown = [x if len(x) <= width else f"{x[:width]}...({len(x)} chars)" for x in ids[:most]]
    more = f" and {len(ids) - most} more" if len(ids) > most else ""
    return ", ".join(shown) + more
