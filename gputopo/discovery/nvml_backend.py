"""The NVML calls that discovery and health make, behind one protocol, and the live implementation over
pynvml.

Why a protocol: the same discovery and health code must run on a real node (pynvml, `LiveNvmlBackend`) and on
a recording taken elsewhere (`gputopo.discovery.nvml_replay.ReplayNvmlBackend`), so that replaying a
recording gives exactly the topology live NVML gave on that machine. Each method is one NVML call (named in
its docstring) addressed by NVML device index; handles stay inside the backend.

Every failure of a call is raised as `NvmlError` carrying the error's name: pynvml's class name
(`NVMLError_NotSupported`, `NVMLError_GpuIsLost`, ...) or, for binding mismatches between nvidia-ml-py
releases, the Python exception's name (`TypeError`, `ArgumentError`). Callers treat any single failure as
"unknown" and carry on.
"""

from __future__ import annotations

import ctypes
import os
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, TypeVar

# Values of NVML's enums that discovery interprets (equal to pynvml's; a test proves it), kept here so that replay
# and discovery work without loading pynvml.
NVML_NVLINK_MAX_LINKS = 36
NVML_FEATURE_ENABLED = 1
NVML_NVLINK_DEVICE_TYPE_GPU = 0
NVML_NVLINK_DEVICE_TYPE_IBMNPU = 1
NVML_NVLINK_DEVICE_TYPE_SWITCH = 2
NVML_NVLINK_DEVICE_TYPE_UNKNOWN = 0xFF
NVML_TOPOLOGY_INTERNAL = 0
NVML_TOPOLOGY_SINGLE = 10
NVML_TOPOLOGY_MULTIPLE = 20
NVML_TOPOLOGY_HOSTBRIDGE = 30
NVML_TOPOLOGY_NODE = 40
NVML_TOPOLOGY_SYSTEM = 50
NVML_P2P_CAPS_INDEX_NVLINK = 2
NVML_P2P_STATUS_OK = 0
NVML_DEVICE_MIG_DISABLE = 0
NVML_DEVICE_MIG_ENABLE = 1
NVML_GPU_INSTANCE_PROFILE_COUNT = 0x12  # GI profile indices 0..17 (1_SLICE .. 3_SLICE_GFX) in nvidia-ml-py 13.x
NVML_COMPUTE_INSTANCE_PROFILE_COUNT = 0x9
NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED = 0
# What nvmlEventData_t carries in gpuInstanceId / computeInstanceId when the event belongs to no one instance.
NVML_INSTANCE_ID_ANY = 0xFFFFFFFF
nvmlEventTypeXidCriticalError = 0x0000000000000008

# The bus id NVML reports for the far end of a link that ends in an NVSwitch (see fixtures/recordings/).
NVSWITCH_REMOTE_BUS_ID = "FFFFFFFF:FF:FF.0"

# Error names callers branch on.
ERR_NOT_SUPPORTED = "NVMLError_NotSupported"
ERR_INVALID_ARGUMENT = "NVMLError_InvalidArgument"
ERR_GPU_IS_LOST = "NVMLError_GpuIsLost"
ERR_TIMEOUT = "NVMLError_Timeout"
ERR_NOT_FOUND = "NVMLError_NotFound"
ERR_NO_PERMISSION = "NVMLError_NoPermission"

# Where the driver lists the capability device minors of every possible MIG GPU/compute instance.
MIG_MINORS_PATH = "/proc/driver/nvidia-caps/mig-minors"


class NvmlError(Exception):
    """One NVML call failed. `name` is the error class name (stable across drivers), `call` the NVML function."""

    def __init__(self, name: str, message: str = "", *, call: str = "", gpu: int | None = None) -> None:
        self.name = name
        self.message = message
        self.call = call
        self.gpu = gpu
        where = f"{call}" + (f"(gpu {gpu})" if gpu is not None else "")
        super().__init__(f"{where + ': ' if where else ''}{name}{': ' + message if message else ''}")


