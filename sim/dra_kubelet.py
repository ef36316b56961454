"""A DRA kubelet stand-in: the kubelet's side of DRA drivers, over real unix sockets (docs/reference/dra-api.md
sections 1-3 and the publishing rules of section 2).

- At start it deletes every ResourceSlice with its nodeName (all drivers), as the kubelet does.
- It scans the plugin registry directory, then watches it (watchdog/inotify, recursive): only unix sockets, names
  starting with "." ignored. Per socket: dial, GetInfo (1 s), validate (type DRAPlugin, a name, the first
  supported version it knows: v1.DRAPlugin or v1beta1.DRAPlugin), then NotifyRegistrationStatus (5 s) with the
  verdict. A failure is retried with backoff 0.5 s .. 122 s; a socket created again registers again; a removed
  one deregisters.
- `prepare(claims)` / `unprepare(claims)`: one batch per call (45 s), like one pod's claims; every requested UID
  must come back, and a per-claim error fails the call (PrepareError), as a failed pod sync does.
- When no instance of a driver has been connected for `slice_grace_s` (30 s on a real node), it deletes that
  driver's slices of its node.
- `watch_health(driver)` reads the NodeWatchResources stream.
"""

from __future__ import annotations

import os
import stat
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import kubernetes.client
import structlog
from watchdog.events import FileSystemEvent, FileSystemEventHandler
from watchdog.observers import Observer

from gpuplugin.proto.dra.v1 import api_pb2 as dra_pb2
from gpuplugin.proto.dra.v1 import api_pb2_grpc as dra_grpc
from gpuplugin.proto.drahealth.v1alpha1 import api_pb2 as health_pb2
from gpuplugin.proto.drahealth.v1alpha1 import api_pb2_grpc as health_grpc
from gpuplugin.proto.pluginregistration.v1 import api_pb2 as reg_pb2
from gpuplugin.proto.pluginregistration.v1 import api_pb2_grpc as reg_grpc
from gputopo.kube.dra import delete_slices

log = structlog.get_logger(__name__)

KNOWN_VERSIONS = ("v1.DRAPlugin", "v1beta1.DRAPlugin")
CALL_TIMEOUT_S = 45.0
BACKOFF = (0.5, 122.0)


class PrepareError(Exception):
    """A prepare or unprepare batch failed as the kubelet would fail the pod sync; `errors` per claim UID."""

    def __init__(self, errors: dict[str, str]) -> None:
        self.errors = errors
        super().__init__("; ".join(f"{uid}: {e}" for uid, e in errors.items()))


@dataclass
class Plugin:
    driver: str
    endpoint: str
    version: str
    channel: grpc.Channel
    registration_socket: str


@dataclass
class _Attempt:
    failures: int = 0
    next_at: float = 0.0


