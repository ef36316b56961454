"""The plugin process's life: serve, register, survive kubelet restarts and deleted sockets, shut down cleanly.

One control thread owns every transition, and it decides on the state of the device plugin directory, read again
after every action, never on events: is our socket there and ours (else serve anew), is there a kubelet.sock, and
have we registered this server with it. Directory events (watchdog) and the registration's own progress only wake
the thread; a slow poll covers events inotify can miss.

A kubelet restart deletes every socket (ours too) and then creates kubelet.sock, well under a millisecond apart.
So the directory is read kubelet.sock first: a kubelet.sock we have not registered with means its deletions are
done, and our socket, looked at next, is seen gone if it was deleted. A registration is for one start of our server
and one kubelet.sock (its inode and ctime), connects first, and is sent only after the thread has looked again;
while it is out the thread keeps watching, so a socket deleted meanwhile is served again and registered anew with
the kubelet.sock there is now. Whatever order the two changes are seen in, each restart ends in one registration.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Self

import structlog

from gpuplugin.deviceplugin.errors import ServeError
from gpuplugin.deviceplugin.registration import DEFAULT_TIMEOUT_S, KUBELET_SOCKET, Attempt, Registrar, Step
from gpuplugin.deviceplugin.resource import ResourceManager
from gpuplugin.deviceplugin.server import FileIdentity, PluginServer, file_identity
from gpuplugin.deviceplugin.servicer import DEFAULT_MAX_STREAMS
from gpuplugin.deviceplugin.watcher import DirectoryWatch
from gputopo.retry import Backoff
from gputopo.workers import Worker

log = structlog.get_logger(__name__)

DEFAULT_SOCKET_NAME = "gpu-topology.sock"
DEFAULT_RESOURCE_NAME = "nvidia.com/gpu"
# The first warning that no kubelet.sock appeared, and the longest interval between the next ones.
KUBELET_WARN_S = 60.0
KUBELET_WARN_MAX_S = 900.0
# How long a replaced server's calls in flight may take to finish before they are cut.
STOP_GRACE_S = 0.2


@dataclass(frozen=True, slots=True)
class Target:
    """What one registration is for: the `server`-th start of our server, and the kubelet.sock with that identity.
    Every kubelet restart deletes our socket, so it always needs a new registration, even where the new
    kubelet.sock reuses the old one's inode within the same (coarse) ctime tick."""

    server: int
    kubelet: FileIdentity


