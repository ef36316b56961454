"""GPU health from NVML: Xid critical errors, GPUs that stop answering, and recovery.

Why each rule:
- Xid critical error events (nvmlEventSetWait) mark the GPU Unhealthy, except application Xids (13 graphics engine
  exception, 31 MMU fault, 43 GPU stopped processing, 45 preemptive cleanup, 68 video decoder exception, 109
  context switch timeout): those are a crashing pod's fault, not the GPU's, and NVIDIA's plugin ignores them too.
- An Xid that NVML cannot attribute to a device marks every watched GPU Unhealthy (nothing better is known).
- A health probe (default: nvmlDeviceGetMemoryInfo, which the driver answers afresh each time) runs every
  `probe_interval_s`; a GPU whose probe fails (GPU_IS_LOST after Xid 79, ...) turns Unhealthy alone, so the other
  GPUs stay allocatable.
- Recovery, which NVIDIA's plugin lacks: a GPU whose probe passes continuously for `recovery_s` turns Healthy
  again (any new critical Xid or failed probe restarts that clock). `recovery_s=None` keeps Unhealthy for good.

MIG instances (`mig_instances`, keyed by MIG UUID, the id MIG resources advertise):
- An Xid carrying a GPU instance id (nvmlEventData_t gpuInstanceId != 0xFFFFFFFF) marks that instance Unhealthy
  (only its compute instance when the CI id is given too), not the GPU: the other instances keep serving. An Xid
  without instance ids is GPU-wide and marks the GPU, hence every instance on it.
- An instance is healthy when it is and its GPU is; it recovers as a GPU does, after `recovery_s` of passing probes
  of its GPU with no new Xid on it. A parent GPU that is not itself advertised is watched (Xid, probe) but never
  reported through `on_change`.

Transitions are reported through `on_change(ids, healthy)` (the device plugin's `ResourceManager.set_health`),
and those of MIG instances through `on_instance_change(uuids, healthy)`, in batches: events already queued are
drained before reporting, so an Xid storm is one transition.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

import structlog

# The defaults are the settings' (one definition: `gpuplugin run --help` shows them).
from gpuplugin.config import DEFAULT_IGNORED_XIDS, DEFAULT_PROBE_INTERVAL_S, DEFAULT_RECOVERY_S
from gputopo.discovery.nvml_backend import NvmlBackend, NvmlError, XidEvent, XidEventSet
from gputopo.workers import Worker

log = structlog.get_logger(__name__)

_MAX_BATCH = 256  # events drained per report, so a storm cannot starve the probes

OnChange = Callable[[list[str], bool], None]
Probe = Callable[[NvmlBackend, int], object]


def memory_probe(backend: NvmlBackend, gpu: int) -> object:
    """The default probe: a call the driver answers from the GPU's live state, not from a cache."""
    return backend.memory_total(gpu)


@dataclass
class _GpuHealth:
    healthy: bool = True
    passing_since: float | None = None  # while Unhealthy: when the probe started passing without a break
    reason: str = ""


@dataclass(frozen=True, slots=True)
class MigInstanceWatch:
    """A MIG device to watch: its parent GPU's NVML index, its GPU and compute instance ids, its MIG UUID."""

    gpu: int
    gpu_instance: int
    compute_instance: int
    uuid: str


