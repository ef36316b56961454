"""The NVML recording: what NVML answered on one machine, kept so any machine can replay discovery exactly.

`gpuplugin record` writes it (`record(backend)`), `load_recording_dict(data)` reads it by replaying it through
the same `discover()` code path live NVML takes, so a recording gives the topology NVML gave on the recorded
machine.

Format (JSON object, version 1). Each value is what the named NVML call returned, or the call's failure as the
string "ERR:<error name>:<message>" (e.g. "ERR:NVMLError_NotSupported:Not Supported"); a field absent from an
input is read as "ERR:NotRecorded:absent from the recording".
    {"format": "gpuplugin.nvml-recording", "version": 1,
     "meta": {...},                        # free-form provenance (tool, nvidia-ml-py version, time); not replayed
     "driver": "580.159.04",               # nvmlSystemGetDriverVersion
     "nvml": "13.580.159.04",              # nvmlSystemGetNVMLVersion
     "gpus": [{                            # position = NVML index
        "index": 0,
        "uuid": "GPU-...",                 # nvmlDeviceGetUUID
        "name": "NVIDIA H200",             # nvmlDeviceGetName
        "pci_bus_id": "00000000:00:06.0",  # nvmlDeviceGetPciInfo().busId
        "minor": 0,                        # nvmlDeviceGetMinorNumber
        "memory_total": 150754820096,      # nvmlDeviceGetMemoryInfo().total, bytes
        "compute_capability": [9, 0],      # nvmlDeviceGetCudaComputeCapability
        "mig_mode": [0, 0],                # nvmlDeviceGetMigMode: [current, pending]
        "numa_node": 0,                    # nvmlDeviceGetNumaNodeId
        "sysfs_numa_node": 0,              # /sys/bus/pci/devices/<bus>/numa_node (-1: none)
        "cpu_affinity": [4294967295],      # nvmlDeviceGetCpuAffinity: 64-bit words, CPU 0 = bit 0 of word 0
        "pcie_max_gen": 5, "pcie_cur_gen": 5, "pcie_max_width": 16, "pcie_cur_width": 16,
        "nvlinks": [                       # links whose nvmlDeviceGetNvLinkState answered (others: no such link)
          {"link": 0, "state": 1,          # nvmlDeviceGetNvLinkState (1 = active)
           "version": 6,                   # nvmlDeviceGetNvLinkVersion (NVML enum: 6 = NVLink 4)
           "remote_bus_id": "FFFFFFFF:FF:FF.0",  # nvmlDeviceGetNvLinkRemotePciInfo().busId
           "remote_type": 2}],            # nvmlDeviceGetNvLinkRemoteDeviceType (0 GPU, 1 IBM NPU, 2 NVSwitch)
        "mig": {                           # optional: what NVML says about MIG on this GPU (absent: not recorded)
          "max_devices": 7,                # nvmlDeviceGetMaxMigDeviceCount
          "gi_profiles": {"0": {           # nvmlDeviceGetGpuInstanceProfileInfoV by profile index 0..17
             "id": 19, "slice_count": 1, "instance_count": 7, "multiprocessor_count": 16, "copy_engine_count": 1,
             "decoder_count": 1, "encoder_count": 0, "jpeg_count": 1, "ofa_count": 0, "memory_size_mb": 16384,
             "name": "MIG 1g.18gb", "is_p2p_supported": 0}, "5": "ERR:NVMLError_NotSupported:Not Supported"},
          "placements": {"19": [[0, 1], [1, 1]]},  # nvmlDeviceGetGpuInstancePossiblePlacements by profile id
          "remaining": {"19": 6},          # nvmlDeviceGetGpuInstanceRemainingCapacity by profile id
          "devices": [{"index": 0, "uuid": "MIG-...", "gpu_instance_id": 7, "compute_instance_id": 0,
                       "memory_total": 17179869184}, "ERR:NVMLError_NotFound:Not Found"],  # by MIG slot
          "gpu_instances": {"7": {"id": 7, "profile_id": 19, "start": 0, "size": 1}},  # by GI id
          "compute_instances": {"7/0": {"id": 0, "profile_id": 0, "start": 0, "size": 1}},  # by "GI/CI"
          "ci_profiles": {"7": {"0": {"id": 0, "slice_count": 1, "instance_count": 1,
                                     "multiprocessor_count": 16, "name": "1c.1g.18gb"}}}}}],  # by GI, CI index
     "mig_minors": {"config": 1, "monitor": 2, "gpu0/gi7/access": 66},  # /proc/driver/nvidia-caps/mig-minors,
                                           # the lines of the MIG-enabled GPUs' minors (optional)
     "pairs": {"0-1": {                    # every ordered pair "a-b" of NVML indices
        "common_ancestor": 30,             # nvmlDeviceGetTopologyCommonAncestor(a, b)
        "p2p_nvlink": 0}}}                 # nvmlDeviceGetP2PStatus(a, b, NVML_P2P_CAPS_INDEX_NVLINK)

Also read: the probe format of fixtures/recordings/h200x2-vm-nvml-probe.json (keys "pci", "mem", "cc",
"numa", "mig", "nvlinks" with "ver"/"remote"/"rtype", pairs with NVML_P2P_CAPS_INDEX_*), converted on load;
its cpu_affinity is a Python repr, not data, and is read as not recorded.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

import structlog
from pydantic import BaseModel, ConfigDict, Field, StringConstraints, ValidationError, model_validator

from gputopo.core.errors import TopologyParseError
from gputopo.core.topology import Topology
from gputopo.discovery.mig_minors import parse_mig_minors
from gputopo.discovery.nvml import DiscoveryError, NodeDiscovery, discover_node
from gputopo.discovery.nvml_backend import (
    ERR_INVALID_ARGUMENT,
    ERR_NOT_SUPPORTED,
    NVML_COMPUTE_INSTANCE_PROFILE_COUNT,
    NVML_DEVICE_MIG_ENABLE,
    NVML_GPU_INSTANCE_PROFILE_COUNT,
    NVML_NVLINK_MAX_LINKS,
    NVML_P2P_CAPS_INDEX_NVLINK,
    NvmlBackend,
    NvmlError,
)
from gputopo.discovery.nvml_replay import ERR_NOT_RECORDED, ReplayNvmlBackend, is_err

RECORDING_FORMAT = "gpuplugin.nvml-recording"
RECORDING_VERSION = 1
NOT_RECORDED = f"ERR:{ERR_NOT_RECORDED}:absent from the recording"


log = structlog.get_logger(__name__)


class RecordingFormatError(TopologyParseError):
    """A recording is malformed, of a newer version, or replays to no usable topology."""


Err = Annotated[str, StringConstraints(pattern=r"^ERR:[^:]*(:.*)?$", max_length=4096)]
IntOrErr = Annotated[int, Field(ge=-(2**63), lt=2**64)] | Err
PairOrErr = Annotated[list[int], Field(min_length=2, max_length=2)] | Err
Words = Annotated[list[Annotated[int, Field(ge=0, lt=2**64)]], Field(max_length=1024)] | Err
Text = Annotated[str, StringConstraints(max_length=4096)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class LinkRecord(_Strict):
    link: int = Field(ge=0, lt=NVML_NVLINK_MAX_LINKS)
    state: IntOrErr
    version: IntOrErr = NOT_RECORDED
    remote_bus_id: Text = NOT_RECORDED
    remote_type: IntOrErr = NOT_RECORDED


Count = Annotated[int, Field(ge=0, lt=2**32)]
Key = Annotated[str, StringConstraints(pattern=r"^[0-9]{1,10}$")]


class GiProfileRecord(_Strict):
    id: Count
    slice_count: Count
    instance_count: Count
    multiprocessor_count: Count
    copy_engine_count: Count
    decoder_count: Count
    encoder_count: Count
    jpeg_count: Count
    ofa_count: Count
    memory_size_mb: Annotated[int, Field(ge=0, lt=2**64)]
    name: Text = ""
    is_p2p_supported: Count = 0


class CiProfileRecord(_Strict):
    id: Count
    slice_count: Count
    instance_count: Count
    multiprocessor_count: Count
    name: Text = ""


class InstanceRecord(_Strict):
    id: Count
    profile_id: Count
    start: Count
    size: Count


class MigDeviceRecord(_Strict):
    index: Count
    uuid: Text
    gpu_instance_id: Count
    compute_instance_id: Count
    memory_total: Annotated[int, Field(ge=0, lt=2**64)]


class MigRecord(_Strict):
    max_devices: IntOrErr = NOT_RECORDED
    gi_profiles: dict[Key, GiProfileRecord | Err] = Field(default_factory=dict, max_length=64)
    placements: dict[Key, Annotated[list[Annotated[list[Count], Field(min_length=2, max_length=2)]],
                                    Field(max_length=64)] | Err] = Field(default_factory=dict, max_length=64)
    remaining: dict[Key, IntOrErr] = Field(default_factory=dict, max_length=64)
    devices: list[MigDeviceRecord | Err] = Field(default_factory=list, max_length=64)
    gpu_instances: dict[Key, InstanceRecord | Err] = Field(default_factory=dict, max_length=64)
    compute_instances: dict[Annotated[str, StringConstraints(pattern=r"^[0-9]{1,10}/[0-9]{1,10}$")],
                            InstanceRecord | Err] = Field(default_factory=dict, max_length=512)
    ci_profiles: dict[Key, dict[Key, CiProfileRecord | Err]] = Field(default_factory=dict, max_length=64)


class GpuRecord(_Strict):
    index: int = Field(ge=0)
    uuid: Text = NOT_RECORDED
    name: Text = NOT_RECORDED
    pci_bus_id: Text = NOT_RECORDED
    minor: IntOrErr = NOT_RECORDED
    memory_total: IntOrErr = NOT_RECORDED
    compute_capability: PairOrErr = NOT_RECORDED
    mig_mode: PairOrErr = NOT_RECORDED
    numa_node: IntOrErr = NOT_RECORDED
    sysfs_numa_node: IntOrErr = NOT_RECORDED
    cpu_affinity: Words = NOT_RECORDED
    pcie_max_gen: IntOrErr = NOT_RECORDED
    pcie_cur_gen: IntOrErr = NOT_RECORDED
    pcie_max_width: IntOrErr = NOT_RECORDED
    pcie_cur_width: IntOrErr = NOT_RECORDED
    nvlinks: list[LinkRecord] = Field(default_factory=list, max_length=NVML_NVLINK_MAX_LINKS)
    mig: MigRecord | None = None

    @model_validator(mode="after")
    def _unique_links(self) -> GpuRecord:
        seen = [x.link for x in self.nvlinks]
        dup = sorted({x for x in seen if seen.count(x) > 1})
        if dup:
            raise ValueError(f"link numbers listed twice: {dup}")
        return self


class PairRecord(_Strict):
    common_ancestor: IntOrErr = NOT_RECORDED
    p2p_nvlink: IntOrErr = NOT_RECORDED


class Recording(_Strict):
    format: Literal["gpuplugin.nvml-recording"]
    version: int
    meta: dict[str, Any] = Field(default_factory=dict)
    driver: Text = NOT_RECORDED
    nvml: Text = NOT_RECORDED
    gpus: list[GpuRecord] = Field(min_length=1, max_length=1024)
    pairs: dict[str, PairRecord] = Field(default_factory=dict)
    mig_minors: dict[Annotated[str, StringConstraints(max_length=64)], Count] | Err | None = Field(
        default=None, max_length=65536
    )

    @model_validator(mode="after")
    def _consistent(self) -> Recording:
        if self.version > RECORDING_VERSION:
            raise ValueError(f"recording version {self.version} is newer than this build reads ({RECORDING_VERSION})")
        if self.version < 1:
            raise ValueError(f"unsupported recording version {self.version}")
        for pos, g in enumerate(self.gpus):
            if g.index != pos:
                raise ValueError(f"gpus[{pos}] has index {g.index}; GPUs must be listed in NVML index order 0..n-1")
        n = len(self.gpus)
        for key in self.pairs:
            a, sep, b = key.partition("-")
            if not (sep and a.isdigit() and b.isdigit() and int(a) != int(b) and int(a) < n and int(b) < n):
                raise ValueError(f"pairs key {key!r} is not 'a-b' with two different GPU indices below {n}")
        return self


def _first_error(e: ValidationError) -> str:
    first = e.errors()[0]
    where = ".".join(str(x) for x in first["loc"]) or "(top level)"
    more = f" (and {e.error_count() - 1} more)" if e.error_count() > 1 else ""
    return f"{where}: {first['msg']}{more}"


def is_probe_format(data: Any) -> bool:
    """The shared probe JSON: no "format" key, GPUs with "pci" instead of "pci_bus_id"."""
    gpus = data.get("gpus") if isinstance(data, dict) else None
    return (
        isinstance(data, dict)
        and "format" not in data
        and isinstance(gpus, list)
        and bool(gpus)
        and all(isinstance(g, dict) and "pci" in g for g in gpus)
    )


def _probe_value(value: Any, want: type | tuple[type, ...]) -> Any:
    """A probe value as the canonical form takes it: the value, its ERR string, or NotRecorded for a non-value."""
    if value is None:
        return NOT_RECORDED
    if is_err(value) or (isinstance(value, want) and not isinstance(value, bool)):
        return value
    return f"ERR:{ERR_NOT_RECORDED}:the probe kept no usable value ({str(value)[:80]})"


def convert_probe(data: dict[str, Any]) -> dict[str, Any]:
    """The shared probe format -> canonical recording dict (not yet validated)."""
    gpus = []
    for g in data["gpus"]:
        if not isinstance(g, dict):
            raise RecordingFormatError("probe recording: every entry of 'gpus' must be an object")
        links = []
        for lk in g.get("nvlinks") or []:
            if not isinstance(lk, dict):
                raise RecordingFormatError("probe recording: every entry of 'nvlinks' must be an object")
            links.append(
                {
                    "link": lk.get("link"),
                    "state": _probe_value(lk.get("state"), int),
                    "version": _probe_value(lk.get("ver"), int),
                    "remote_bus_id": _probe_value(lk.get("remote"), str),
                    "remote_type": _probe_value(lk.get("rtype"), int),
                }
            )
        gpus.append(
            {
                "index": g.get("index"),
                "uuid": _probe_value(g.get("uuid"), str),
                "name": _probe_value(g.get("name"), str),
                "pci_bus_id": _probe_value(g.get("pci"), str),
                "minor": _probe_value(g.get("minor"), int),
                "memory_total": _probe_value(g.get("mem"), int),
                "compute_capability": _probe_value(g.get("cc"), list),
                "mig_mode": _probe_value(g.get("mig"), list),
                "numa_node": _probe_value(g.get("numa"), int),
                "cpu_affinity": _probe_value(g.get("cpu_affinity"), list),
                "pcie_max_gen": _probe_value(g.get("pcie_gen"), int),
                "pcie_cur_gen": _probe_value(g.get("cur_pcie_gen"), int),
                "pcie_max_width": _probe_value(g.get("pcie_width"), int),
                "nvlinks": links,
            }
        )
    pairs = {}
    for key, p in (data.get("pairs") or {}).items():
        if not isinstance(p, dict):
            raise RecordingFormatError(f"probe recording: pairs[{key!r}] must be an object")
        pairs[key] = {
            "common_ancestor": _probe_value(p.get("common_ancestor"), int),
            "p2p_nvlink": _probe_value(p.get("NVML_P2P_CAPS_INDEX_NVLINK"), int),
        }
    meta = {"converted_from": "nvml probe"}
    if data.get("pynvml_version") is not None:
        meta["pynvml_version"] = data["pynvml_version"]
    return {
        "format": RECORDING_FORMAT,
        "version": RECORDING_VERSION,
        "meta": meta,
        "driver": _probe_value(data.get("driver"), str),
        "nvml": _probe_value(data.get("nvml"), str),
        "gpus": gpus,
        "pairs": pairs,
    }


def parse_recording(data: Any) -> dict[str, Any]:
    """Validate a recording (or convert the probe format) and return the canonical dict, absent fields filled in.

    Raises RecordingFormatError naming the first offending field."""
    converted = False
    if is_probe_format(data):
        data = convert_probe(data)
        converted = True
    if not isinstance(data, dict):
        raise RecordingFormatError("an NVML recording must be a JSON object")
    if data.get("format") != RECORDING_FORMAT:
        raise RecordingFormatError(
            f"not an NVML recording: 'format' is {data.get('format')!r}, expected {RECORDING_FORMAT!r}"
        )
    try:
        model = Recording.model_validate(data)
    except ValidationError as e:
        prefix = "NVML recording (converted from the probe format)" if converted else "NVML recording"
        raise RecordingFormatError(f"{prefix}: {_first_error(e)}") from None
    out = model.model_dump(mode="json")
    # Keep recordings without MIG answers as they were (no "mig": null members).
    if out.get("mig_minors") is None:
        out.pop("mig_minors", None)
    for g in out["gpus"]:
        if g.get("mig") is None:
            g.pop("mig", None)
    return out


def replay_backend(data: Any) -> ReplayNvmlBackend:
    """A ready (initialised) replay backend over a validated recording."""
    backend = ReplayNvmlBackend(parse_recording(data))
    backend.init()
    return backend


class RecordingFileBackend(ReplayNvmlBackend):
    """Replays the recording in `path`, read again whenever the file changes (its inode, size or mtime), checked
    at every call: a test or a demo re-partitions a replayed node by writing a new recording in its place (write
    beside it, then rename). A file that no longer reads or validates keeps the last good recording, and says so.
    The event stream (health) is not replayed here: it belongs to the in-process ReplayNvmlBackend."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._seen: tuple[int, int, int] | None = None
        self._said: str | None = None
        super().__init__(self._read())

    def _identity(self) -> tuple[int, int, int] | None:
        try:
            st = os.stat(self.path)
        except OSError:
            return None
        return st.st_ino, st.st_size, st.st_mtime_ns

    def _read(self) -> dict[str, Any]:
        self._seen = self._identity()
        try:
            data = json.loads(self.path.read_bytes())
        except (OSError, ValueError) as e:
            raise RecordingFormatError(f"{self.path}: cannot read the recording: {e}") from None
        return parse_recording(data)

    def refresh(self) -> bool:
        """Swap in the file's recording if it changed since it was read; True when it did."""
        now = self._identity()
        if now is None or now == self._seen:
            return False
        try:
            recording = self._read()
        except (RecordingFormatError, TopologyParseError) as e:
            if str(e) != self._said:
                self._said = str(e)
                log.warning("discovery.replay.reload_failed", path=str(self.path), error=str(e)[:300],
                            action="answering from the last good recording")
            return False
        self._said = None
        self.replace(recording)
        log.info("discovery.replay.reloaded", path=str(self.path), gpus=len(recording["gpus"]))
        return True

    def _check(self, call: str, gpu: int) -> Mapping[str, Any]:
        self.refresh()
        return super()._check(call, gpu)

    def device_count(self) -> int:
        self.refresh()
        return super().device_count()

    def mig_minors(self) -> str:
        self.refresh()
        return super().mig_minors()


