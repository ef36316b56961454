"""What a container gets for its GPUs: environment, CDI devices, device nodes and annotations, per strategy.

The kubelet checkpoints an Allocate response and replays it on container and kubelet restarts, so everything here is
a pure function of the chosen devices and the host's device nodes: no random names, no time.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path

from gpuplugin.deviceplugin.devices import Device, IdStrategy
from gputopo.contract import Keys
from gputopo.core.allocator import allreduce_gbps
from gputopo.core.topology import Topology

VISIBLE_DEVICES_ENV = "NVIDIA_VISIBLE_DEVICES"
CDI_KIND = "nvidia.com/gpu"
CDI_ANNOTATION_PREFIX = "cdi.k8s.io/"
# Plugin name part of the CDI annotation key (`cdi.k8s.io/<plugin>_<device>`), as the CDI annotation helpers form it.
CDI_ANNOTATION_PLUGIN = "gpu-topology"
CONTROL_DEVICES = ("nvidiactl", "nvidia-uvm", "nvidia-uvm-tools")


class ListStrategy(StrEnum):
    """How the container runtime learns which GPUs to expose; the same choices as NVIDIA's device plugin.

    - envvar: NVIDIA_VISIBLE_DEVICES, read by the NVIDIA Container Toolkit's runtime or hook (the runtime must be
      configured with it: nvidia-ctk runtime configure).
    - cdi-cri: CDI device names in Allocate's CDIDevices field, which the kubelet (1.28+; DevicePluginCDIDevices,
      GA in 1.31) hands to the runtime in the CRI request: containerd 1.7+ with CDI enabled (the default in 2.0),
      CRI-O 1.28+. Needs CDI specs on the node (nvidia-ctk cdi generate).
    - cdi-annotations: the same names in a `cdi.k8s.io/` annotation, for runtimes that read CDI devices from
      annotations (containerd 1.7+, CRI-O 1.23+) under kubelets that do not pass the CDIDevices field on.
    - cdi: the old name of cdi-cri (it used to send both, and the kubelet passed both to the runtime); deprecated.
    """

    ENVVAR = "envvar"
    CDI_CRI = "cdi-cri"
    CDI_ANNOTATIONS = "cdi-annotations"
    CDI = "cdi"


@dataclass(frozen=True, slots=True)
class DeviceNode:
    """A /dev node for the container; host and container paths are the same."""

    path: str
    permissions: str = "rw"


@dataclass(frozen=True, slots=True)
class Mount:
    """A host directory for the container (the MPS pipe directory of a shared GPU)."""

    container_path: str
    host_path: str
    read_only: bool = False


@dataclass(frozen=True)
class ContainerAllocation:
    envs: dict[str, str] = field(default_factory=dict)
    device_nodes: tuple[DeviceNode, ...] = ()
    annotations: dict[str, str] = field(default_factory=dict)
    cdi_devices: tuple[str, ...] = ()
    # GPU device nodes left out because the host lacks them (the resource manager logs it, rate-limited)
    missing_nodes: tuple[str, ...] = ()
    mounts: tuple[Mount, ...] = ()


def visible_devices(devices: Sequence[Device], id_strategy: IdStrategy) -> str:
    """NVIDIA_VISIBLE_DEVICES: UUIDs, or NVML indices under the index strategy (the runtime hook reads both)."""
    if id_strategy is IdStrategy.UUID:
        return ",".join(d.uuid for d in devices)
    return ",".join(str(d.nvml_index) for d in devices)


def cdi_name(device: Device) -> str:
    """Fully qualified CDI device name; CDI specs from nvidia-ctk name GPUs by UUID (and by index)."""
    return f"{CDI_KIND}={device.uuid}"


def cdi_annotation_key(uuids: Sequence[str]) -> str:
    """Deterministic per device set (GPU or MIG UUIDs), so a replayed checkpoint and a fresh answer agree."""
    digest = hashlib.sha256(",".join(uuids).encode()).hexdigest()[:16]
    return f"{CDI_ANNOTATION_PREFIX}{CDI_ANNOTATION_PLUGIN}_{digest}"


def device_nodes(devices: Sequence[Device], dev_root: Path) -> tuple[tuple[DeviceNode, ...], tuple[str, ...]]:
    """The GPUs' /dev/nvidia<minor> nodes and the control nodes, each only if it exists under `dev_root`/dev, and
    the names of the GPU nodes left out.

    A node that does not exist would make the container runtime fail the container, so it is left out (and the
    caller logs the GPU nodes): on a host without the driver the runtime hook or CDI spec is the only source of truth.
    """
    nodes, missing = existing_nodes([f"/dev/nvidia{d.minor}" for d in devices], dev_root)
    return nodes + control_nodes(dev_root), tuple(m.removeprefix("/dev/") for m in missing)


def existing_nodes(paths: Sequence[str], dev_root: Path) -> tuple[tuple[DeviceNode, ...], tuple[str, ...]]:
    """The /dev paths that exist under `dev_root`, as device nodes, and the paths that do not."""
    nodes, missing = [], []
    for path in paths:
        if (dev_root / path.lstrip("/")).exists():
            nodes.append(DeviceNode(path))
        else:
            missing.append(path)
    return tuple(nodes), tuple(missing)


def control_nodes(dev_root: Path) -> tuple[DeviceNode, ...]:
    """The driver's control nodes every GPU container needs (whole GPU or MIG device), those the host has."""
    return existing_nodes([f"/dev/{name}" for name in CONTROL_DEVICES], dev_root)[0]


def container_allocation(
    topo: Topology,
    devices: Sequence[Device],
    strategy: ListStrategy,
    id_strategy: IdStrategy,
    keys: Keys,
    dev_root: Path,
) -> ContainerAllocation:
    """The response for one container. `devices` must be valid and healthy (the resource manager checks)."""
    ordered = sorted(devices, key=lambda d: d.index)
    ids = ",".join(d.id for d in ordered)
    gbps = allreduce_gbps(topo, [d.index for d in ordered])
    annotations = {keys.gpus: ids, keys.gbps: f"{gbps:.1f}"}
    envs: dict[str, str] = {}
    cdi: tuple[str, ...] = ()
    if strategy is ListStrategy.ENVVAR:
        envs[VISIBLE_DEVICES_ENV] = visible_devices(ordered, id_strategy)
    elif strategy is ListStrategy.CDI_ANNOTATIONS:
        annotations[cdi_annotation_key([d.uuid for d in ordered])] = ",".join(cdi_name(d) for d in ordered)
    else:  # CDI_CRI, and its old name CDI: one channel only, so the runtime is not handed the devices twice
        cdi = tuple(cdi_name(d) for d in ordered)
    nodes, missing = device_nodes(ordered, dev_root)
    return ContainerAllocation(
        envs=envs, device_nodes=nodes, annotations=annotations, cdi_devices=cdi, missing_nodes=missing
    )
