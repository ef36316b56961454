"""A kubelet simulator: the kubelet's side of the device plugin API, over real unix sockets.

It behaves like the kubelet's device manager where a plugin can tell the difference:
- serves the Registration service on <plugin_dir>/kubelet.sock;
- inside Register (synchronously, before answering) validates the API version and the extended resource name, dials
  the plugin's endpoint (blocking, 10 s) and calls GetDevicePluginOptions; any failure fails the registration;
- then opens ListAndWatch on its own thread and keeps the latest COMPLETE device list per resource (a device left
  out of a message disappears); when a stream ends, every device of that resource turns Unhealthy, as the kubelet
  marks a disconnected plugin's resource;
- asks for a preference with one container request per call and, as the kubelet does, intersects the answer with the
  available devices and fills any shortfall itself (in the order given, where the kubelet's is random);
- allocates with one container request per call; an RPC error from the plugin is an `AdmissionError`;
- `restart()` stops the server, deletes EVERY socket in the directory (the plugin's too) and serves a new
  kubelet.sock, as a kubelet restart does.

Used by the plugin tests, the benchmark and the end-to-end demo.

    with KubeletSimulator(plugin_dir) as kubelet:
        devices = kubelet.wait_for_devices("nvidia.com/gpu", 8, timeout=5)
        ids = kubelet.preferred("nvidia.com/gpu", [d.id for d in devices], [], 4)
        response = kubelet.allocate("nvidia.com/gpu", ids)
"""

from __future__ import annotations

import os
import stat
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import structlog

from gpuplugin.proto import deviceplugin_pb2 as pb
from gpuplugin.proto import deviceplugin_pb2_grpc as pb_grpc
from gputopo.contract import extended_resource_problem

log = structlog.get_logger(__name__)

SUPPORTED_VERSIONS = ("v1beta1",)
KUBELET_SOCKET = "kubelet.sock"
HEALTHY = "Healthy"
UNHEALTHY = "Unhealthy"


class SimulatorError(Exception):
    """Misuse of the simulator (e.g. asking about a resource no plugin registered)."""


class AdmissionError(Exception):
    """The plugin answered an admission-time call with an RPC error: the kubelet would fail the pod."""

    def __init__(self, method: str, code: grpc.StatusCode, details: str) -> None:
        self.method = method
        self.code = code
        self.details = details
        super().__init__(f"{method} failed: {code.name}: {details}")


@dataclass(frozen=True, slots=True)
class SimDevice:
    id: str
    health: str
    numa_nodes: tuple[int, ...]

    @property
    def healthy(self) -> bool:
        return self.health == HEALTHY


@dataclass
class _Endpoint:
    resource: str
    endpoint: str
    channel: grpc.Channel
    stub: pb_grpc.DevicePluginStub
    options: pb.DevicePluginOptions
    closed: bool = False
    call: grpc.Future | None = None
    thread: threading.Thread | None = None

    def close(self) -> None:
        self.closed = True
        if self.call is not None:
            self.call.cancel()
        self.channel.close()


@dataclass
class _Resource:
    devices: dict[str, SimDevice] = field(default_factory=dict)
    registrations: int = 0
    updates: int = 0
    endpoint: _Endpoint | None = None


class _Registration(pb_grpc.RegistrationServicer):
    def __init__(self, sim: KubeletSimulator) -> None:
        self._sim = sim

    def Register(self, request: pb.RegisterRequest, context: grpc.ServicerContext) -> pb.Empty:
        try:
            self._sim._register(request)
        except _Refused as e:
            self._sim._record_rejection(str(e))
            # The kubelet returns a plain Go error, which gRPC carries as UNKNOWN.
            context.abort(grpc.StatusCode.UNKNOWN, str(e))
        return pb.Empty()


class _Refused(Exception):
    pass


