"""The plugin process's life: serve, register, survive kubelet restarts and deleted sockets, shut down cleanly.

One control thread owns every transition. It reconciles observed state with the wanted state ("our socket is the
one we bound, and the kubelet behind kubelet.sock has our registration") on each directory event and on a slow
poll, which also covers events inotify can miss. Reconciling state rather than replaying events makes bursts
(the kubelet deletes every socket, then creates kubelet.sock) collapse into one restart and one registration.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Self

import structlog

from gpuplugin.deviceplugin.errors import RegistrationError, ServeError
from gpuplugin.deviceplugin.registration import DEFAULT_TIMEOUT_S, KUBELET_SOCKET, Registrar
from gpuplugin.deviceplugin.resource import ResourceManager
from gpuplugin.deviceplugin.server import FileIdentity, PluginServer, file_identity
from gpuplugin.deviceplugin.servicer import DEFAULT_MAX_STREAMS
from gpuplugin.deviceplugin.watcher import DirectoryWatch
from gputopo.retry import Backoff
from gputopo.workers import Worker

log = structlog.get_logger(__name__)

DEFAULT_SOCKET_NAME = "gpu-topology.sock"
DEFAULT_RESOURCE_NAME = "nvidia.com/gpu"


class PluginRunner(Worker):
    """Serves `manager` on <plugin_dir>/<socket_name> and keeps it registered as `resource_name`.

    Use as a context manager, or call start() and stop(). `poll_interval` bounds how long a missed inotify event
    can delay recovery; registration retries back off from `backoff_initial` up to `backoff_max` seconds;
    `max_streams` bounds the ListAndWatch streams served at once.
    """

    def __init__(
        self,
        manager: ResourceManager,
        plugin_dir: Path | str,
        resource_name: str = DEFAULT_RESOURCE_NAME,
        socket_name: str = DEFAULT_SOCKET_NAME,
        *,
        register_timeout: float = DEFAULT_TIMEOUT_S,
        poll_interval: float = 1.0,
        backoff_initial: float = 0.2,
        backoff_max: float = 5.0,
        max_streams: int = DEFAULT_MAX_STREAMS,
    ) -> None:
        if "/" in socket_name or socket_name in ("", ".", "..", KUBELET_SOCKET):
            raise ValueError(f"socket name must be a bare file name other than {KUBELET_SOCKET}: {socket_name!r}")
        super().__init__("deviceplugin-lifecycle", join_timeout_s=30.0)
        self.manager = manager
        self.metrics = manager.metrics
        self.plugin_dir = Path(plugin_dir)
        self.resource_name = resource_name
        self.socket_name = socket_name
        self.socket_path = self.plugin_dir / socket_name
        self.kubelet_socket = self.plugin_dir / KUBELET_SOCKET
        self.poll_interval = poll_interval
        self._backoff = Backoff(backoff_initial, backoff_max)
        self.max_streams = max_streams
        self._registrar = Registrar(self.plugin_dir, socket_name, resource_name, register_timeout)
        self._server: PluginServer | None = None
        self._registered_kubelet: FileIdentity | None = None
        self._state = threading.Condition()
        self._kubelet_created = False
        self._next_attempt = 0.0
        self._registrations = 0
        self._failures = 0
        self._watch: DirectoryWatch | None = None
        self._waiting = False  # said once per wait that no kubelet is there

    # ---- public state ----

    @property
    def serving(self) -> bool:
        server = self._server
        return server is not None and server.intact()

    @property
    def registered(self) -> bool:
        return self._registered_kubelet is not None

    @property
    def registrations(self) -> int:
        """Successful registrations so far (each kubelet restart adds one)."""
        return self._registrations

    def ready(self) -> bool:
        """What /healthz reports: serving on our socket and registered with the current kubelet."""
        return self.serving and self.registered and file_identity(self.kubelet_socket) == self._registered_kubelet

    @property
    def registration_failures(self) -> int:
        """Failed registration attempts so far."""
        return self._failures

    def wait_registered(self, timeout: float, count: int = 1) -> bool:
        """Block until at least `count` registrations have succeeded (False on timeout)."""
        return self.wait_until(lambda r: r.registrations >= count, timeout)

    def wait_until(self, predicate: Callable[[PluginRunner], bool], timeout: float) -> bool:
        """Block until `predicate(self)` holds, re-checked after every registration attempt (False on timeout)."""
        with self._state:
            return self._state.wait_for(lambda: predicate(self), timeout)

    # ---- life ----

    def start(self) -> Self:
        """Serve at once (raises ServeError when the socket cannot be served), then watch and register."""
        if not self.plugin_dir.is_dir():
            # The kubelet makes this directory; without it there is likely no kubelet here (or the path is wrong).
            log.warning("plugin.directory.created", path=str(self.plugin_dir),
                        hint="no kubelet has made this directory: is this a Kubernetes node, and is "
                             "--device-plugin-dir the kubelet's device plugin directory?")
            try:
                self.plugin_dir.mkdir(parents=True, exist_ok=True)
            except OSError as e:
                raise ServeError(f"cannot create the plugin directory {self.plugin_dir}: {e.strerror or e}") from e
        self._restart_server()
        self._watch = DirectoryWatch(self.plugin_dir, self.socket_name, self._on_kubelet_created, self.wake)
        self._watch.start()
        return super().start()

    def interrupt(self) -> None:
        self._registrar.cancel()

    def stop(self, timeout: float | None = None, grace: float = 1.0) -> None:
        """Stop streams and server and remove our socket. Safe to call twice."""
        super().stop(timeout)
        if self._watch is not None:
            self._watch.stop()
            self._watch = None
        if self._server is not None:
            self._server.stop(grace)
            self._server = None
        self._registered_kubelet = None
        log.info("plugin.server.stopped", resource=self.resource_name)

    # ---- control thread ----

    def _on_kubelet_created(self) -> None:
        self._kubelet_created = True
        self.wake()

    def loop(self) -> None:
        while not self.stopping:
            try:
                delay = self._reconcile()
            except Exception:  # keep the plugin alive; the next pass retries
                log.exception("plugin.lifecycle.pass_failed")
                delay = self._backoff.max_s
            self.pause(delay)

    def _restart_server(self) -> None:
        old, self._server = self._server, None
        if old is not None:
            # Streams on a deleted socket lead to a kubelet that is gone: no grace needed.
            old.stop(grace=0.2 if old.intact() else 0.0)
        server = PluginServer(self.manager, self.socket_path, max_streams=self.max_streams)
        server.start()
        self._server = server
        self.metrics.server_starts.inc()

    def _reconcile(self) -> float:
        """One pass; returns the seconds until the next pass is due."""
        if self.stopping:
            return 0.0
        if self._server is None or not self._server.intact():
            if self._server is not None:
                log.warning("plugin.socket.recreated", socket=str(self.socket_path))
            try:
                self._restart_server()
            except ServeError as e:
                log.error("plugin.server.serve_failed", error=str(e))
                return self._fail_later()
            self._registered_kubelet = None
        forced, self._kubelet_created = self._kubelet_created, False
        kubelet = file_identity(self.kubelet_socket)
        if kubelet is None:
            if self._registered_kubelet is not None:
                log.warning("plugin.kubelet.gone", socket=str(self.kubelet_socket))
            if not self._waiting:
                log.info("plugin.kubelet.waiting", socket=str(self.kubelet_socket), serving=str(self.socket_path),
                         hint="registers as soon as the kubelet creates its socket")
                self._waiting = True
            self._registered_kubelet = None
            return self.poll_interval
        self._waiting = False
        if kubelet == self._registered_kubelet:
            # Registered with this very socket (its identity holds the creation time): a creation event that
            # arrives late is the one we already answered. Registering again would make the kubelet replace our
            # endpoint and cut the calls in flight on it (pod admissions).
            return self.poll_interval
        now = time.monotonic()
        if not forced and now < self._next_attempt:
            return self._next_attempt - now
        try:
            self._registrar.register()
        except RegistrationError as e:
            if self.stopping:
                return 0.0
            self.metrics.registration_failures.inc()
            self._registered_kubelet = None
            with self._state:
                self._failures += 1
                self._state.notify_all()
            delay = self._fail_later()
            log.warning("plugin.registration.failed", error=str(e), retry_in_s=round(delay, 2))
            return delay
        self._registered_kubelet = kubelet
        self._backoff.reset()
        self._next_attempt = 0.0
        self.metrics.registrations.inc()
        with self._state:
            self._registrations += 1
            self._state.notify_all()
        return self.poll_interval

    def _fail_later(self) -> float:
        delay = self._backoff.failed()
        self._next_attempt = time.monotonic() + delay
        return delay
