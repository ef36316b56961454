"""NVML replayed from a recording, and from a recorded stream of health events, on a virtual clock.

The replay answers each `NvmlBackend` call from a canonical recording dict (see
`gputopo.discovery.recording`): a value, or the recorded failure ("ERR:<name>:<message>") raised as
`NvmlError(name)`, so that discovery's NotSupported and binding-mismatch paths run exactly as they did on the
recorded machine. A field the recording lacks raises `NvmlError("NotRecorded")`; a link number it lacks raises
NVMLError_InvalidArgument, as NVML does for links a GPU does not have.

Event stream format (JSON; `load_event_stream` validates it):
    {"format": "gpuplugin.nvml-events", "version": 1, "description": "...", "end": 120.0,
     "events": [
       {"t": 1.0, "type": "xid", "gpu": 0, "xid": 79},        # nvmlEventSetWait delivers Xid 79 for NVML index 0
       {"t": 1.0, "type": "xid", "gpu": null, "xid": 48},     # ... for a device NVML could not name
       {"t": 2.0, "type": "xid", "gpu": 0, "xid": 94, "gpu_instance": 7, "compute_instance": 0},  # one MIG instance
       {"t": 1.0, "type": "fail", "gpu": 0, "error": "NVMLError_GpuIsLost"},  # every call on GPU 0 fails from t
       {"t": 30.0, "type": "restore", "gpu": 0},              # GPU 0 answers again from t
       {"t": 31.0, "type": "wait_error", "error": "NVMLError_Unknown"}]}      # one nvmlEventSetWait call fails
Times are seconds on the replay's virtual clock and must not decrease. The clock moves only inside
`XidEventSet.wait`: to the next event, or by the wait's timeout, so a health monitor driven by `clock()` sees
the stream's timing exactly, however fast or slow the test machine is. Once the clock reaches `end` (default:
the last event's time) and every event is delivered, the replay is drained: `wait_drained()` returns and the
clock stops.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from gputopo.core.errors import TopologyFormatError
from gputopo.discovery.mig_minors import format_mig_minors
from gputopo.discovery.nvml_backend import (
    ERR_INVALID_ARGUMENT,
    ERR_NOT_FOUND,
    ComputeInstanceInfo,
    ComputeInstanceProfileInfo,
    GpuInstanceInfo,
    GpuInstanceProfileInfo,
    MigDeviceInfo,
    NvmlError,
    XidEvent,
    XidEventSet,
)

EVENTS_FORMAT = "gpuplugin.nvml-events"
EVENTS_VERSION = 1
ERR_PREFIX = "ERR:"
ERR_NOT_RECORDED = "NotRecorded"
_DRAINED_POLL_S = 0.02  # real seconds a drained replay blocks per wait, so stopping a monitor stays quick


class EventStreamError(TopologyFormatError):
    """An event stream file is malformed; the message names the field."""


class StreamEvent(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    t: float = Field(ge=0)
    type: Literal["xid", "fail", "restore", "wait_error"]
    gpu: int | None = Field(default=None, ge=0)
    xid: int | None = Field(default=None, ge=0)
    gpu_instance: int | None = Field(default=None, ge=0, lt=2**32)  # absent: GPU-wide (NVML's 0xFFFFFFFF)
    compute_instance: int | None = Field(default=None, ge=0, lt=2**32)
    error: str | None = None

    @model_validator(mode="after")
    def _fields_for_type(self) -> StreamEvent:
        need = {"xid": ("xid",), "fail": ("gpu", "error"), "restore": ("gpu",), "wait_error": ("error",)}[self.type]
        missing = [k for k in need if getattr(self, k) is None]
        if missing:
            raise ValueError(f"a {self.type!r} event needs {', '.join(missing)}")
        return self


class EventStream(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    format: Literal["gpuplugin.nvml-events"]
    version: int
    description: str = ""
    end: float | None = Field(default=None, ge=0)
    events: list[StreamEvent]

    @model_validator(mode="after")
    def _ordered(self) -> EventStream:
        if self.version > EVENTS_VERSION:
            raise ValueError(f"event stream version {self.version} is newer than this build reads ({EVENTS_VERSION})")
        for k in range(1, len(self.events)):
            if self.events[k].t < self.events[k - 1].t:
                raise ValueError(f"events[{k}] at t={self.events[k].t} comes before the event preceding it")
        return self

    @property
    def end_time(self) -> float:
        last = self.events[-1].t if self.events else 0.0
        return max(self.end if self.end is not None else last, last)


def load_event_stream(data: Any) -> EventStream:
    """Validate a parsed event stream JSON. Raises EventStreamError naming the offending field."""
    try:
        return EventStream.model_validate(data)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(x) for x in first["loc"]) or "(top level)"
        raise EventStreamError(f"event stream: {where}: {first['msg']} ({e.error_count()} problem(s))") from None


def parse_err(value: str) -> tuple[str, str]:
    """ "ERR:<name>:<message>" -> (name, message)."""
    _, _, rest = value.partition(ERR_PREFIX)
    name, _, message = rest.partition(":")
    return name or "NVMLError_Unknown", message


def is_err(value: Any) -> bool:
    return isinstance(value, str) and value.startswith(ERR_PREFIX)


class ReplayNvmlBackend:
    """An NvmlBackend answering from a canonical recording dict; optionally replays an event stream for health."""

    def __init__(self, recording: Mapping[str, Any], events: EventStream | None = None) -> None:
        self._load(recording)
        self._initialized = False
        self._events = list(events.events) if events else []
        self._end = events.end_time if events else 0.0
        self._next = 0
        self._now = 0.0
        self._failed: dict[int, str] = {}
        self._cond = threading.Condition()
        self._drained = threading.Event()

    def _load(self, recording: Mapping[str, Any]) -> None:
        self._rec = recording
        self._gpus: list[Mapping[str, Any]] = list(recording.get("gpus") or [])
        self._links: list[dict[int, Mapping[str, Any]]] = [
            {int(e["link"]): e for e in (g.get("nvlinks") or [])} for g in self._gpus
        ]
        self._pairs: Mapping[str, Mapping[str, Any]] = recording.get("pairs") or {}

    def replace(self, recording: Mapping[str, Any]) -> None:
        """Answer from `recording` from now on, as the driver answers after a change on the node (a MIG
        re-partition: instances created or destroyed). Calls already answered keep their answers; a discovery pass
        that straddles the swap sees both, as one straddling a real re-partition does."""
        with self._cond:
            self._load(recording)

    # --- the virtual clock and the stream -----------------------------------------------------------------------

    def clock(self) -> float:
        """Virtual seconds since the stream began (pass as a health monitor's clock)."""
        with self._cond:
            return self._now

    def wait_drained(self, timeout: float) -> bool:
        """Real-time wait until every event was delivered and the clock reached the stream's end."""
        return self._drained.wait(timeout)

    def _apply(self, ev: StreamEvent) -> None:
        if ev.type == "fail" and ev.gpu is not None and ev.error is not None:
            self._failed[ev.gpu] = ev.error
        elif ev.type == "restore" and ev.gpu is not None:
            self._failed.pop(ev.gpu, None)

    def _wait(self, registered: frozenset[int], timeout_ms: int) -> XidEvent | None:
        with self._cond:
            deadline = self._now + max(0, timeout_ms) / 1000.0
            while self._next < len(self._events) and self._events[self._next].t <= deadline:
                ev = self._events[self._next]
                self._next += 1
                self._now = max(self._now, ev.t)
                if ev.type == "wait_error":
                    raise NvmlError(ev.error or "NVMLError_Unknown", "replayed", call="nvmlEventSetWait")
                if ev.type == "xid" and (ev.gpu is None or ev.gpu in registered):
                    return XidEvent(
                        gpu=ev.gpu,
                        xid=int(ev.xid or 0),
                        gpu_instance=ev.gpu_instance,
                        compute_instance=ev.compute_instance,
                    )
                self._apply(ev)
            if self._next < len(self._events):  # the next event lies beyond this wait
                self._now = deadline
                return None
            if self._now < self._end:
                self._now = min(deadline, self._end)
                return None
            self._drained.set()
            self._cond.wait(min(timeout_ms / 1000.0, _DRAINED_POLL_S))
            return None

    # --- answers from the recording -----------------------------------------------------------------------------

    def _answer(self, value: Any, call: str, gpu: int | None) -> Any:
        if value is None:
            raise NvmlError(ERR_NOT_RECORDED, "absent from the recording", call=call, gpu=gpu)
        if is_err(value):
            name, message = parse_err(value)
            raise NvmlError(name, message, call=call, gpu=gpu)
        return value

    def _check(self, call: str, gpu: int) -> Mapping[str, Any]:
        if not self._initialized:
            raise NvmlError("NVMLError_Uninitialized", "init() was not called", call=call, gpu=gpu)
        if not 0 <= gpu < len(self._gpus):
            raise NvmlError(ERR_INVALID_ARGUMENT, f"no GPU {gpu}", call=call, gpu=gpu)
        with self._cond:
            failed = self._failed.get(gpu)
        if failed is not None:
            raise NvmlError(failed, "replayed failure", call=call, gpu=gpu)
        return self._gpus[gpu]

    def _field(self, gpu: int, key: str, call: str) -> Any:
        return self._answer(self._check(call, gpu).get(key), call, gpu)

    def _link(self, gpu: int, link: int, key: str, call: str) -> Any:
        self._check(call, gpu)
        entry = self._links[gpu].get(link)
        if entry is None:
            raise NvmlError(ERR_INVALID_ARGUMENT, f"link {link} not recorded", call=call, gpu=gpu)
        return self._answer(entry.get(key), call, gpu)

    def _pair(self, a: int, b: int, key: str, call: str) -> Any:
        self._check(call, a)
        self._check(call, b)
        return self._answer((self._pairs.get(f"{a}-{b}") or {}).get(key), call, a)

    def init(self) -> None:
        self._initialized = True

    def shutdown(self) -> None:
        self._initialized = False

    def driver_version(self) -> str:
        return str(self._answer(self._rec.get("driver"), "nvmlSystemGetDriverVersion", None))

    def nvml_version(self) -> str:
        return str(self._answer(self._rec.get("nvml"), "nvmlSystemGetNVMLVersion", None))

    def device_count(self) -> int:
        if not self._initialized:
            raise NvmlError("NVMLError_Uninitialized", "init() was not called", call="nvmlDeviceGetCount")
        return len(self._gpus)

    def uuid(self, gpu: int) -> str:
        return str(self._field(gpu, "uuid", "nvmlDeviceGetUUID"))

    def name(self, gpu: int) -> str:
        return str(self._field(gpu, "name", "nvmlDeviceGetName"))

    def pci_bus_id(self, gpu: int) -> str:
        return str(self._field(gpu, "pci_bus_id", "nvmlDeviceGetPciInfo"))

    def minor_number(self, gpu: int) -> int:
        return int(self._field(gpu, "minor", "nvmlDeviceGetMinorNumber"))

    def memory_total(self, gpu: int) -> int:
        return int(self._field(gpu, "memory_total", "nvmlDeviceGetMemoryInfo"))

    def cuda_compute_capability(self, gpu: int) -> tuple[int, int]:
        major, minor = self._field(gpu, "compute_capability", "nvmlDeviceGetCudaComputeCapability")
        return int(major), int(minor)

    def mig_mode(self, gpu: int) -> tuple[int, int]:
        current, pending = self._field(gpu, "mig_mode", "nvmlDeviceGetMigMode")
        return int(current), int(pending)

    def numa_node_id(self, gpu: int) -> int:
        return int(self._field(gpu, "numa_node", "nvmlDeviceGetNumaNodeId"))

    def sysfs_numa_node(self, gpu: int) -> int:
        return int(self._field(gpu, "sysfs_numa_node", "sysfs numa_node"))

    def cpu_affinity(self, gpu: int) -> tuple[int, ...]:
        return tuple(int(w) for w in self._field(gpu, "cpu_affinity", "nvmlDeviceGetCpuAffinity"))

    def max_pcie_link_generation(self, gpu: int) -> int:
        return int(self._field(gpu, "pcie_max_gen", "nvmlDeviceGetMaxPcieLinkGeneration"))

    def curr_pcie_link_generation(self, gpu: int) -> int:
        return int(self._field(gpu, "pcie_cur_gen", "nvmlDeviceGetCurrPcieLinkGeneration"))

    def max_pcie_link_width(self, gpu: int) -> int:
        return int(self._field(gpu, "pcie_max_width", "nvmlDeviceGetMaxPcieLinkWidth"))

    def curr_pcie_link_width(self, gpu: int) -> int:
        return int(self._field(gpu, "pcie_cur_width", "nvmlDeviceGetCurrPcieLinkWidth"))

    def nvlink_state(self, gpu: int, link: int) -> int:
        return int(self._link(gpu, link, "state", "nvmlDeviceGetNvLinkState"))

    def nvlink_version(self, gpu: int, link: int) -> int:
        return int(self._link(gpu, link, "version", "nvmlDeviceGetNvLinkVersion"))

    def nvlink_remote_pci_bus_id(self, gpu: int, link: int) -> str:
        return str(self._link(gpu, link, "remote_bus_id", "nvmlDeviceGetNvLinkRemotePciInfo"))

    def nvlink_remote_device_type(self, gpu: int, link: int) -> int:
        return int(self._link(gpu, link, "remote_type", "nvmlDeviceGetNvLinkRemoteDeviceType"))

    def topology_common_ancestor(self, gpu1: int, gpu2: int) -> int:
        return int(self._pair(gpu1, gpu2, "common_ancestor", "nvmlDeviceGetTopologyCommonAncestor"))

    def p2p_status(self, gpu1: int, gpu2: int, caps_index: int) -> int:
        if caps_index != 2:  # NVML_P2P_CAPS_INDEX_NVLINK: the only index recordings keep
            raise NvmlError(ERR_NOT_RECORDED, f"P2P index {caps_index}", call="nvmlDeviceGetP2PStatus", gpu=gpu1)
        return int(self._pair(gpu1, gpu2, "p2p_nvlink", "nvmlDeviceGetP2PStatus"))

    # --- MIG ----------------------------------------------------------------------------------------------------

    def _mig(self, gpu: int, call: str) -> Mapping[str, Any]:
        mig = self._check(call, gpu).get("mig")
        if mig is None:
            raise NvmlError(ERR_NOT_RECORDED, "no MIG answers in the recording", call=call, gpu=gpu)
        return mig

    def _mig_entry(self, gpu: int, section: str, key: str, call: str, missing: str = ERR_NOT_RECORDED) -> Any:
        value = (self._mig(gpu, call).get(section) or {}).get(key)
        if value is None:
            raise NvmlError(missing, f"{section}[{key}] not in the recording", call=call, gpu=gpu)
        return self._answer(value, call, gpu)

    def max_mig_device_count(self, gpu: int) -> int:
        call = "nvmlDeviceGetMaxMigDeviceCount"
        return int(self._answer(self._mig(gpu, call).get("max_devices"), call, gpu))

    def mig_device(self, gpu: int, index: int) -> MigDeviceInfo:
        call = "nvmlDeviceGetMigDeviceHandleByIndex"
        devices = self._mig(gpu, call).get("devices") or []
        if not 0 <= index < len(devices):
            raise NvmlError(ERR_NOT_FOUND, f"no MIG device slot {index}", call=call, gpu=gpu)
        d = self._answer(devices[index], call, gpu)
        return MigDeviceInfo(
            int(d["index"]), str(d["uuid"]), int(d["gpu_instance_id"]), int(d["compute_instance_id"]),
            int(d["memory_total"]),
        )

    def gpu_instance_profile(self, gpu: int, profile_index: int) -> GpuInstanceProfileInfo:
        call = "nvmlDeviceGetGpuInstanceProfileInfoV"
        d = self._mig_entry(gpu, "gi_profiles", str(profile_index), call)
        return GpuInstanceProfileInfo(**d)

    def gpu_instance_possible_placements(self, gpu: int, profile_id: int) -> tuple[tuple[int, int], ...]:
        call = "nvmlDeviceGetGpuInstancePossiblePlacements"
        d = self._mig_entry(gpu, "placements", str(profile_id), call)
        return tuple((int(a), int(b)) for a, b in d)

    def gpu_instance_remaining_capacity(self, gpu: int, profile_id: int) -> int:
        call = "nvmlDeviceGetGpuInstanceRemainingCapacity"
        return int(self._mig_entry(gpu, "remaining", str(profile_id), call))

    def gpu_instance(self, gpu: int, gpu_instance_id: int) -> GpuInstanceInfo:
        call = "nvmlDeviceGetGpuInstanceById"
        return GpuInstanceInfo(**self._mig_entry(gpu, "gpu_instances", str(gpu_instance_id), call, ERR_NOT_FOUND))

    def compute_instance(self, gpu: int, gpu_instance_id: int, compute_instance_id: int) -> ComputeInstanceInfo:
        call = "nvmlGpuInstanceGetComputeInstanceById"
        key = f"{gpu_instance_id}/{compute_instance_id}"
        return ComputeInstanceInfo(**self._mig_entry(gpu, "compute_instances", key, call, ERR_NOT_FOUND))

    def compute_instance_profile(
        self, gpu: int, gpu_instance_id: int, profile_index: int
    ) -> ComputeInstanceProfileInfo:
        call = "nvmlGpuInstanceGetComputeInstanceProfileInfoV"
        per_gi = (self._mig(gpu, call).get("ci_profiles") or {}).get(str(gpu_instance_id))
        if per_gi is None:
            raise NvmlError(ERR_NOT_FOUND, f"no GPU instance {gpu_instance_id}", call=call, gpu=gpu)
        value = per_gi.get(str(profile_index))
        if value is None:
            raise NvmlError(ERR_NOT_RECORDED, f"CI profile {profile_index} not recorded", call=call, gpu=gpu)
        return ComputeInstanceProfileInfo(**self._answer(value, call, gpu))

    def mig_minors(self) -> str:
        value = self._answer(self._rec.get("mig_minors"), "read mig-minors", None)
        return format_mig_minors(dict(value))

    def xid_event_set(self, gpus: Iterable[int]) -> XidEventSet:
        if not self._initialized:
            raise NvmlError("NVMLError_Uninitialized", "init() was not called", call="nvmlEventSetCreate")
        registered: set[int] = set()
        failed: dict[int, NvmlError] = {}
        for gpu in gpus:
            try:
                self._check("nvmlDeviceRegisterEvents", gpu)
            except NvmlError as e:
                failed[gpu] = e
                continue
            registered.add(gpu)
        frozen = frozenset(registered)

        def close() -> None:
            with self._cond:
                self._cond.notify_all()

        return XidEventSet(frozen, failed, lambda timeout_ms: self._wait(frozen, timeout_ms), close)
