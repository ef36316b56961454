"""The kubelet-facing device plugin: resource manager (devices, health, allocation; no gRPC), gRPC servicer, and
the process lifecycle (serve, register, survive kubelet restarts).

    manager = ResourceManager(topology, id_strategy="uuid", list_strategy="envvar")
    with PluginRunner(manager, "/var/lib/kubelet/device-plugins", "nvidia.com/gpu"):
        manager.set_health([uuid], healthy=False)   # every ListAndWatch stream gets the new complete list
"""

from gpuplugin.deviceplugin.allocation import ContainerAllocation, DeviceNode, ListStrategy
from gpuplugin.deviceplugin.devices import Device, IdStrategy, build_devices
from gpuplugin.deviceplugin.errors import (
    AllocationRequestError,
    DeviceIdError,
    DevicePluginError,
    RegistrationError,
    ServeError,
    UnknownDeviceError,
)
from gpuplugin.deviceplugin.lifecycle import DEFAULT_RESOURCE_NAME, DEFAULT_SOCKET_NAME, PluginRunner
from gpuplugin.deviceplugin.plans import PlanSource
from gpuplugin.deviceplugin.preferred import FallbackReason, Preference, Source
from gpuplugin.deviceplugin.resource import DeviceState, ResourceManager, Subscription

__all__ = [
    "DEFAULT_RESOURCE_NAME",
    "DEFAULT_SOCKET_NAME",
    "AllocationRequestError",
    "ContainerAllocation",
    "Device",
    "DeviceIdError",
    "DeviceNode",
    "DevicePluginError",
    "DeviceState",
    "FallbackReason",
    "IdStrategy",
    "ListStrategy",
    "PlanSource",
    "PluginRunner",
    "Preference",
    "RegistrationError",
    "ResourceManager",
    "ServeError",
    "Source",
    "Subscription",
    "UnknownDeviceError",
    "build_devices",
]
