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

Transitions are reported through `on_change(ids, healthy)` (the device plugin's `ResourceManager.set_health`),
in batches: events already queued are drained before reporting, so an Xid storm is one transition.
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
        self._state = {gpu: _GpuHealth() for gpu in self._devices}
        self._lock = threading.Lock()

    # --- public -------------------------------------------------------------------------------------------------

    def unhealthy_ids(self) -> frozenset[str]:
        with self._lock:
            return frozenset(self._devices[g] for g, s in self._state.items() if not s.healthy)

    def is_healthy(self, device_id: str) -> bool:
        with self._lock:
            return all(s.healthy for g, s in self._state.items() if self._devices[g] == device_id)

    # --- the loop -----------------------------------------------------------------------------------------------

    def loop(self) -> None:
        events = self._open_events()
        next_probe = self._clock()
        wait_failures = 0
        try:
            while not self.stopping:
                changes: dict[int, bool] = {}
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
            events = self._backend.xid_event_set(self._devices)
        except NvmlError as e:
            log.warning("plugin.health.xid_unavailable", error=e.name, message=e.message, fallback="health probe only")
            return None
        for gpu, err in events.failed.items():
            log.warning(
                "plugin.health.xid_not_registered",
                device=self._devices[gpu],
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
        for gpu in targets:
            log.warning("plugin.health.xid_critical", device=self._devices[gpu], nvml_index=gpu, xid=event.xid)
            self._mark_bad(gpu, f"Xid {event.xid}", changes)

    def _probe_all(self, now: float, changes: dict[int, bool]) -> None:
        for gpu in self._state:
            try:
                self._probe(self._backend, gpu)
            except NvmlError as e:
                if self._state[gpu].healthy:
                    log.warning("plugin.health.probe_failed", device=self._devices[gpu], nvml_index=gpu, error=e.name)
                self._mark_bad(gpu, e.name, changes)
                continue
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
            log.info("plugin.health.gpu_recovered", device=self._devices[gpu], nvml_index=gpu, after=reason,
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
            ids = sorted(self._devices[g] for g, h in changes.items() if h is healthy)
            if not ids:
                continue
            try:
                self._on_change(ids, healthy)
            except Exception:
                log.exception("plugin.health.callback_failed", devices=ids, healthy=healthy)