def discover_recording(data: Any) -> NodeDiscovery:
    """Replay a recording through discovery; the full result (excluded GPUs, NVML indices, minors)."""
    try:
        return discover_node(replay_backend(data))
    except DiscoveryError as e:
        raise RecordingFormatError(f"NVML recording gives no usable topology: {e}") from None


def load_recording_dict(data: Any) -> Topology:
    """The topology of a recording (either format), as live NVML discovery would have built it there."""
    return discover_recording(data).topology


def _err(e: NvmlError) -> str:
    return f"ERR:{e.name}:{e.message}"


def _ask(fn: Any, *args: Any) -> Any:
    try:
        value = fn(*args)
    except NvmlError as e:
        return _err(e)
    return list(value) if isinstance(value, tuple) else value


def _as_dict(value: Any) -> Any:
    """A backend answer (dataclass, tuple of pairs) as recording JSON."""
    if hasattr(value, "__dataclass_fields__"):
        return {k: getattr(value, k) for k in value.__dataclass_fields__}
    if isinstance(value, tuple):
        return [_as_dict(v) for v in value]
    return value


def _ask_json(fn: Any, *args: Any) -> Any:
    try:
        return _as_dict(fn(*args))
    except NvmlError as e:
        return _err(e)


def record_mig(backend: NvmlBackend, gpu: int) -> dict[str, Any]:
    """Everything MIG discovery asks about one GPU: profiles and placements always (NVML answers them with MIG
    disabled too), devices and their instances when there are any."""
    profiles = {str(p): _ask_json(backend.gpu_instance_profile, gpu, p) for p in range(NVML_GPU_INSTANCE_PROFILE_COUNT)}
    ids = sorted({v["id"] for v in profiles.values() if isinstance(v, dict)})
    out: dict[str, Any] = {
        "max_devices": _ask(backend.max_mig_device_count, gpu),
        "gi_profiles": profiles,
        "placements": {str(i): _ask_json(backend.gpu_instance_possible_placements, gpu, i) for i in ids},
        "remaining": {str(i): _ask(backend.gpu_instance_remaining_capacity, gpu, i) for i in ids},
        "devices": [],
        "gpu_instances": {},
        "compute_instances": {},
        "ci_profiles": {},
    }
    slots = out["max_devices"] if isinstance(out["max_devices"], int) else 0
    for slot in range(min(slots, 64)):
        dev = _ask_json(backend.mig_device, gpu, slot)
        out["devices"].append(dev)
        if not isinstance(dev, dict):
            continue
        gi, ci = dev["gpu_instance_id"], dev["compute_instance_id"]
        if str(gi) not in out["gpu_instances"]:
            out["gpu_instances"][str(gi)] = _ask_json(backend.gpu_instance, gpu, gi)
            out["ci_profiles"][str(gi)] = {
                str(p): _ask_json(backend.compute_instance_profile, gpu, gi, p)
                for p in range(NVML_COMPUTE_INSTANCE_PROFILE_COUNT)
            }
        out["compute_instances"][f"{gi}/{ci}"] = _ask_json(backend.compute_instance, gpu, gi, ci)
    return out


