"""The devices a plugin advertises, derived from a core Topology: ids per id strategy, minors and NUMA nodes.

Kept free of gRPC so that another frontend (a DRA driver) can reuse the same device model.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum

from gpuplugin.deviceplugin.errors import DeviceIdError
from gputopo.core.topology import Topology

# The kubelet rejects device ids longer than this (validation of Device.ID).
MAX_DEVICE_ID_LENGTH = 63


class IdStrategy(StrEnum):
    """What the kubelet sees as a device id: the GPU's UUID (stable across reboots) or its index."""

    UUID = "uuid"
    INDEX = "index"


@dataclass(frozen=True, slots=True)
class Device:
    """One advertised GPU. `id` is what the kubelet sees; `uuid` is the GPU id in the topology; `nvml_index` is the
    index the container runtime understands in NVIDIA_VISIBLE_DEVICES (NVML skips no GPU, the topology skips
    MIG-enabled ones, so the two can differ)."""

    id: str
    index: int
    uuid: str
    minor: int
    nvml_index: int
    numa_node: int | None


def build_devices(
    topo: Topology,
    strategy: IdStrategy | str = IdStrategy.UUID,
    minors: Mapping[int, int] | None = None,
    nvml_indices: Mapping[int, int] | None = None,
) -> tuple[Device, ...]:
    """One Device per GPU of `topo`, in index order. `minors` and `nvml_indices` map a topology index to what
    discovery found; without them both default to the topology index (true on most hosts, not guaranteed)."""
    strategy = IdStrategy(strategy)
    minors = minors or {}
    nvml_indices = nvml_indices or {}
    devices = []
    for gpu in topo.gpus:
        dev_id = gpu.id if strategy is IdStrategy.UUID else str(gpu.index)
        if not dev_id:
            raise DeviceIdError(f"GPU {gpu.index} has an empty id")
        if len(dev_id) > MAX_DEVICE_ID_LENGTH:
            raise DeviceIdError(
                f"GPU {gpu.index} id {dev_id!r} is {len(dev_id)} characters; the kubelet allows "
                f"{MAX_DEVICE_ID_LENGTH} (use --device-id-strategy=index)"
            )
        devices.append(
            Device(
                id=dev_id,
                index=gpu.index,
                uuid=gpu.id,
                minor=minors.get(gpu.index, gpu.index),
                nvml_index=nvml_indices.get(gpu.index, gpu.index),
                numa_node=gpu.numa_node,
            )
        )
    return tuple(devices)