class NvmlUnavailableError(NvmlError):
    """NVML cannot be used at all on this machine (no driver, no library, no permission)."""


@dataclass(frozen=True, slots=True)
class XidEvent:
    """An Xid critical error event. `gpu` is the NVML index, None when NVML named a device we cannot map.

    `gpu_instance` / `compute_instance`: the MIG instance the Xid belongs to (nvmlEventData_t gpuInstanceId,
    computeInstanceId), None when NVML gave 0xFFFFFFFF, i.e. the Xid is GPU-wide (always so without MIG)."""

    gpu: int | None
    xid: int
    gpu_instance: int | None = None
    compute_instance: int | None = None


def instance_id(raw: int | None) -> int | None:
    """nvmlEventData_t's instance id as XidEvent keeps it: None for 'no one instance' (0xFFFFFFFF)."""
    if raw is None or int(raw) == NVML_INSTANCE_ID_ANY:
        return None
    return int(raw)


# --- MIG answers (plain values, so replay and discovery need no pynvml) -------------------------------------------


@dataclass(frozen=True, slots=True)
class GpuInstanceProfileInfo:
    """nvmlDeviceGetGpuInstanceProfileInfoV (nvmlGpuInstanceProfileInfo_v2_t): one GI profile of a GPU. `id` is the
    profile id nvidia-smi prints (19 for 1g on A100/H100), not the profile index the call was asked with."""

    id: int
    slice_count: int
    instance_count: int
    multiprocessor_count: int
    copy_engine_count: int
    decoder_count: int
    encoder_count: int
    jpeg_count: int
    ofa_count: int
    memory_size_mb: int
    name: str = ""  # "MIG 1g.18gb" in v2; empty from the v1 call
    is_p2p_supported: int = 0


@dataclass(frozen=True, slots=True)
class ComputeInstanceProfileInfo:
    """nvmlGpuInstanceGetComputeInstanceProfileInfoV: one CI profile inside a GPU instance."""

    id: int
    slice_count: int
    instance_count: int
    multiprocessor_count: int
    name: str = ""


@dataclass(frozen=True, slots=True)
class GpuInstanceInfo:
    """nvmlGpuInstanceGetInfo: id, GI profile id and placement (memory slices [start, start + size))."""

    id: int
    profile_id: int
    start: int
    size: int


@dataclass(frozen=True, slots=True)
class ComputeInstanceInfo:
    """nvmlComputeInstanceGetInfo: id, CI profile id and placement (compute slices inside its GI)."""

    id: int
    profile_id: int
    start: int
    size: int


@dataclass(frozen=True, slots=True)
class MigDeviceInfo:
    """The MIG device in slot `index` of a GPU (nvmlDeviceGetMigDeviceHandleByIndex, then on that handle
    nvmlDeviceGetUUID, nvmlDeviceGetGpuInstanceId, nvmlDeviceGetComputeInstanceId, nvmlDeviceGetMemoryInfo)."""

    index: int
    uuid: str
    gpu_instance_id: int
    compute_instance_id: int
    memory_total: int


@dataclass
class XidEventSet:
    """Xid events registered for some GPUs. `failed` holds the GPUs whose registration failed and why; those GPUs
    are watched by the health probe alone."""

    registered: frozenset[int]
    failed: dict[int, NvmlError] = field(default_factory=dict)
    _wait: Callable[[int], XidEvent | None] | None = None
    _close: Callable[[], None] | None = None

    def wait(self, timeout_ms: int) -> XidEvent | None:
        """nvmlEventSetWait: the next event, or None when `timeout_ms` passed without one. Raises NvmlError."""
        if self._wait is None:
            raise NvmlError("NVMLError_Uninitialized", "event set is closed", call="nvmlEventSetWait")
        return self._wait(timeout_ms)

    def close(self) -> None:
        """nvmlEventSetFree; idempotent."""
        close, self._close, self._wait = self._close, None, None
        if close is not None:
            close()


