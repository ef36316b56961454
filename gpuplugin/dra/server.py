"""The kubelet-facing side of the DRA driver: plugin registration, DRA v1 and dra-health v1alpha1 over gRPC on
unix sockets, as the Go helper lays them out (docs/reference/dra-api.md sections 1-3):

- `<registry>/<driver>-reg.sock` serves Registration (GetInfo: type DRAPlugin, our name, the DRA socket's absolute
  path, versions v1.DRAPlugin [+ v1alpha1.DRAResourceHealth]); the kubelet finds it by watching the registry;
- `<plugin dir>/dra.sock` serves DRAPlugin (and DRAResourceHealth when health is on).
One gRPC server listens on both. A socket someone removed is served again (the kubelet re-registers a socket that
is created again): the server is a `Worker` that checks both sockets every `poll_interval_s`, and retries a
failed re-serve after the shared `Backoff`. The answers of NodePrepareResources hold every requested UID, with an
error per bad claim.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Self

import grpc
import structlog

from gpuplugin.deviceplugin.server import file_identity, remove_stale
from gpuplugin.dra.driver import ClaimKey, Driver
from gpuplugin.dra.errors import ServeError
from gpuplugin.proto.dra.v1 import api_pb2 as dra_pb2
from gpuplugin.proto.dra.v1 import api_pb2_grpc as dra_grpc
from gpuplugin.proto.drahealth.v1alpha1 import api_pb2 as health_pb2
from gpuplugin.proto.drahealth.v1alpha1 import api_pb2_grpc as health_grpc
from gpuplugin.proto.pluginregistration.v1 import api_pb2 as reg_pb2
from gpuplugin.proto.pluginregistration.v1 import api_pb2_grpc as reg_grpc
from gputopo.retry import Backoff
from gputopo.workers import Worker

log = structlog.get_logger(__name__)

PLUGIN_TYPE = "DRAPlugin"
DRA_VERSION = "v1.DRAPlugin"
HEALTH_VERSION = "v1alpha1.DRAResourceHealth"
MAX_CLAIMS_PER_CALL = 1024  # a batch is one pod's claims; bound what one call can make us do


def _keys(claims: Sequence[Any], context: grpc.ServicerContext) -> list[ClaimKey]:
    """The claims of one (un)prepare call; a call with more than MAX_CLAIMS_PER_CALL is refused."""
    if len(claims) > MAX_CLAIMS_PER_CALL:
        context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{len(claims)} claims in one call, "
                      f"at most {MAX_CLAIMS_PER_CALL}")
    return [ClaimKey(c.namespace, c.uid, c.name) for c in claims]


class _Registration(reg_grpc.RegistrationServicer):
    def __init__(self, server: DraServer) -> None:
        self._server = server

    def GetInfo(self, request: reg_pb2.InfoRequest, context: grpc.ServicerContext) -> reg_pb2.PluginInfo:
        versions = [DRA_VERSION] + ([HEALTH_VERSION] if self._server.health else [])
        return reg_pb2.PluginInfo(type=PLUGIN_TYPE, name=self._server.driver.driver_name,
                                  endpoint=str(self._server.dra_socket), supported_versions=versions)

    def NotifyRegistrationStatus(self, request: reg_pb2.RegistrationStatus,
                                 context: grpc.ServicerContext) -> reg_pb2.RegistrationStatusResponse:
        self._server.note_registration(request.plugin_registered, request.error)
        return reg_pb2.RegistrationStatusResponse()


class _DraPlugin(dra_grpc.DRAPluginServicer):
    def __init__(self, driver: Driver) -> None:
        self._driver = driver

    def NodePrepareResources(self, request: dra_pb2.NodePrepareResourcesRequest,
                             context: grpc.ServicerContext) -> dra_pb2.NodePrepareResourcesResponse:
        out = dra_pb2.NodePrepareResourcesResponse()
        for uid, result in self._driver.prepare(_keys(request.claims, context)).items():
            if isinstance(result, str):
                out.claims[uid].error = result
                continue
            entry = out.claims[uid]
            for d in result:
                device = entry.devices.add(request_names=list(d.request_names), pool_name=d.pool,
                                           device_name=d.device, cdi_device_ids=list(d.cdi_device_ids))
                if d.share_id is not None:  # a shared GPU's allocation: the kubelet keys the device by it
                    device.share_id = d.share_id
        return out

    def NodeUnprepareResources(self, request: dra_pb2.NodeUnprepareResourcesRequest,
                               context: grpc.ServicerContext) -> dra_pb2.NodeUnprepareResourcesResponse:
        out = dra_pb2.NodeUnprepareResourcesResponse()
        for uid, error in self._driver.unprepare(_keys(request.claims, context)).items():
            out.claims[uid].error = error
        return out


class _Health(health_grpc.DRAResourceHealthServicer):
    def __init__(self, server: DraServer) -> None:
        self._server = server

    def NodeWatchResources(self, request: health_pb2.NodeWatchResourcesRequest, context: grpc.ServicerContext):
        """The full list at once, then again after every health change, until the kubelet goes away."""
        driver = self._server.driver
        serial = driver.health_serial
        while context.is_active() and not self._server.stopping:
            now = int(time.time())
            msg = health_pb2.NodeWatchResourcesResponse()
            for name, healthy, message in driver.device_health():
                msg.devices.add(device=health_pb2.DeviceIdentifier(pool_name=driver.pool, device_name=name),
                                health=health_pb2.HEALTHY if healthy else health_pb2.UNHEALTHY,
                                last_updated_time=now, message=message)
            yield msg
            while context.is_active() and not self._server.stopping:
                new = driver.wait_health_change(serial, 0.5)
                if new != serial:
                    serial = new
                    break


class DraServer(Worker):
    """Serves the three services on both sockets; `start()` then `stop()`. Re-serves a removed socket."""

    def __init__(self, driver: Driver, registry_dir: Path, plugin_dir: Path, *, health: bool = True,
                 poll_interval_s: float = 1.0, max_workers: int = 8, backoff_initial_s: float = 0.2,
                 backoff_max_s: float = 10.0) -> None:
        super().__init__("dra-sockets")
        self.driver = driver
        self.health = health
        self.registry_dir = Path(registry_dir)
        self.plugin_dir = Path(plugin_dir)
        self.reg_socket = self.registry_dir / f"{driver.driver_name}-reg.sock"
        self.dra_socket = self.plugin_dir / "dra.sock"
        self.poll_interval_s = poll_interval_s
        self.max_workers = max_workers
        self.registered = threading.Event()
        self.registration_error = ""
        self._backoff = Backoff(backoff_initial_s, backoff_max_s)
        self._server: grpc.Server | None = None
        self._identities: tuple = ()
        self._lock = threading.Lock()

    def note_registration(self, ok: bool, error: str) -> None:
        if ok:
            self.registration_error = ""
            self.registered.set()
            log.info("dra.registration.done", driver=self.driver.driver_name)
        else:
            self.registration_error = error
            self.registered.clear()
            log.warning("dra.registration.refused", driver=self.driver.driver_name, error=error)

    def ready(self) -> bool:
        return self._server is not None and self.registered.is_set() and self._intact()

    def _intact(self) -> bool:
        return self._identities == (file_identity(self.reg_socket), file_identity(self.dra_socket)) and all(
            self._identities)

    def _serve(self) -> None:
        for d in (self.registry_dir, self.plugin_dir):
            d.mkdir(parents=True, exist_ok=True)
        for path in (self.reg_socket, self.dra_socket):
            try:
                remove_stale(path)
            except Exception as e:
                raise ServeError(str(e)) from None
        pool = ThreadPoolExecutor(max_workers=self.max_workers, thread_name_prefix="dra")
        server = grpc.server(pool)
        reg_grpc.add_RegistrationServicer_to_server(_Registration(self), server)
        dra_grpc.add_DRAPluginServicer_to_server(_DraPlugin(self.driver), server)
        if self.health:
            health_grpc.add_DRAResourceHealthServicer_to_server(_Health(self), server)
        try:
            for path in (self.reg_socket, self.dra_socket):
                server.add_insecure_port(f"unix:{path}")
        except RuntimeError as e:
            pool.shutdown(wait=False)
            raise ServeError(f"cannot listen on {self.reg_socket} and {self.dra_socket}: {e}") from None
        server.start()
        self._server = server
        self._identities = (file_identity(self.reg_socket), file_identity(self.dra_socket))
        log.info("dra.server.serving", registration=str(self.reg_socket), dra=str(self.dra_socket))

    def start(self) -> Self:
        """Serve at once (raises ServeError when the sockets cannot be served), then watch them."""
        with self._lock:
            self._serve()
        return super().start()

    def loop(self) -> None:
        delay = self.poll_interval_s
        while not self.pause(delay):
            with self._lock:
                if self.stopping or self._intact():
                    delay = self.poll_interval_s
                    continue
                log.warning("dra.socket.removed", action="serving again")
                self._stop_server(0.2)
                self.registered.clear()
                try:
                    self._serve()
                except ServeError as e:
                    delay = self._backoff.failed()
                    log.error("dra.server.failed", error=str(e), retry_in_s=round(delay, 2))
                    continue
                self._backoff.reset()
                delay = self.poll_interval_s

    def _stop_server(self, grace: float) -> None:
        if self._server is not None:
            self._server.stop(grace).wait()
            self._server = None
        for path, ident in zip((self.reg_socket, self.dra_socket), self._identities or (None, None), strict=True):
            if ident is not None and file_identity(path) == ident:
                path.unlink(missing_ok=True)
        self._identities = ()

    def stop(self, timeout: float | None = None) -> None:
        """Stop watching, then serving, and remove our sockets. Safe to call twice."""
        super().stop(timeout)
        with self._lock:
            self._stop_server(0.5)
        log.info("dra.server.stopped")