@dataclass
class DraKubeletSim:
    registry_dir: Path
    node: str
    api: kubernetes.client.ApiClient | None = None
    slice_grace_s: float = 30.0
    plugins: dict[str, Plugin] = field(default_factory=dict)
    rejections: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.registry_dir = Path(self.registry_dir)
        self._cond = threading.Condition()
        self._attempts: dict[str, _Attempt] = {}
        self._lost: dict[str, float] = {}
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._observer: Observer | None = None
        self._thread: threading.Thread | None = None

    # ---- life ----

    def start(self) -> DraKubeletSim:
        if self.api is not None:
            delete_slices(self.api, f"spec.nodeName={self.node}")
        self.registry_dir.mkdir(parents=True, exist_ok=True)
        handler = _Handler(self._wake)
        self._observer = Observer()
        self._observer.daemon = True
        self._observer.schedule(handler, str(self.registry_dir), recursive=True)
        self._observer.start()
        self._thread = threading.Thread(target=self._run, name="dra-kubelet-sim", daemon=True)
        self._thread.start()
        self._wake.set()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._observer is not None:
            self._observer.stop()
            self._observer.join(5)
        if self._thread is not None:
            self._thread.join(10)
        with self._cond:
            for p in self.plugins.values():
                p.channel.close()
            self.plugins.clear()

    def __enter__(self) -> DraKubeletSim:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def wait_registered(self, driver: str, timeout: float = 10.0) -> Plugin:
        with self._cond:
            if not self._cond.wait_for(lambda: driver in self.plugins, timeout):
                raise TimeoutError(f"driver {driver} did not register within {timeout} s; refused: {self.rejections}")
            return self.plugins[driver]

    # ---- discovery ----

    def _sockets(self) -> dict[str, Path]:
        out = {}
        for root, dirs, files in os.walk(self.registry_dir):
            dirs[:] = [d for d in dirs if not d.startswith(".")]
            for name in files:
                path = Path(root) / name
                if name.startswith("."):
                    continue
                try:
                    if stat.S_ISSOCK(path.stat().st_mode):
                        out[str(path)] = path
                except OSError:
                    continue
        return out

    def _run(self) -> None:
        known: dict[str, float] = {}
        while not self._stop.is_set():
            self._wake.wait(0.5)
            self._wake.clear()
            sockets = self._sockets()
            for path, sock in sockets.items():
                ctime = sock.stat().st_ctime if sock.exists() else 0.0
                attempt = self._attempts.setdefault(path, _Attempt())
                if known.get(path) == ctime and attempt.failures == 0:
                    continue
                if time.monotonic() < attempt.next_at:
                    continue
                if self._register(sock):
                    known[path] = ctime
                    attempt.failures, attempt.next_at = 0, 0.0
                else:
                    attempt.failures += 1
                    attempt.next_at = time.monotonic() + min(BACKOFF[1], BACKOFF[0] * 2 ** (attempt.failures - 1))
            for path in set(known) - set(sockets):
                del known[path]
                self._attempts.pop(path, None)
                self._deregister(path)
            self._expire_slices()

    def _register(self, sock: Path) -> bool:
        channel = grpc.insecure_channel(f"unix:{sock}")
        try:
            info = reg_grpc.RegistrationStub(channel).GetInfo(reg_pb2.InfoRequest(), timeout=1.0)
        except grpc.RpcError as e:
            channel.close()
            self.rejections.append(f"{sock}: GetInfo failed: {e.code().name}")
            return False
        verdict = self._validate(info)
        try:
            reg_grpc.RegistrationStub(channel).NotifyRegistrationStatus(
                reg_pb2.RegistrationStatus(plugin_registered=verdict is None, error=verdict or ""), timeout=5.0)
        except grpc.RpcError as e:
            channel.close()
            self.rejections.append(f"{sock}: NotifyRegistrationStatus failed: {e.code().name}")
            return False
        channel.close()
        if verdict is not None:
            self.rejections.append(f"{sock}: {verdict}")
            return False
        endpoint = info.endpoint or str(sock)
        version = next(v for v in info.supported_versions if v in KNOWN_VERSIONS)
        with self._cond:
            old = self.plugins.get(info.name)
            if old is not None:
                old.channel.close()
            self.plugins[info.name] = Plugin(info.name, endpoint, version,
                                             grpc.insecure_channel(f"unix:{endpoint}"), str(sock))
            self._lost.pop(info.name, None)
            self._cond.notify_all()
        log.info("sim.dra_kubelet.registered", driver=info.name, endpoint=endpoint)
        return True

    @staticmethod
    def _validate(info: reg_pb2.PluginInfo) -> str | None:
        if info.type != "DRAPlugin":
            return f"plugin type {info.type!r} is not DRAPlugin"
        if not info.name:
            return "plugin has no name"
        if not any(v in KNOWN_VERSIONS for v in info.supported_versions):
            return f"none of the supported versions {list(info.supported_versions)} is known"
        if info.endpoint and not os.path.isabs(info.endpoint):
            return f"endpoint {info.endpoint!r} is not an absolute path"
        return None

    def _deregister(self, socket_path: str) -> None:
        with self._cond:
            for name, p in list(self.plugins.items()):
                if p.registration_socket == socket_path:
                    p.channel.close()
                    del self.plugins[name]
                    self._lost[name] = time.monotonic()
                    log.info("sim.dra_kubelet.deregistered", driver=name)
            self._cond.notify_all()

    def _expire_slices(self) -> None:
        if self.api is None:
            return
        now = time.monotonic()
        for name, since in list(self._lost.items()):
            if now - since >= self.slice_grace_s:
                delete_slices(self.api, f"spec.driver={name},spec.nodeName={self.node}")
                del self._lost[name]

    # ---- calls ----

    def _plugin(self, driver: str) -> Plugin:
        with self._cond:
            plugin = self.plugins.get(driver)
        if plugin is None:
            raise PrepareError({"*": f"DRA driver {driver} is not registered"})
        return plugin

    def prepare(self, driver: str, claims: Iterable[tuple[str, str, str]]) -> dict[str, list[dra_pb2.Device]]:
        """claims: (namespace, uid, name). Returns devices per UID; raises PrepareError as the kubelet fails."""
        response = self._call(driver, "NodePrepareResources", dra_pb2.NodePrepareResourcesRequest, claims)
        return {uid: list(r.devices) for uid, r in response.claims.items()}

    def unprepare(self, driver: str, claims: Iterable[tuple[str, str, str]]) -> None:
        self._call(driver, "NodeUnprepareResources", dra_pb2.NodeUnprepareResourcesRequest, claims)

    def _call(self, driver: str, method: str, request_type: Any, claims: Iterable[tuple[str, str, str]]) -> Any:
        """One (un)prepare call; raises PrepareError for a failed call, a claim missing or answered with an error."""
        wanted = list(claims)
        stub = dra_grpc.DRAPluginStub(self._plugin(driver).channel)
        request = request_type(claims=[dra_pb2.Claim(namespace=ns, uid=uid, name=name) for ns, uid, name in wanted])
        try:
            response = getattr(stub, method)(request, timeout=CALL_TIMEOUT_S)
        except grpc.RpcError as e:
            raise PrepareError({"*": f"{e.code().name}: {e.details()}"}) from None
        errors = {uid: "missing from the response" for _, uid, _ in wanted if uid not in response.claims}
        errors.update({uid: r.error for uid, r in response.claims.items() if r.error})
        if errors:
            raise PrepareError(errors)
        return response

    def watch_health(self, driver: str, timeout: float = 30.0):
        """The health stream's messages as they come (an iterator; cancel by closing it)."""
        stub = health_grpc.DRAResourceHealthStub(self._plugin(driver).channel)
        return stub.NodeWatchResources(health_pb2.NodeWatchResourcesRequest(), timeout=timeout)


class _Handler(FileSystemEventHandler):
    def __init__(self, wake: threading.Event) -> None:
        self._wake = wake

    def on_any_event(self, event: FileSystemEvent) -> None:
        self._wake.set()
