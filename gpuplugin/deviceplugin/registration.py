"""Registration with the kubelet: one RegisterRequest over <plugin dir>/kubelet.sock.

Inside Register the kubelet dials our socket and calls GetDevicePluginOptions before it answers, so our server
must already be serving; a registration in flight can be cancelled (shutdown must not wait for a slow kubelet).
"""

from __future__ import annotations

import threading
from pathlib import Path

import grpc
import structlog

from gpuplugin.deviceplugin.errors import RegistrationError
from gpuplugin.deviceplugin.servicer import plugin_options
from gpuplugin.proto import deviceplugin_pb2 as pb
from gpuplugin.proto import deviceplugin_pb2_grpc as pb_grpc

log = structlog.get_logger(__name__)

API_VERSION = "v1beta1"
KUBELET_SOCKET = "kubelet.sock"
# The kubelet's own dial-back allows 10 s; leave room for its GetDevicePluginOptions call.
DEFAULT_TIMEOUT_S = 15.0


class Registrar:
    """Registers one endpoint for one resource; `cancel()` aborts an attempt in flight from another thread."""

    def __init__(self, plugin_dir: Path, endpoint: str, resource_name: str, timeout: float = DEFAULT_TIMEOUT_S):
        self.kubelet_socket = Path(plugin_dir) / KUBELET_SOCKET
        self.endpoint = endpoint
        self.resource_name = resource_name
        self.timeout = timeout
        self._lock = threading.Lock()
        self._inflight: grpc.Future | None = None
        self._cancelled = False

    def request(self) -> pb.RegisterRequest:
        return pb.RegisterRequest(
            version=API_VERSION, endpoint=self.endpoint, resource_name=self.resource_name, options=plugin_options()
        )

    def register(self) -> None:
        """One attempt. Raises RegistrationError with the kubelet's message when it refuses or cannot be reached."""
        with grpc.insecure_channel(f"unix:{self.kubelet_socket}") as channel:
            stub = pb_grpc.RegistrationStub(channel)
            with self._lock:
                if self._cancelled:
                    raise RegistrationError("registration cancelled")
                future = stub.Register.future(self.request(), timeout=self.timeout)
                self._inflight = future
            try:
                future.result()
            except grpc.FutureCancelledError:
                raise RegistrationError("registration cancelled") from None
            except grpc.RpcError as e:
                raise RegistrationError(
                    f"kubelet at {self.kubelet_socket} refused registration: {e.details()}", e.code().name
                ) from None
            finally:
                with self._lock:
                    self._inflight = None
        log.info("plugin.registration.done", resource=self.resource_name, endpoint=self.endpoint)

    def cancel(self) -> None:
        with self._lock:
            self._cancelled = True
            if self._inflight is not None:
                self._inflight.cancel()
