"""Typed errors of the device plugin. Each names the device ids or the setting that was wrong."""

from __future__ import annotations

from collections.abc import Iterable


class DevicePluginError(Exception):
    """Base of every error the device plugin raises."""


class DeviceIdError(DevicePluginError):
    """A device id cannot be advertised to the kubelet (too long, empty, duplicate)."""


class UnknownDeviceError(DevicePluginError):
    """Ids that name no device of this plugin."""

    def __init__(self, ids: Iterable[str], what: str = "unknown device ids") -> None:
        self.ids = tuple(ids)
        super().__init__(f"{what}: {', '.join(self.ids)}")


class AllocationRequestError(DevicePluginError):
    """An Allocate request the plugin refuses (the servicer answers INVALID_ARGUMENT with this message)."""


class RegistrationError(DevicePluginError):
    """Registration with the kubelet failed; `code` is the gRPC status name when the kubelet answered."""

    def __init__(self, message: str, code: str | None = None) -> None:
        self.code = code
        super().__init__(message if code is None else f"{message} ({code})")


class ServeError(DevicePluginError):
    """The gRPC server could not serve on its socket."""