class NvmlBackend(Protocol):
    """The NVML surface of discovery and health. Every call raises NvmlError on failure."""

    def init(self) -> None: ...
    def shutdown(self) -> None: ...
    def driver_version(self) -> str: ...
    def nvml_version(self) -> str: ...
    def device_count(self) -> int: ...
    def uuid(self, gpu: int) -> str: ...
    def name(self, gpu: int) -> str: ...
    def pci_bus_id(self, gpu: int) -> str: ...
    def minor_number(self, gpu: int) -> int: ...
    def memory_total(self, gpu: int) -> int: ...
    def cuda_compute_capability(self, gpu: int) -> tuple[int, int]: ...
    def mig_mode(self, gpu: int) -> tuple[int, int]: ...
    def numa_node_id(self, gpu: int) -> int: ...
    def sysfs_numa_node(self, gpu: int) -> int: ...
    def cpu_affinity(self, gpu: int) -> tuple[int, ...]: ...
    def max_pcie_link_generation(self, gpu: int) -> int: ...
    def curr_pcie_link_generation(self, gpu: int) -> int: ...
    def max_pcie_link_width(self, gpu: int) -> int: ...
    def curr_pcie_link_width(self, gpu: int) -> int: ...
    def nvlink_state(self, gpu: int, link: int) -> int: ...
    def nvlink_version(self, gpu: int, link: int) -> int: ...
    def nvlink_remote_pci_bus_id(self, gpu: int, link: int) -> str: ...
    def nvlink_remote_device_type(self, gpu: int, link: int) -> int: ...
    def topology_common_ancestor(self, gpu1: int, gpu2: int) -> int: ...
    def p2p_status(self, gpu1: int, gpu2: int, caps_index: int) -> int: ...
    def xid_event_set(self, gpus: Iterable[int]) -> XidEventSet: ...
    # MIG (read only: nothing here creates, destroys or switches anything)
    def max_mig_device_count(self, gpu: int) -> int: ...
    def mig_device(self, gpu: int, index: int) -> MigDeviceInfo: ...
    def gpu_instance_profile(self, gpu: int, profile_index: int) -> GpuInstanceProfileInfo: ...
    def gpu_instance_possible_placements(self, gpu: int, profile_id: int) -> tuple[tuple[int, int], ...]: ...
    def gpu_instance_remaining_capacity(self, gpu: int, profile_id: int) -> int: ...
    def gpu_instance(self, gpu: int, gpu_instance_id: int) -> GpuInstanceInfo: ...
    def compute_instance(self, gpu: int, gpu_instance_id: int, compute_instance_id: int) -> ComputeInstanceInfo: ...
    def compute_instance_profile(
        self, gpu: int, gpu_instance_id: int, profile_index: int
    ) -> ComputeInstanceProfileInfo: ...
    def mig_minors(self) -> str: ...


def normalize_bus_id(bus_id: str) -> str:
    """NVML's canonical form, 8-digit domain and upper case ("00000000:3B:00.0"), whatever form came in."""
    text = bus_id.strip().upper()
    parts = text.split(":")
    if len(parts) == 3:
        try:
            return f"{int(parts[0], 16):08X}:{parts[1]}:{parts[2]}"
        except ValueError:
            return text
    if len(parts) == 2:  # bus:device.function without a domain
        return f"00000000:{text}"
    return text


def sysfs_pci_name(bus_id: str) -> str:
    """The kernel's name for a PCI function ("0000:3b:00.0") from NVML's bus id."""
    domain, rest = normalize_bus_id(bus_id).split(":", 1)
    return f"{int(domain, 16) & 0xFFFF:04x}:{rest.lower()}"


def _text(value: Any) -> str:
    """Older nvidia-ml-py returns bytes where newer returns str."""
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


T = TypeVar("T")


