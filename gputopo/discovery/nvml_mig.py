"""MIG discovery: per GPU its MIG mode, the GI profiles NVML offers with their placements, and every MIG device
(GPU instance + compute instance) with its profile, placement, memory, MIG UUID and device nodes.

Done as go-nvlib does it for NVIDIA's plugin (docs/reference/gpu-sharing.md §2.2): devices by slot
(nvmlDeviceGetMaxMigDeviceCount, nvmlDeviceGetMigDeviceHandleByIndex; NotFound / InvalidArgument = empty slot),
the GI's profile id and placement by nvmlGpuInstanceGetInfo, matched against the GPU's GI profiles asked by index;
the CI's size by matching its profile id against the CI profiles of its GI. Names follow go-nvlib's rule
(gputopo.core.mig). One code path for live NVML and for replayed recordings, like the rest of discovery.

A failed call degrades that fact alone and is listed in `MigGpu.problems`: a device whose GI cannot be read is
still listed (its UUID is known) but without a profile, so no strategy will advertise it by a guessed name.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, TypeVar

import structlog

from gputopo.core.mig import (
    ExistingInstance,
    MigError,
    MigProfile,
    Placement,
    advertised_by_mixed,
    device_name,
    gi_profile_name,
)
from gputopo.discovery.mig_minors import MigMinors, parse_mig_minors
from gputopo.discovery.nvml_backend import (
    ERR_INVALID_ARGUMENT,
    ERR_NOT_FOUND,
    ERR_NOT_SUPPORTED,
    NVML_COMPUTE_INSTANCE_PROFILE_COUNT,
    NVML_DEVICE_MIG_ENABLE,
    NVML_GPU_INSTANCE_PROFILE_COUNT,
    NvmlBackend,
    NvmlError,
)

log = structlog.get_logger(__name__)
T = TypeVar("T")
_EMPTY_SLOT = (ERR_NOT_FOUND, ERR_INVALID_ARGUMENT)
_NO_PROFILE = (ERR_NOT_SUPPORTED, ERR_INVALID_ARGUMENT)


@dataclass(frozen=True, slots=True)
class MigDevice:
    """One MIG device. `profile` is its GI profile (None when NVML would not say), `name` the device's name
    (`1g.18gb`, or `1c.2g.35gb` for a smaller compute instance), `device_nodes` what a container needs to open it
    (the parent's /dev/nvidiaN and the two capability nodes; empty when mig-minors did not list them)."""

    uuid: str
    slot: int
    gpu_instance_id: int
    compute_instance_id: int
    memory_bytes: int
    profile: MigProfile | None
    placement: Placement | None
    name: str | None
    ci_slices: int | None
    device_nodes: tuple[str, ...]

    @property
    def advertised_by_mixed(self) -> bool:
        """NVIDIA's mixed strategy advertises it: a known profile and a compute instance taking the whole GI."""
        return self.name is not None and advertised_by_mixed(self.name)


@dataclass(frozen=True, slots=True)
class MigGpu:
    """A GPU whose MIG mode is enabled now or pending: what NVML says about MIG there."""

    nvml_index: int
    uuid: str
    minor: int | None
    model: str | None
    memory_total: int | None
    current_mode: int
    pending_mode: int
    profiles: tuple[MigProfile, ...]
    devices: tuple[MigDevice, ...]
    problems: tuple[str, ...] = ()

    @property
    def enabled(self) -> bool:
        return self.current_mode == NVML_DEVICE_MIG_ENABLE

    @property
    def mode_change_pending(self) -> bool:
        """The mode set differs from the mode in force (takes effect at the next GPU reset)."""
        return self.current_mode != self.pending_mode

    def instances(self) -> tuple[ExistingInstance, ...]:
        """The GPU instances (one per GI, whatever its compute instances), for the core's placement model."""
        seen: dict[int, ExistingInstance] = {}
        for d in self.devices:
            if d.profile is not None and d.placement is not None and d.gpu_instance_id not in seen:
                seen[d.gpu_instance_id] = ExistingInstance(d.profile, d.placement)
        return tuple(seen.values())

    def profile_by_id(self, profile_id: int) -> MigProfile | None:
        return next((p for p in self.profiles if p.id == profile_id), None)


def _try(problems: list[str], fn: Callable[..., T], *args: Any, expected: tuple[str, ...] = ()) -> T | None:
    try:
        return fn(*args)
    except NvmlError as e:
        if e.name not in expected:
            problems.append(f"{e.call or getattr(fn, '__name__', 'call')}{list(args)}: {e.name}")
        return None


def read_mig_minors(backend: NvmlBackend, *, quiet: bool = False) -> MigMinors | None:
    """The capability minors, or None (logged; at debug level when `quiet`) when the file cannot be read."""
    try:
        text = backend.mig_minors()
    except NvmlError as e:
        (log.debug if quiet else log.warning)("discovery.mig.minors_unreadable", error=e.name, message=e.message,
                                              consequence="MIG devices have no capability device nodes")
        return None
    minors = parse_mig_minors(text)
    if minors.bad_lines:
        (log.debug if quiet else log.warning)("discovery.mig.minors_lines_ignored", count=len(minors.bad_lines),
                                              first=minors.bad_lines[0])
    return minors


def gpu_profiles(
    backend: NvmlBackend, gpu: int, memory_total: int | None, problems: list[str]
) -> tuple[MigProfile, ...]:
    """The GI profiles NVML offers on the GPU (asked by every profile index; NotSupported = no such profile here),
    with the placements NVML gives for each. NVML answers both with MIG disabled too."""
    out: list[MigProfile] = []
    for index in range(NVML_GPU_INSTANCE_PROFILE_COUNT):
        info = _try(problems, backend.gpu_instance_profile, gpu, index, expected=_NO_PROFILE)
        if info is None:
            continue
        placements = _try(problems, backend.gpu_instance_possible_placements, gpu, info.id)
        if not placements or memory_total is None:
            problems.append(f"profile id {info.id}: no placements or no GPU memory size; left out")
            continue
        sizes = {size for _, size in placements}
        try:
            name = gi_profile_name(index, memory_total, info.memory_size_mb, info.slice_count)
            if len(sizes) != 1:
                raise MigError(f"placements of several sizes {sorted(sizes)}")
            out.append(
                MigProfile(
                    name=name,
                    id=info.id,
                    compute_slices=info.slice_count,
                    memory_slices=sizes.pop(),
                    instance_count=info.instance_count,
                    starts=tuple(sorted(start for start, _ in placements)),
                    memory_mib=info.memory_size_mb,
                    multiprocessors=info.multiprocessor_count,
                )
            )
        except MigError as e:
            problems.append(f"profile id {info.id}: {e}")
    return tuple(out)


def _ci_slices(backend: NvmlBackend, gpu: int, gi: int, ci_profile_id: int, problems: list[str]) -> int | None:
    for index in range(NVML_COMPUTE_INSTANCE_PROFILE_COUNT):
        info = _try(problems, backend.compute_instance_profile, gpu, gi, index, expected=_NO_PROFILE)
        if info is not None and info.id == ci_profile_id:
            return info.slice_count
    return None


def discover_mig_gpu(
    backend: NvmlBackend,
    gpu: int,
    uuid: str,
    minors: MigMinors | None,
    *,
    quiet: bool = False,
) -> MigGpu | None:
    """MIG facts of one GPU; None when it has no MIG (mode NotSupported) or MIG is neither enabled nor pending.
    `quiet` logs at debug level: a re-read on a timer must not repeat the same lines every pass."""
    problems: list[str] = []
    mode = _try(problems, backend.mig_mode, gpu, expected=(ERR_NOT_SUPPORTED,))
    if mode is None or NVML_DEVICE_MIG_ENABLE not in mode:
        return None
    minor = _try(problems, backend.minor_number, gpu)
    memory_total = _try(problems, backend.memory_total, gpu)
    profiles = gpu_profiles(backend, gpu, memory_total, problems)
    by_id = {p.id: p for p in profiles}
    devices: list[MigDevice] = []
    if mode[0] == NVML_DEVICE_MIG_ENABLE:
        slots = _try(problems, backend.max_mig_device_count, gpu) or 0
        for slot in range(slots):
            dev = _try(problems, backend.mig_device, gpu, slot, expected=_EMPTY_SLOT)
            if dev is None:
                continue
            gi = _try(problems, backend.gpu_instance, gpu, dev.gpu_instance_id)
            ci = _try(problems, backend.compute_instance, gpu, dev.gpu_instance_id, dev.compute_instance_id)
            profile = by_id.get(gi.profile_id) if gi is not None else None
            placement = None
            if gi is not None:
                try:
                    placement = Placement(gi.start, gi.size)
                except MigError as e:
                    problems.append(f"GI {gi.id}: {e}")
            ci_slices = None
            if ci is not None:
                ci_slices = _ci_slices(backend, gpu, dev.gpu_instance_id, ci.profile_id, problems) or ci.size
            name = None
            if profile is not None and ci_slices is not None:
                try:
                    name = device_name(profile.name, ci_slices)
                except MigError as e:
                    problems.append(f"{dev.uuid}: {e}")
            nodes: tuple[str, ...] = ()
            caps = minors.device_nodes(minor, dev.gpu_instance_id, dev.compute_instance_id) if (
                minors is not None and minor is not None) else None
            if caps is not None and minor is not None:
                nodes = (f"/dev/nvidia{minor}", *caps)
            devices.append(
                MigDevice(dev.uuid, slot, dev.gpu_instance_id, dev.compute_instance_id, dev.memory_total, profile,
                          placement, name, ci_slices, nodes)
            )
    found = MigGpu(gpu, uuid, minor, _try(problems, backend.name, gpu), memory_total, int(mode[0]), int(mode[1]),
                   profiles, tuple(devices), tuple(problems))
    for problem in problems:
        (log.debug if quiet else log.info)("discovery.mig.call_failed", gpu=uuid, nvml_index=gpu, problem=problem)
    return found


def discover_mig(backend: NvmlBackend, gpus: Iterable[tuple[int, str]], *, quiet: bool = False) -> tuple[MigGpu, ...]:
    """MIG facts of the given (NVML index, UUID) GPUs that have MIG enabled or pending; mig-minors is read once,
    and only when some GPU has MIG enabled."""
    minors: MigMinors | None = None
    asked = False
    found: list[MigGpu] = []
    for gpu, uuid in gpus:
        if not asked:
            try:
                mode: tuple[int, int] | None = backend.mig_mode(gpu)
            except NvmlError:
                mode = None
            if mode is not None and mode[0] == NVML_DEVICE_MIG_ENABLE:
                minors, asked = read_mig_minors(backend, quiet=quiet), True
        mig = discover_mig_gpu(backend, gpu, uuid, minors, quiet=quiet)
        if mig is not None:
            found.append(mig)
    for m in found:
        (log.debug if quiet else log.info)("discovery.mig.gpu", gpu=m.uuid, nvml_index=m.nvml_index,
                                           mode=[m.current_mode, m.pending_mode],
                                           devices=[d.name or "?" for d in m.devices])
    return tuple(found)