def _nothing_recorded(mig: dict[str, Any]) -> bool:
    """True when a replayed recording had no MIG answers at all (re-recording it must not invent a MIG section)."""
    answers = [mig["max_devices"], *mig["gi_profiles"].values()]
    return all(is_err(a) and a.startswith(f"ERR:{ERR_NOT_RECORDED}:") for a in answers)


def _record_minors(backend: NvmlBackend, mig_gpu_minors: set[int]) -> Any:
    """The mig-minors lines of the MIG-enabled GPUs (and config/monitor); None when no GPU has MIG enabled."""
    if not mig_gpu_minors:
        return None
    try:
        text = backend.mig_minors()
    except NvmlError as e:
        return _err(e)
    entries = parse_mig_minors(text).entries
    keep = {f"gpu{m}/" for m in mig_gpu_minors}
    return {k: v for k, v in entries.items() if "/" not in k or any(k.startswith(p) for p in keep)}


def record(backend: NvmlBackend, meta: dict[str, Any] | None = None) -> dict[str, Any]:
    """Ask `backend` (initialised) everything discovery asks, and return the canonical recording dict.

    Raises NvmlError only when NVML cannot even count the GPUs: nothing else could be recorded then."""
    count = backend.device_count()
    if count <= 0:
        raise NvmlError("NoDevices", "NVML reports no GPUs", call="nvmlDeviceGetCount")
    gpus: list[dict[str, Any]] = []
    for i in range(count):
        links = []
        for link in range(NVML_NVLINK_MAX_LINKS):
            try:
                state: Any = backend.nvlink_state(i, link)
            except NvmlError as e:
                if e.name in (ERR_INVALID_ARGUMENT, ERR_NOT_SUPPORTED):
                    continue  # no such link on this GPU
                state = _err(e)
            links.append(
                {
                    "link": link,
                    "state": state,
                    "version": _ask(backend.nvlink_version, i, link),
                    "remote_bus_id": _ask(backend.nvlink_remote_pci_bus_id, i, link),
                    "remote_type": _ask(backend.nvlink_remote_device_type, i, link),
                }
            )
        gpus.append(
            {
                "index": i,
                "uuid": _ask(backend.uuid, i),
                "name": _ask(backend.name, i),
                "pci_bus_id": _ask(backend.pci_bus_id, i),
                "minor": _ask(backend.minor_number, i),
                "memory_total": _ask(backend.memory_total, i),
                "compute_capability": _ask(backend.cuda_compute_capability, i),
                "mig_mode": _ask(backend.mig_mode, i),
                "numa_node": _ask(backend.numa_node_id, i),
                "sysfs_numa_node": _ask(backend.sysfs_numa_node, i),
                "cpu_affinity": _ask(backend.cpu_affinity, i),
                "pcie_max_gen": _ask(backend.max_pcie_link_generation, i),
                "pcie_cur_gen": _ask(backend.curr_pcie_link_generation, i),
                "pcie_max_width": _ask(backend.max_pcie_link_width, i),
                "pcie_cur_width": _ask(backend.curr_pcie_link_width, i),
                "nvlinks": links,
            }
        )
        if not is_err(gpus[-1]["mig_mode"]):  # MIG-capable: record what NVML says about MIG there
            mig = record_mig(backend, i)
            if not _nothing_recorded(mig):
                gpus[-1]["mig"] = mig
    mig_minors = {
        g["minor"]
        for g in gpus
        if isinstance(g["minor"], int)
        and isinstance(g["mig_mode"], list)
        and g["mig_mode"][0] == NVML_DEVICE_MIG_ENABLE
    }
    pairs = {
        f"{a}-{b}": {
            "common_ancestor": _ask(backend.topology_common_ancestor, a, b),
            "p2p_nvlink": _ask(backend.p2p_status, a, b, NVML_P2P_CAPS_INDEX_NVLINK),
        }
        for a in range(count)
        for b in range(count)
        if a != b
    }
    out = {
        "format": RECORDING_FORMAT,
        "version": RECORDING_VERSION,
        "meta": dict(meta or {}),
        "driver": _ask(backend.driver_version),
        "nvml": _ask(backend.nvml_version),
        "gpus": gpus,
        "pairs": pairs,
    }
    minors = _record_minors(backend, mig_minors)
    if minors is not None:
        out["mig_minors"] = minors
    return parse_recording(out)


def dump_recording(recording: dict[str, Any]) -> str:
    """Stable, diff-friendly JSON text of a canonical recording."""
    return json.dumps(recording, indent=1) + "\n"