class LiveNvmlBackend:
    """NVML through nvidia-ml-py (module pynvml). Construct, then `init()`; `shutdown()` when done."""

    def __init__(
        self,
        *,
        sysfs_root: str | Path = "/sys",
        cpu_words: int | None = None,
        mig_minors_path: str | Path = MIG_MINORS_PATH,
    ) -> None:
        self._sysfs_root = Path(sysfs_root)
        self._mig_minors_path = Path(mig_minors_path)
        # nvmlDeviceGetCpuAffinity fills one 64-bit word per 64 CPUs; ask for enough for every CPU of the host.
        self._cpu_words = cpu_words or max(1, -(-(os.cpu_count() or 1) // 64))
        self._pynvml: Any = None
        self._handles: dict[int, Any] = {}
        self._lock = threading.Lock()

    # --- plumbing -----------------------------------------------------------------------------------------------

    def _call(self, call: str, fn: Callable[..., T], *args: Any, gpu: int | None = None) -> T:
        try:
            return fn(*args)
        except NvmlError:
            raise
        except Exception as e:  # pynvml.NVMLError_*, or TypeError/ArgumentError from a binding mismatch
            raise NvmlError(type(e).__name__, str(e), call=call, gpu=gpu) from e

    def _nvml(self, call: str, *args: Any, gpu: int | None = None) -> Any:
        if self._pynvml is None:
            raise NvmlError("NVMLError_Uninitialized", "init() was not called", call=call, gpu=gpu)
        fn = getattr(self._pynvml, call, None)
        if fn is None:
            raise NvmlError("NVMLError_FunctionNotFound", "not in this nvidia-ml-py", call=call, gpu=gpu)
        return self._call(call, fn, *args, gpu=gpu)

    def _handle(self, gpu: int) -> Any:
        with self._lock:
            handle = self._handles.get(gpu)
        if handle is None:
            handle = self._nvml("nvmlDeviceGetHandleByIndex", gpu, gpu=gpu)
            with self._lock:
                self._handles[gpu] = handle
        return handle

    def _dev(self, call: str, gpu: int, *args: Any) -> Any:
        return self._nvml(call, self._handle(gpu), *args, gpu=gpu)

    # --- lifecycle ----------------------------------------------------------------------------------------------

    def init(self) -> None:
        """nvmlInit. Raises NvmlUnavailableError when there is no usable NVML (no driver, not a GPU node)."""
        try:
            import pynvml
        except ImportError as e:  # pragma: no cover - a declared dependency
            raise NvmlUnavailableError("ImportError", f"nvidia-ml-py is not installed: {e}", call="import") from e
        try:
            pynvml.nvmlInit()
        except Exception as e:
            raise NvmlUnavailableError(type(e).__name__, str(e), call="nvmlInit") from e
        self._pynvml = pynvml

    def shutdown(self) -> None:
        """nvmlShutdown; idempotent."""
        nvml, self._pynvml = self._pynvml, None
        self._handles.clear()
        if nvml is not None:
            self._call("nvmlShutdown", nvml.nvmlShutdown)

    # --- system -------------------------------------------------------------------------------------------------

    def driver_version(self) -> str:
        return _text(self._nvml("nvmlSystemGetDriverVersion"))

    def nvml_version(self) -> str:
        return _text(self._nvml("nvmlSystemGetNVMLVersion"))

    def device_count(self) -> int:
        return int(self._nvml("nvmlDeviceGetCount"))

    # --- per device ---------------------------------------------------------------------------------------------

    def uuid(self, gpu: int) -> str:
        return _text(self._dev("nvmlDeviceGetUUID", gpu))

    def name(self, gpu: int) -> str:
        return _text(self._dev("nvmlDeviceGetName", gpu))

    def pci_bus_id(self, gpu: int) -> str:
        """nvmlDeviceGetPciInfo(...).busId."""
        return normalize_bus_id(_text(self._dev("nvmlDeviceGetPciInfo", gpu).busId))

    def minor_number(self, gpu: int) -> int:
        return int(self._dev("nvmlDeviceGetMinorNumber", gpu))

    def memory_total(self, gpu: int) -> int:
        """nvmlDeviceGetMemoryInfo(...).total in bytes. Answered by the driver each time (not cached), which makes
        it the default health probe too."""
        return int(self._dev("nvmlDeviceGetMemoryInfo", gpu).total)

    def cuda_compute_capability(self, gpu: int) -> tuple[int, int]:
        major, minor = self._dev("nvmlDeviceGetCudaComputeCapability", gpu)
        return int(major), int(minor)

    def mig_mode(self, gpu: int) -> tuple[int, int]:
        """nvmlDeviceGetMigMode: (current, pending)."""
        current, pending = self._dev("nvmlDeviceGetMigMode", gpu)
        return int(current), int(pending)

    def numa_node_id(self, gpu: int) -> int:
        return int(self._dev("nvmlDeviceGetNumaNodeId", gpu))

    def sysfs_numa_node(self, gpu: int) -> int:
        """/sys/bus/pci/devices/<bus>/numa_node: where the kernel says the GPU hangs when NVML does not (-1: none)."""
        path = self._sysfs_root / "bus" / "pci" / "devices" / sysfs_pci_name(self.pci_bus_id(gpu)) / "numa_node"
        try:
            return int(path.read_text().strip())
        except (OSError, ValueError) as e:
            raise NvmlError(type(e).__name__, f"{path}: {e}", call="sysfs numa_node", gpu=gpu) from e

    def cpu_affinity(self, gpu: int) -> tuple[int, ...]:
        """nvmlDeviceGetCpuAffinity: the ideal CPU set as 64-bit words, CPU 0 in bit 0 of word 0."""
        words = self._dev("nvmlDeviceGetCpuAffinity", gpu, self._cpu_words)
        return tuple(int(w) & 0xFFFFFFFFFFFFFFFF for w in words)

    def max_pcie_link_generation(self, gpu: int) -> int:
        return int(self._dev("nvmlDeviceGetMaxPcieLinkGeneration", gpu))

    def curr_pcie_link_generation(self, gpu: int) -> int:
        return int(self._dev("nvmlDeviceGetCurrPcieLinkGeneration", gpu))

    def max_pcie_link_width(self, gpu: int) -> int:
        return int(self._dev("nvmlDeviceGetMaxPcieLinkWidth", gpu))

    def curr_pcie_link_width(self, gpu: int) -> int:
        return int(self._dev("nvmlDeviceGetCurrPcieLinkWidth", gpu))

    # --- NVLink -------------------------------------------------------------------------------------------------

    def nvlink_state(self, gpu: int, link: int) -> int:
        return int(self._dev("nvmlDeviceGetNvLinkState", gpu, link))

    def nvlink_version(self, gpu: int, link: int) -> int:
        return int(self._dev("nvmlDeviceGetNvLinkVersion", gpu, link))

    def nvlink_remote_pci_bus_id(self, gpu: int, link: int) -> str:
        """nvmlDeviceGetNvLinkRemotePciInfo(...).busId."""
        return normalize_bus_id(_text(self._dev("nvmlDeviceGetNvLinkRemotePciInfo", gpu, link).busId))

    def nvlink_remote_device_type(self, gpu: int, link: int) -> int:
        return int(self._dev("nvmlDeviceGetNvLinkRemoteDeviceType", gpu, link))

    # --- pairs --------------------------------------------------------------------------------------------------

    def topology_common_ancestor(self, gpu1: int, gpu2: int) -> int:
        call = "nvmlDeviceGetTopologyCommonAncestor"
        return int(self._nvml(call, self._handle(gpu1), self._handle(gpu2), gpu=gpu1))

    def p2p_status(self, gpu1: int, gpu2: int, caps_index: int) -> int:
        call = "nvmlDeviceGetP2PStatus"
        return int(self._nvml(call, self._handle(gpu1), self._handle(gpu2), caps_index, gpu=gpu1))

    # --- events -------------------------------------------------------------------------------------------------

    def xid_event_set(self, gpus: Iterable[int]) -> XidEventSet:
        """nvmlEventSetCreate, then nvmlDeviceRegisterEvents(Xid critical errors) per GPU that supports them."""
        event_set = self._nvml("nvmlEventSetCreate")
        registered: set[int] = set()
        failed: dict[int, NvmlError] = {}
        by_address: dict[int | None, int] = {}
        for gpu in gpus:
            try:
                handle = self._handle(gpu)
                supported = int(self._nvml("nvmlDeviceGetSupportedEventTypes", handle, gpu=gpu))
                if not supported & nvmlEventTypeXidCriticalError:
                    raise NvmlError(
                        ERR_NOT_SUPPORTED,
                        "no Xid events on this GPU",
                        call="nvmlDeviceRegisterEvents",
                        gpu=gpu,
                    )
                self._nvml("nvmlDeviceRegisterEvents", handle, nvmlEventTypeXidCriticalError, event_set, gpu=gpu)
            except NvmlError as e:
                failed[gpu] = e
                continue
            registered.add(gpu)
            by_address[ctypes.cast(handle, ctypes.c_void_p).value] = gpu

        def wait(timeout_ms: int) -> XidEvent | None:
            try:
                data = self._nvml("nvmlEventSetWait", event_set, int(timeout_ms))
            except NvmlError as e:
                if e.name == ERR_TIMEOUT:
                    return None
                raise
            if not int(data.eventType) & nvmlEventTypeXidCriticalError:
                return None
            gpu = by_address.get(ctypes.cast(data.device, ctypes.c_void_p).value)
            return XidEvent(
                gpu=gpu,
                xid=int(data.eventData),
                gpu_instance=instance_id(getattr(data, "gpuInstanceId", None)),
                compute_instance=instance_id(getattr(data, "computeInstanceId", None)),
            )

        def close() -> None:
            self._nvml("nvmlEventSetFree", event_set)

        return XidEventSet(frozenset(registered), failed, wait, close)

    # --- MIG ----------------------------------------------------------------------------------------------------

    def max_mig_device_count(self, gpu: int) -> int:
        return int(self._dev("nvmlDeviceGetMaxMigDeviceCount", gpu))

    def mig_device(self, gpu: int, index: int) -> MigDeviceInfo:
        """Slot `index` of the GPU's MIG devices; NVMLError_NotFound (or InvalidArgument) for an empty slot."""
        handle = self._dev("nvmlDeviceGetMigDeviceHandleByIndex", gpu, index)
        return MigDeviceInfo(
            index=index,
            uuid=_text(self._nvml("nvmlDeviceGetUUID", handle, gpu=gpu)),
            gpu_instance_id=int(self._nvml("nvmlDeviceGetGpuInstanceId", handle, gpu=gpu)),
            compute_instance_id=int(self._nvml("nvmlDeviceGetComputeInstanceId", handle, gpu=gpu)),
            memory_total=int(self._nvml("nvmlDeviceGetMemoryInfo", handle, gpu=gpu).total),
        )

    def gpu_instance_profile(self, gpu: int, profile_index: int) -> GpuInstanceProfileInfo:
        """nvmlDeviceGetGpuInstanceProfileInfoV (the v2 struct, with the name); the v1 call where V is missing."""
        try:
            info = self._dev("nvmlDeviceGetGpuInstanceProfileInfo", gpu, profile_index, 2)
        except NvmlError as e:
            if e.name not in ("NVMLError_FunctionNotFound", "TypeError"):
                raise
            info = self._dev("nvmlDeviceGetGpuInstanceProfileInfo", gpu, profile_index, 1)
        return GpuInstanceProfileInfo(
            id=int(info.id),
            slice_count=int(info.sliceCount),
            instance_count=int(info.instanceCount),
            multiprocessor_count=int(info.multiprocessorCount),
            copy_engine_count=int(info.copyEngineCount),
            decoder_count=int(info.decoderCount),
            encoder_count=int(info.encoderCount),
            jpeg_count=int(info.jpegCount),
            ofa_count=int(info.ofaCount),
            memory_size_mb=int(info.memorySizeMB),
            name=_text(getattr(info, "name", b"")),
            is_p2p_supported=int(info.isP2pSupported),
        )

    def gpu_instance_possible_placements(self, gpu: int, profile_id: int) -> tuple[tuple[int, int], ...]:
        """nvmlDeviceGetGpuInstancePossiblePlacements_v2: every (start, size) NVML would create `profile_id` at,
        whatever exists already. pynvml leaves the ctypes arrays to the caller: ask for the count, then the list."""
        nvml = self._pynvml
        if nvml is None:
            raise NvmlError("NVMLError_Uninitialized", "init() was not called", call="placements", gpu=gpu)
        handle = self._handle(gpu)
        count = ctypes.c_uint(0)
        call = "nvmlDeviceGetGpuInstancePossiblePlacements"
        try:
            self._nvml(call, handle, profile_id, None, ctypes.byref(count), gpu=gpu)
        except NvmlError as e:
            if e.name != "NVMLError_InsufficientSize":
                raise
        if count.value == 0:
            return ()
        array = (nvml.c_nvmlGpuInstancePlacement_t * count.value)()
        self._nvml(call, handle, profile_id, array, ctypes.byref(count), gpu=gpu)
        return tuple((int(array[k].start), int(array[k].size)) for k in range(count.value))

    def gpu_instance_remaining_capacity(self, gpu: int, profile_id: int) -> int:
        return int(self._dev("nvmlDeviceGetGpuInstanceRemainingCapacity", gpu, profile_id))

    def gpu_instance(self, gpu: int, gpu_instance_id: int) -> GpuInstanceInfo:
        """nvmlDeviceGetGpuInstanceById, then nvmlGpuInstanceGetInfo."""
        gi = self._dev("nvmlDeviceGetGpuInstanceById", gpu, gpu_instance_id)
        info = self._nvml("nvmlGpuInstanceGetInfo", gi, gpu=gpu)
        return GpuInstanceInfo(
            int(info.id), int(info.profileId), int(info.placement.start), int(info.placement.size)
        )

    def compute_instance(self, gpu: int, gpu_instance_id: int, compute_instance_id: int) -> ComputeInstanceInfo:
        """nvmlDeviceGetGpuInstanceById, nvmlGpuInstanceGetComputeInstanceById, nvmlComputeInstanceGetInfo."""
        gi = self._dev("nvmlDeviceGetGpuInstanceById", gpu, gpu_instance_id)
        ci = self._nvml("nvmlGpuInstanceGetComputeInstanceById", gi, compute_instance_id, gpu=gpu)
        info = self._nvml("nvmlComputeInstanceGetInfo", ci, gpu=gpu)
        return ComputeInstanceInfo(
            int(info.id), int(info.profileId), int(info.placement.start), int(info.placement.size)
        )

    def compute_instance_profile(
        self, gpu: int, gpu_instance_id: int, profile_index: int
    ) -> ComputeInstanceProfileInfo:
        """nvmlGpuInstanceGetComputeInstanceProfileInfoV with the shared engine profile, as go-nvlib asks."""
        gi = self._dev("nvmlDeviceGetGpuInstanceById", gpu, gpu_instance_id)
        info = self._nvml(
            "nvmlGpuInstanceGetComputeInstanceProfileInfo",
            gi,
            profile_index,
            NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED,
            gpu=gpu,
        )
        return ComputeInstanceProfileInfo(
            id=int(info.id),
            slice_count=int(info.sliceCount),
            instance_count=int(info.instanceCount),
            multiprocessor_count=int(info.multiprocessorCount),
            name=_text(getattr(info, "name", b"")),
        )

    def mig_minors(self) -> str:
        """The text of /proc/driver/nvidia-caps/mig-minors (capability device minor per GPU/GI/CI)."""
        try:
            return self._mig_minors_path.read_text()
        except OSError as e:
            raise NvmlError(type(e).__name__, f"{self._mig_minors_path}: {e}", call="read mig-minors") from e
