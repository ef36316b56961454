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
- `restart()` is a kubelet restart as the real one happens (pkg/kubelet/cm/devicemanager/plugin/v1beta1,
  server.Start): the old kubelet dies (its server, its plugin connections and any dial-back in flight end with it;
  nothing it was doing registers anything later; its kubelet.sock stays behind, refusing connections, as a killed
  process leaves it), the new one deletes EVERY socket in the directory (the old kubelet.sock, the plugin's, any
  other), then listens on a new kubelet.sock. The new server is serving on a path of its own before the deletion
  and is moved in with one rename, so the deletion and the new kubelet.sock are well under a millisecond apart
  (`last_restart_gap_s` says how far), as with the real kubelet.

Used by the plugin tests, the benchmark and the end-to-end demo.

    with KubeletSimulator(plugin_dir) as kubelet:
        devices = kubelet.wait_for_devices("nvidia.com/gpu", 8, timeout=5)
        ids = kubelet.preferred("nvidia.com/gpu", [d.id for d in devices], [], 4)
        response = kubelet.allocate("nvidia.com/gpu", ids)
"""

from __future__ import annotations

import os
import shutil
import stat
import tempfile
import threading
import time
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
        self.cut()
        self.channel.close()

    def cut(self) -> None:
        """End the stream now (closing the channel as well takes gRPC about 0.2 s)."""
        self.closed = True
        if self.call is not None:
            self.call.cancel()


@dataclass
class _Resource:
    devices: dict[str, SimDevice] = field(default_factory=dict)
    registrations: int = 0
    updates: int = 0
    endpoint: _Endpoint | None = None
    # time.monotonic() of each accepted registration, with the kubelet generation that accepted it
    registered_at: list[tuple[int, float]] = field(default_factory=list)


class _Life:
    """One kubelet process's life: what dies with it. A registration it accepted after its death is dropped (a dead
    process registers nothing), and its dial-backs in flight are cancelled."""

    def __init__(self, generation: int) -> None:
        self.generation = generation
        self.alive = True
        self.dials: set[grpc.Future] = set()


@dataclass
class _Prepared:
    server: grpc.Server
    pool: ThreadPoolExecutor
    life: _Life
    path: Path


class _Registration(pb_grpc.RegistrationServicer):
    def __init__(self, sim: KubeletSimulator, life: _Life) -> None:
        self._sim = sim
        self._life = life

    def Register(self, request: pb.RegisterRequest, context: grpc.ServicerContext) -> pb.Empty:
        try:
            self._sim._register(request, self._life)
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
        self._life: _Life | None = None
        self._staging: Path | None = None
        self._generation = 0
        self.last_restart_gap_s: float | None = None

    # ---- life ----

    def _prepare(self) -> _Prepared:
        """A new kubelet's registration server, already serving, on a path of its own outside the plugin directory
        (the next step moves it in). A path per life: gRPC unlinks its listening path when a server is destroyed,
        which may be later than stop(), and must never hit the kubelet.sock of a later life."""
        self._generation += 1
        life = _Life(self._generation)
        if self._staging is None:
            self._staging = Path(tempfile.mkdtemp(prefix=".kubelet-sim-", dir=self.plugin_dir.parent))
        path = self._staging / f"k{life.generation}.sock"
        pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="kubelet-sim")
        server = grpc.server(pool)
        pb_grpc.add_RegistrationServicer_to_server(_Registration(self, life), server)
        server.add_insecure_port(f"unix:{path}")
        server.start()
        return _Prepared(server, pool, life, path)

    def _publish(self, prepared: _Prepared) -> float:
        """Move the prepared socket in as kubelet.sock (one rename: its creation, already served); returns the
        time.monotonic() at which kubelet.sock appeared."""
        try:
            os.rename(prepared.path, self.socket_path)
        except OSError:  # another filesystem: bind in place, slower
            prepared.server.stop(0).wait()
            prepared.server = grpc.server(prepared.pool)
            pb_grpc.add_RegistrationServicer_to_server(_Registration(self, prepared.life), prepared.server)
            prepared.server.add_insecure_port(f"unix:{self.socket_path}")
            prepared.server.start()
        appeared = time.monotonic()
        self._server, self._pool, self._life = prepared.server, prepared.pool, prepared.life
        log.info("sim.kubelet.serving", socket=str(self.socket_path), generation=prepared.life.generation)
        return appeared

    def start(self) -> KubeletSimulator:
        self.plugin_dir.mkdir(parents=True, exist_ok=True)
        prepared = self._prepare()
        if self.socket_path.exists():
            self.socket_path.unlink()
        self._publish(prepared)
        return self

    @property
    def generation(self) -> int:
        """Which kubelet process this is: 1 for the first start, one more for every start or restart since."""
        return self._generation

    def stop(self) -> None:
        """Stop serving and drop every plugin connection. Plugin sockets are left alone (a stopped kubelet does)."""
        self._die()
        if self.socket_path.exists():
            self.socket_path.unlink()
        if self._staging is not None:
            shutil.rmtree(self._staging, ignore_errors=True)
            self._staging = None

    def _die(self, *, wait: bool = True) -> None:
        """The kubelet process ends: its server, dial-backs in flight and plugin connections go with it. Without
        `wait`, the streams are cut at once and their channels closed on a thread of their own (a restart must not
        take the 0.2 s per channel that closing costs gRPC)."""
        life, self._life = self._life, None
        if life is not None:
            with self._cond:
                life.alive = False
                dials = list(life.dials)
            for dial in dials:
                dial.cancel()
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
            ep.cut()
        if wait:
            self._close(endpoints)
        else:
            threading.Thread(target=self._close, args=(endpoints,), name="kubelet-sim-close", daemon=True).start()

    @staticmethod
    def _close(endpoints: list[_Endpoint]) -> None:
        for ep in endpoints:
            ep.channel.close()
        for ep in endpoints:
            if ep.thread is not None:
                ep.thread.join(timeout=5)

    def restart(self) -> float:
        """The kubelet dies and a new one starts: every socket in the plugin directory deleted (the kubelet's own,
        the plugins'; other files stay), all device lists forgotten, a new kubelet.sock served. Returns the
        time.monotonic() at which the new kubelet.sock was listening."""
        self._die(wait=False)
        prepared = self._prepare()
        with self._cond:
            for r in self._resources.values():
                r.devices = {}
            self._cond.notify_all()
        for entry in os.scandir(self.plugin_dir):
            try:
                if stat.S_ISSOCK(entry.stat(follow_symlinks=False).st_mode):
                    os.unlink(entry.path)
            except FileNotFoundError:
                pass
        deleted = time.monotonic()
        listening = self._publish(prepared)
        self.last_restart_gap_s = listening - deleted
        return listening

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

    def resources(self) -> dict[str, list[SimDevice]]:
        """Every resource a plugin registered, with its latest complete device list (the node's capacity)."""
        with self._cond:
            return {name: list(r.devices.values()) for name, r in sorted(self._resources.items())}

    def registrations(self, resource: str) -> int:
        with self._cond:
            r = self._resources.get(resource)
            return r.registrations if r else 0

    def registration_times(self, resource: str, generation: int | None = None) -> list[float]:
        """time.monotonic() of each registration of `resource` accepted (by the kubelet `generation` only, if
        given): how many a restart got, and how long after it."""
        with self._cond:
            r = self._resources.get(resource)
            entries = r.registered_at if r else []
            return [t for g, t in entries if generation is None or g == generation]

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

    def _register(self, request: pb.RegisterRequest, life: _Life) -> None:
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
        # Each dial its own connection, as each grpc-go ClientConn of the kubelet is (Python's gRPC would share
        # one per target, and a second Register would inherit the first one's connection backoff).
        channel = grpc.insecure_channel(f"unix:{path}", options=[("grpc.use_local_subchannel_pool", 1)])
        # The kubelet's dial: blocking, 10 s, retried with gRPC's connection backoff (a socket that is missing now
        # and served 300 ms later is reached at the next retry, about a second after the first try).
        dial = grpc.channel_ready_future(channel)
        with self._cond:
            live = life.alive
            if live:
                life.dials.add(dial)
        try:
            if not live:
                raise grpc.FutureCancelledError()
            dial.result(timeout=self.dial_timeout)
        except grpc.FutureTimeoutError:
            channel.close()
            raise _Refused(f"failed to dial device plugin: context deadline exceeded ({path}, "
                           f"{self.dial_timeout} s)") from None
        except grpc.FutureCancelledError:
            channel.close()
            raise _Refused("kubelet stopped during registration") from None
        finally:
            with self._cond:
                life.dials.discard(dial)
        stub = pb_grpc.DevicePluginStub(channel)
        try:
            options = stub.GetDevicePluginOptions(pb.Empty(), timeout=self.dial_timeout)
        except grpc.RpcError as e:
            channel.close()
            raise _Refused(f"GetDevicePluginOptions on {path} failed: {e.code().name}: {e.details()}") from None
        ep = _Endpoint(request.resource_name, request.endpoint, channel, stub, options)
        with self._cond:
            if not life.alive:  # the process died meanwhile: nothing of it survives
                channel.close()
                raise _Refused("kubelet stopped during registration")
            r = self._resources.setdefault(request.resource_name, _Resource())
            old, r.endpoint = r.endpoint, ep
            r.registrations += 1
            r.registered_at.append((life.generation, time.monotonic()))
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