class PluginRunner(Worker):
    """Serves `manager` on <plugin_dir>/<socket_name> and keeps it registered as `resource_name`.

    Use as a context manager, or call start() and stop(). `poll_interval` bounds how long a missed inotify event
    can delay recovery; registration retries back off from `backoff_initial` up to `backoff_max` seconds;
    `max_streams` bounds the ListAndWatch streams served at once. While no kubelet.sock is there, a warning comes
    `kubelet_warn_s` seconds into the wait and then at doubling intervals up to `kubelet_warn_max_s`: a mistyped
    directory is waited on forever, and a kubelet restart is over long before the first one.
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
        kubelet_warn_s: float = KUBELET_WARN_S,
        kubelet_warn_max_s: float = KUBELET_WARN_MAX_S,
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
        self._server_starts = 0
        self._state = threading.Condition()
        self._registered: Target | None = None
        self._attempt: Attempt | None = None
        self._attempt_target: Target | None = None
        self._failed_target: Target | None = None  # the backoff applies to retries of this target only
        self._next_attempt = 0.0
        self._registrations = 0
        self._failures = 0
        self._watch: DirectoryWatch | None = None
        self._waiting = False  # said once per wait that no kubelet is there
        self.kubelet_warn_s = kubelet_warn_s
        self.kubelet_warn_max_s = max(kubelet_warn_s, kubelet_warn_max_s)
        self._waiting_since = 0.0
        self._warn_at = 0.0
        self._warn_every = kubelet_warn_s
        self._created_dir = False  # this plugin made the directory: no kubelet ever did
        self._kubelet_seen: FileIdentity | None = None

    # ---- public state ----

    @property
    def serving(self) -> bool:
        server = self._server
        return server is not None and server.intact()

    @property
    def registered(self) -> bool:
        return self._registered is not None

    @property
    def registrations(self) -> int:
        """Successful registrations so far (each kubelet restart adds one)."""
        return self._registrations

    def ready(self) -> bool:
        """What /healthz reports: serving on our socket and this server registered with the current kubelet."""
        kubelet = file_identity(self.kubelet_socket)
        return (self.serving and kubelet is not None
                and self._registered == Target(self._server_starts, kubelet))

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
            self._created_dir = True
        self._restart_server()
        self._watch = DirectoryWatch(self.plugin_dir, (self.socket_name, KUBELET_SOCKET), self.wake)
        self._watch.start()
        return super().start()

    def stop(self, timeout: float | None = None, grace: float = 1.0) -> None:
        """Stop streams and server and remove our socket. Safe to call twice."""
        super().stop(timeout)
        if self._watch is not None:
            self._watch.stop()
            self._watch = None
        self._drop_attempt()
        if self._server is not None:
            self._server.stop(grace)
            self._server = None
        self._registered = None
        log.info("plugin.server.stopped", resource=self.resource_name)

    # ---- control thread ----

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
            # The streams end at once; the grace lets calls in flight finish rather than be cut mid-send (a
            # deleted socket's calls come from a kubelet that is gone: they end at once, cancelled by it).
            old.stop(grace=STOP_GRACE_S)
        server = PluginServer(self.manager, self.socket_path, max_streams=self.max_streams)
        server.start()
        self._server = server
        self._server_starts += 1
        self.metrics.server_starts.inc()

    def _drop_attempt(self) -> None:
        attempt, self._attempt, self._attempt_target = self._attempt, None, None
        if attempt is not None:
            attempt.close()

    def _reconcile(self) -> float:
        """One step towards "our socket served and registered with the kubelet.sock there is"; returns the seconds
        until the next pass is due (0 after an action: the state is read again at once)."""
        if self.stopping:
            return 0.0
        # The attempt's step before the directory: a connection made before the look below went to the kubelet.sock
        # seen there (a kubelet.sock, once replaced, never comes back).
        step = self._attempt.step if self._attempt is not None else None
        kubelet = file_identity(self.kubelet_socket)  # first: a new kubelet.sock means its deletions are done
        if self._server is None or not self._server.intact():
            self._drop_attempt()
            self._registered = None  # that registration was for the server whose socket is gone
            if self._server is not None:
                log.warning("plugin.socket.recreated", socket=str(self.socket_path))
            try:
                self._restart_server()
            except ServeError as e:
                log.error("plugin.server.serve_failed", error=str(e))
                return self._fail_later()
            return 0.0
        if kubelet is None:
            self._drop_attempt()
            if self._registered is not None:
                log.warning("plugin.kubelet.gone", socket=str(self.kubelet_socket))
                self._registered = None
            return self._still_waiting()
        self._waiting = False
        if kubelet != self._kubelet_seen:
            self._kubelet_seen = kubelet
            log.info("plugin.kubelet.found", socket=str(self.kubelet_socket))
        target = Target(self._server_starts, kubelet)
        if self._registered == target:
            # Registering again would make the kubelet replace our endpoint and cut the calls in flight on it.
            return self.poll_interval
        self._registered = None
        if self._attempt is not None and self._attempt_target != target:
            self._drop_attempt()  # for a server or a kubelet that is gone
            step = None
        if self._attempt is None:
            wait = self._next_attempt - time.monotonic()
            if target == self._failed_target and wait > 0:
                return wait
            self._attempt, self._attempt_target = self._registrar.attempt(self.wake), target
            return self.poll_interval  # it wakes us when connected or failed
        if step is Step.CONNECTED:
            self._attempt.send()  # both sockets looked at since the connection: this kubelet, our server
            return self.poll_interval
        if step is Step.DONE:
            self._drop_attempt()
            self._registered = target
            self._failed_target = None
            self._backoff.reset()
            self.metrics.registrations.inc()
            with self._state:
                self._registrations += 1
                self._state.notify_all()
            return 0.0
        if step is Step.FAILED:
            error = self._attempt.error
            self._drop_attempt()
            self.metrics.registration_failures.inc()
            with self._state:
                self._failures += 1
                self._state.notify_all()
            self._failed_target = target
            delay = self._fail_later()
            log.warning("plugin.registration.failed", error=str(error), retry_in_s=round(delay, 2))
            return delay
        return self.poll_interval  # connecting, or Register out: either wakes us when it moves

    def _still_waiting(self) -> float:
        """Say that no kubelet is there: once at info when the wait starts (a kubelet restart is one), then warnings
        at doubling intervals while it lasts. Returns the seconds until the next pass."""
        now = time.monotonic()
        if not self._waiting:
            log.info("plugin.kubelet.waiting", socket=str(self.kubelet_socket), serving=str(self.socket_path),
                     hint="registers as soon as the kubelet creates its socket")
            self._waiting = True
            self._waiting_since = now
            self._warn_every = self.kubelet_warn_s
            self._warn_at = now + self._warn_every
        elif now >= self._warn_at:
            log.warning("plugin.kubelet.missing", socket=str(self.kubelet_socket),
                        waited_s=round(now - self._waiting_since, 1), directory_created=self._created_dir,
                        hint="no kubelet has registered plugins here yet: is --device-plugin-dir the kubelet's "
                             "device plugin directory (<kubelet root dir>/device-plugins)?")
            self._warn_every = min(self._warn_every * 2, self.kubelet_warn_max_s)
            self._warn_at = now + self._warn_every
        return max(0.0, min(self.poll_interval, self._warn_at - now))

    def _fail_later(self) -> float:
        delay = self._backoff.failed()
        self._next_attempt = time.monotonic() + delay
        return delay