class KubeletSimulator:
    """See the module docstring. Thread-safe; every wait takes a timeout and raises TimeoutError when it passes."""

    def __init__(self, plugin_dir: Path | str, *, dial_timeout: float = 10.0) -> None:
        self.plugin_dir = Path(plugin_dir)
        self.socket_path = self.plugin_dir / KUBELET_SOCKET
        self.dial_timeout = dial_timeout
        self.rejections: list[str] = []
        self._cond = threading.Condition()
        self._resources: dict[str, _Resource] = {}
        self._server: grpc.Server | None = None
        self._pool: ThreadPoolExecutor | None = None

    # ---- life ----

    def start(self) -> KubeletSimulator:
        self.plugin_dir.mkdir(parents=True, exist_ok=True)
        if self.socket_path.exists():
            self.socket_path.unlink()
        self._pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="kubelet-sim")
        server = grpc.server(self._pool)
        pb_grpc.add_RegistrationServicer_to_server(_Registration(self), server)
        server.add_insecure_port(f"unix:{self.socket_path}")
        server.start()
        self._server = server
        log.info("sim.kubelet.serving", socket=str(self.socket_path))
        return self

    def stop(self) -> None:
        """Stop serving and drop every plugin connection. Plugin sockets are left alone (a stopped kubelet does)."""
        if self._server is not None:
            self._server.stop(0).wait()
            self._server = None
        if self._pool is not None:
            self._pool.shutdown(wait=False)
            self._pool = None
        with self._cond:
            endpoints = [r.endpoint for r in self._resources.values() if r.endpoint is not None]
            for r in self._resources.values():
                r.endpoint = None
        for ep in endpoints:
            ep.close()
        for ep in endpoints:
            if ep.thread is not None:
                ep.thread.join(timeout=5)
        if self.socket_path.exists():
            self.socket_path.unlink()

    def restart(self) -> None:
        """Stop, delete every socket in the plugin directory, forget all device lists, serve a new kubelet.sock."""
        self.stop()
        for entry in os.scandir(self.plugin_dir):
            try:
                if stat.S_ISSOCK(entry.stat(follow_symlinks=False).st_mode):
                    os.unlink(entry.path)
            except FileNotFoundError:
                pass
        with self._cond:
            for r in self._resources.values():
                r.devices = {}
            self._cond.notify_all()
        self.start()

    def __enter__(self) -> KubeletSimulator:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ---- what the kubelet knows ----

    def devices(self, resource: str) -> list[SimDevice]:
        """The latest complete device list of `resource` (empty before any ListAndWatch message)."""
        with self._cond:
            r = self._resources.get(resource)
            return list(r.devices.values()) if r else []

    def registrations(self, resource: str) -> int:
        with self._cond:
            r = self._resources.get(resource)
            return r.registrations if r else 0

    def updates(self, resource: str) -> int:
        """ListAndWatch messages received for `resource` so far, over all registrations."""
        with self._cond:
            r = self._resources.get(resource)
            return r.updates if r else 0

    def options(self, resource: str) -> pb.DevicePluginOptions:
        return self._endpoint(resource).options

    def wait_until(
        self, resource: str, predicate: Callable[[list[SimDevice]], bool], timeout: float
    ) -> list[SimDevice]:
        """Block until `predicate(devices)` holds on the latest list; return that list."""
        with self._cond:
            ok = self._cond.wait_for(lambda: predicate(self._devices_locked(resource)), timeout)
            devices = self._devices_locked(resource)
        if not ok:
            raise TimeoutError(f"{resource}: condition not met within {timeout} s; devices now {devices}")
        return devices

    def wait_for_devices(self, resource: str, count: int, timeout: float) -> list[SimDevice]:
        """Block until `resource` has exactly `count` Healthy devices (its allocatable); return the list."""
        return self.wait_until(resource, lambda ds: sum(d.healthy for d in ds) == count, timeout)

    def wait_for_registrations(self, resource: str, count: int, timeout: float) -> None:
        with self._cond:
            ok = self._cond.wait_for(lambda: self._registrations_locked(resource) >= count, timeout)
        if not ok:
            raise TimeoutError(f"{resource}: fewer than {count} registrations within {timeout} s")

    # ---- admission calls ----

    def preferred_raw(
        self, resource: str, available: Sequence[str], must_include: Sequence[str], size: int
    ) -> list[str]:
        """The plugin's own answer to one GetPreferredAllocation container request (RPC errors -> AdmissionError)."""
        ep = self._endpoint(resource)
        req = pb.PreferredAllocationRequest(
            container_requests=[
                pb.ContainerPreferredAllocationRequest(
                    available_deviceIDs=list(available),
                    must_include_deviceIDs=list(must_include),
                    allocation_size=size,
                )
            ]
        )
        try:
            resp = ep.stub.GetPreferredAllocation(req, timeout=30)
        except grpc.RpcError as e:
            raise AdmissionError("GetPreferredAllocation", e.code(), e.details() or "") from None
        return list(resp.container_responses[0].deviceIDs) if resp.container_responses else []

    def preferred(self, resource: str, available: Sequence[str], must_include: Sequence[str], size: int) -> list[str]:
        """The devices the kubelet would pick: must-include first, then the plugin's answer intersected with
        `available`, then any shortfall filled from `available` in order."""
        ep = self._endpoint(resource)
        raw = (
            self.preferred_raw(resource, available, must_include, size)
            if ep.options.get_preferred_allocation_available
            else []
        )
        chosen: list[str] = []
        for source in (must_include, [x for x in raw if x in set(available)], available):
            for x in source:
                if len(chosen) >= size:
                    return chosen
                if x not in chosen:
                    chosen.append(x)
        return chosen

    def allocate(self, resource: str, ids: Sequence[str]) -> pb.ContainerAllocateResponse:
        """One container's Allocate call (RPC errors -> AdmissionError)."""
        ep = self._endpoint(resource)
        req = pb.AllocateRequest(container_requests=[pb.ContainerAllocateRequest(devices_ids=list(ids))])
        try:
            resp = ep.stub.Allocate(req, timeout=30)
        except grpc.RpcError as e:
            raise AdmissionError("Allocate", e.code(), e.details() or "") from None
        if len(resp.container_responses) != 1:
            raise AdmissionError(
                "Allocate", grpc.StatusCode.UNKNOWN, f"{len(resp.container_responses)} container responses for 1"
            )
        return resp.container_responses[0]

    # ---- internals ----

    def _devices_locked(self, resource: str) -> list[SimDevice]:
        r = self._resources.get(resource)
        return list(r.devices.values()) if r else []

    def _registrations_locked(self, resource: str) -> int:
        r = self._resources.get(resource)
        return r.registrations if r else 0

    def _endpoint(self, resource: str) -> _Endpoint:
        with self._cond:
            r = self._resources.get(resource)
            if r is None or r.endpoint is None:
                raise SimulatorError(f"no plugin registered for {resource}")
            return r.endpoint

    def _record_rejection(self, message: str) -> None:
        log.warning("sim.kubelet.registration_refused", error=message)
        with self._cond:
            self.rejections.append(message)
            self._cond.notify_all()

    def _register(self, request: pb.RegisterRequest) -> None:
        if request.version not in SUPPORTED_VERSIONS:
            raise _Refused(
                f"requested device plugin version {request.version!r} is not supported; supported: {SUPPORTED_VERSIONS}"
            )
        problem = extended_resource_problem(request.resource_name)
        if problem:
            raise _Refused(f"invalid resource name: {problem}")
        if not request.endpoint or "/" in request.endpoint:
            raise _Refused(f"endpoint must be a socket file name in {self.plugin_dir}: {request.endpoint!r}")
        path = self.plugin_dir / request.endpoint
        channel = grpc.insecure_channel(f"unix:{path}")
        try:
            grpc.channel_ready_future(channel).result(timeout=self.dial_timeout)
        except grpc.FutureTimeoutError:
            channel.close()
            raise _Refused(f"failed to dial device plugin at {path} within {self.dial_timeout} s") from None
        stub = pb_grpc.DevicePluginStub(channel)
        try:
            options = stub.GetDevicePluginOptions(pb.Empty(), timeout=self.dial_timeout)
        except grpc.RpcError as e:
            channel.close()
            raise _Refused(f"GetDevicePluginOptions on {path} failed: {e.code().name}: {e.details()}") from None
        ep = _Endpoint(request.resource_name, request.endpoint, channel, stub, options)
        with self._cond:
            r = self._resources.setdefault(request.resource_name, _Resource())
            old, r.endpoint = r.endpoint, ep
            r.registrations += 1
            self._cond.notify_all()
        if old is not None:
            old.close()
        ep.thread = threading.Thread(target=self._watch, args=(ep,), name=f"listandwatch-{ep.resource}", daemon=True)
        ep.thread.start()
        log.info("sim.kubelet.registered", resource=ep.resource, endpoint=ep.endpoint)

    def _watch(self, ep: _Endpoint) -> None:
        try:
            call = ep.stub.ListAndWatch(pb.Empty())
            ep.call = call
            if ep.closed:
                call.cancel()
            for resp in call:
                devices = {d.ID: SimDevice(d.ID, d.health, tuple(n.ID for n in d.topology.nodes)) for d in resp.devices}
                with self._cond:
                    r = self._resources[ep.resource]
                    if r.endpoint is not ep:
                        return
                    r.devices = devices
                    r.updates += 1
                    self._cond.notify_all()
        except grpc.RpcError as e:
            if not ep.closed:
                log.warning("sim.listandwatch.failed", resource=ep.resource, code=e.code().name)
        except ValueError:  # the endpoint was closed (a newer registration) before the stream could open
            if not ep.closed:
                raise
        finally:
            with self._cond:
                r = self._resources[ep.resource]
                if r.endpoint is ep:
                    # The kubelet marks a disconnected plugin's devices unhealthy (allocatable drops to 0).
                    r.devices = {k: SimDevice(d.id, UNHEALTHY, d.numa_nodes) for k, d in r.devices.items()}
                    self._cond.notify_all()