class HealthMonitor(Worker):
    """Watches GPUs (NVML index -> advertised device id) in a thread; see the module docstring for the rules."""

    def __init__(
        self,
        backend: NvmlBackend,
        devices: Mapping[int, str],
        on_change: OnChange,
        *,
        ignored_xids: Iterable[int] = DEFAULT_IGNORED_XIDS,
        probe_interval_s: float = DEFAULT_PROBE_INTERVAL_S,
        recovery_s: float | None = DEFAULT_RECOVERY_S,
        probe: Probe = memory_probe,
        clock: Callable[[], float] = time.monotonic,
        wait_ms: int = 1000,
        error_backoff_s: float = 1.0,
        mig_instances: Iterable[MigInstanceWatch] = (),
        on_instance_change: OnChange | None = None,
    ) -> None:
        if probe_interval_s <= 0:
            raise ValueError(f"probe interval must be positive, got {probe_interval_s}")
        if recovery_s is not None and recovery_s < 0:
            raise ValueError(f"recovery time must be >= 0 or None, got {recovery_s}")
        super().__init__("gpu-health")
        self._backend = backend
        self._devices = dict(devices)
        self._on_change = on_change
        self._ignored = frozenset(ignored_xids)
        self._probe_interval = probe_interval_s
        self._recovery = recovery_s
        self._probe = probe
        self._clock = clock
        # NVML's wait cannot be interrupted: stop() takes effect within one wait.
        self._wait_ms = max(1, min(wait_ms, int(probe_interval_s * 1000)))
        self._error_backoff = error_backoff_s
        self._instances: dict[str, MigInstanceWatch] = {}
        for inst in mig_instances:
            if inst.uuid in self._instances:
                raise ValueError(f"MIG device {inst.uuid} listed twice")
            self._instances[inst.uuid] = inst
        self._on_instance_change = on_instance_change
        watched = dict.fromkeys([*self._devices, *(i.gpu for i in self._instances.values())])
        self._state = {gpu: _GpuHealth() for gpu in watched}
        self._inst_state = {uuid: _GpuHealth() for uuid in self._instances}
        self._lock = threading.Lock()

    # --- public -------------------------------------------------------------------------------------------------

    def watch_instances(self, instances: Iterable[MigInstanceWatch]) -> None:
        """Watch these MIG instances from now on (a re-partition changed them): the state of instances watched
        before is kept, new ones start healthy, and their GPUs are watched too."""
        fresh = {i.uuid: i for i in instances}
        with self._lock:
            self._instances = fresh
            self._inst_state = {u: self._inst_state.get(u) or _GpuHealth() for u in fresh}
            for inst in fresh.values():
                self._state.setdefault(inst.gpu, _GpuHealth())

    def unhealthy_ids(self) -> frozenset[str]:
        with self._lock:
            return frozenset(self._devices[g] for g, s in self._state.items() if not s.healthy and g in self._devices)

    def is_healthy(self, device_id: str) -> bool:
        with self._lock:
            return all(s.healthy for g, s in self._state.items() if self._devices.get(g) == device_id)

    def unhealthy_instances(self) -> frozenset[str]:
        """MIG UUIDs that are unhealthy, by their own Xids or because their GPU is."""
        with self._lock:
            return frozenset(u for u in self._instances if not self._instance_healthy(u))

    def is_instance_healthy(self, uuid: str) -> bool:
        """Unknown UUIDs are healthy: health knows faults, not inventory."""
        with self._lock:
            return uuid not in self._instances or self._instance_healthy(uuid)

    def _instance_healthy(self, uuid: str) -> bool:
        return self._inst_state[uuid].healthy and self._state[self._instances[uuid].gpu].healthy

    def _label(self, gpu: int) -> str:
        return self._devices.get(gpu, f"nvml-index-{gpu}")

    # --- the loop -----------------------------------------------------------------------------------------------

    def loop(self) -> None:
        events = self._open_events()
        next_probe = self._clock()
        wait_failures = 0
        try:
            while not self.stopping:
                changes: dict[int, bool] = {}
                with self._lock:
                    before = {u for u in self._instances if not self._instance_healthy(u)}
                probe_now = False
                if events is not None:
                    try:
                        self._drain(events, changes)
                        wait_failures = 0
                    except NvmlError as e:
                        wait_failures += 1
                        # Said once per run of failures: a lost GPU can fail every wait until it is reset.
                        (log.warning if wait_failures == 1 else log.debug)(
                            "plugin.health.xid_wait_failed", error=e.name, message=e.message, action="probing all GPUs"
                        )
                        probe_now = True
                        self.pause(self._error_backoff)  # a broken event set must not spin
                else:
                    self.pause(self._wait_ms / 1000.0)
                now = self._clock()
                if probe_now or now >= next_probe:
                    self._probe_all(now, changes)
                    next_probe = now + self._probe_interval
                self._report(changes)
                self._report_instances(before)
        except Exception:  # the thread must not die silently: say so, the plugin keeps serving
            log.exception("plugin.health.monitor_crashed")
        finally:
            if events is not None:
                try:
                    events.close()
                except NvmlError as e:
                    log.debug("plugin.health.event_set_free_failed", error=e.name)

    def _open_events(self) -> XidEventSet | None:
        try:
            events = self._backend.xid_event_set(self._state)
        except NvmlError as e:
            log.warning("plugin.health.xid_unavailable", error=e.name, message=e.message, fallback="health probe only")
            return None
        for gpu, err in events.failed.items():
            log.warning(
                "plugin.health.xid_not_registered",
                device=self._label(gpu),
                nvml_index=gpu,
                error=err.name,
                fallback="health probe only",
            )
        return events

    def _drain(self, events: XidEventSet, changes: dict[int, bool]) -> None:
        event = events.wait(self._wait_ms)
        count = 0
        while event is not None and count < _MAX_BATCH:
            self._on_xid(event, changes)
            count += 1
            event = events.wait(0)
        if event is not None:
            self._on_xid(event, changes)

    def _on_xid(self, event: XidEvent, changes: dict[int, bool]) -> None:
        if event.xid in self._ignored:
            log.info("plugin.health.xid_ignored", nvml_index=event.gpu, xid=event.xid, why="application error")
            return
        if event.gpu is None:
            targets = list(self._state)
            log.warning("plugin.health.xid_unattributed", xid=event.xid, action="marking every GPU unhealthy")
        elif event.gpu in self._state:
            targets = [event.gpu]
        else:
            log.debug("plugin.health.xid_unwatched_gpu", nvml_index=event.gpu, xid=event.xid)
            return
        if event.gpu is not None and event.gpu_instance is not None and self._on_instance_xid(event):
            return
        for gpu in targets:
            log.warning("plugin.health.xid_critical", device=self._label(gpu), nvml_index=gpu, xid=event.xid)
            self._mark_bad(gpu, f"Xid {event.xid}", changes)

    def _on_instance_xid(self, event: XidEvent) -> bool:
        """An Xid inside one MIG instance: mark the instances it names. False when the GPU has no watched
        instance at all, so the Xid is taken as GPU-wide (what a whole-GPU watch always did)."""
        on_gpu = [i for i in self._instances.values() if i.gpu == event.gpu]
        if not on_gpu:
            return False
        hit = [
            i
            for i in on_gpu
            if i.gpu_instance == event.gpu_instance
            and (event.compute_instance is None or i.compute_instance == event.compute_instance)
        ]
        if not hit:
            log.warning("plugin.health.xid_unknown_instance", nvml_index=event.gpu, xid=event.xid,
                        gpu_instance=event.gpu_instance, compute_instance=event.compute_instance,
                        action="no advertised instance there; nothing marked")
            return True
        with self._lock:
            for inst in hit:
                s = self._inst_state[inst.uuid]
                s.healthy, s.passing_since, s.reason = False, None, f"Xid {event.xid}"
        for inst in hit:
            log.warning("plugin.health.xid_instance", device=inst.uuid, nvml_index=inst.gpu, xid=event.xid,
                        gpu_instance=inst.gpu_instance, compute_instance=inst.compute_instance)
        return True

    def _probe_all(self, now: float, changes: dict[int, bool]) -> None:
        for gpu in list(self._state):
            try:
                self._probe(self._backend, gpu)
            except NvmlError as e:
                if self._state[gpu].healthy:
                    log.warning("plugin.health.probe_failed", device=self._label(gpu), nvml_index=gpu, error=e.name)
                self._mark_bad(gpu, e.name, changes)
                continue
            self._recover_instances(gpu, now)
            with self._lock:
                s = self._state[gpu]
                if s.healthy or self._recovery is None:
                    continue
                if s.passing_since is None:
                    s.passing_since = now
                if now - s.passing_since >= self._recovery:
                    s.healthy, s.passing_since, reason = True, None, s.reason
                    changes[gpu] = True
                else:
                    continue
            log.info("plugin.health.gpu_recovered", device=self._label(gpu), nvml_index=gpu, after=reason,
                     passing_s=self._recovery)

    def _recover_instances(self, gpu: int, now: float) -> None:
        """A passing probe of `gpu` counts towards the recovery of its unhealthy instances."""
        if self._recovery is None:
            return
        recovered = []
        with self._lock:
            for uuid, inst in self._instances.items():
                s = self._inst_state[uuid]
                if inst.gpu != gpu or s.healthy:
                    continue
                if s.passing_since is None:
                    s.passing_since = now
                if now - s.passing_since >= self._recovery:
                    s.healthy, s.passing_since = True, None
                    recovered.append((uuid, s.reason))
        for uuid, reason in recovered:
            log.info("plugin.health.instance_recovered", device=uuid, nvml_index=gpu, after=reason,
                     passing_s=self._recovery)

    def _mark_bad(self, gpu: int, reason: str, changes: dict[int, bool]) -> None:
        with self._lock:
            s = self._state[gpu]
            s.passing_since = None
            s.reason = reason
            if s.healthy:
                s.healthy = False
                changes[gpu] = False

    def _report(self, changes: dict[int, bool]) -> None:
        for healthy in (False, True):
            ids = sorted(self._devices[g] for g, h in changes.items() if h is healthy and g in self._devices)
            if not ids:
                continue
            try:
                self._on_change(ids, healthy)
            except Exception:
                log.exception("plugin.health.callback_failed", devices=ids, healthy=healthy)

    def _report_instances(self, before: set[str]) -> None:
        """Report the instances whose effective health (own and GPU's) changed since `before` was taken."""
        if not self._instances:
            return
        with self._lock:
            after = {u for u in self._instances if not self._instance_healthy(u)}
        for healthy, ids in ((False, sorted(after - before)), (True, sorted(before - after))):
            if not ids or self._on_instance_change is None:
                continue
            try:
                self._on_instance_change(ids, healthy)
            except Exception:
                log.exception("plugin.health.callback_failed", devices=ids, healthy=healthy)
