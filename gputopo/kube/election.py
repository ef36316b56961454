"""Leader election on a coordination.k8s.io/v1 Lease, with the official client's `kubernetes.leaderelection`.

The library runs the campaign (create, acquire on expiry, renew every retry period, give up after the renew
deadline); this module adds what a server that must never act twice needs around it:
- `leading` is true only while the last successful write of the Lease is younger than the renew deadline, so a
  stalled renew thread stops the holder from acting before anyone else can take the Lease (the lease duration is
  longer than the deadline);
- every call has the client's request timeout (the library passes none, so a hung apiserver hung the campaign);
- an apiserver that cannot be reached is a failed attempt, retried, not the end of the campaign thread;
- `stop()` ends the campaign and, when this candidate holds the Lease, releases it (holder cleared, as client-go's
  ReleaseOnCancel does), so a standby takes over within one retry period instead of waiting out the lease; no write
  of the library can follow the release.
"""

from __future__ import annotations

import os
import socket
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import kubernetes.client
import structlog
from kubernetes.client.rest import ApiException
from kubernetes.leaderelection import electionconfig, leaderelection
from kubernetes.leaderelection.resourcelock.leaselock import LeaseLock

from gputopo.kube.client import request_timeout
from gputopo.settings import lease_timing_problem
from gputopo.workers import Worker

log = structlog.get_logger(__name__)

SERVICE_ACCOUNT_NAMESPACE = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"


class ElectionError(ValueError):
    """Settings no election can run with (the library would exit the process on them)."""


@dataclass(frozen=True)
class ElectionSettings:
    lease_name: str
    namespace: str
    identity: str
    lease_duration_s: int = 15
    renew_deadline_s: int = 10
    retry_period_s: int = 2

    def __post_init__(self) -> None:
        problem = lease_timing_problem(self.lease_duration_s, self.renew_deadline_s, self.retry_period_s)
        if problem:
            raise ElectionError(problem)
        for what, value in (("lease name", self.lease_name), ("namespace", self.namespace),
                            ("identity", self.identity)):
            if not value:
                raise ElectionError(f"leader election needs a {what}")


def default_namespace() -> str:
    """POD_NAMESPACE (the downward API), else the service account's namespace, else "default"."""
    if os.environ.get("POD_NAMESPACE"):
        return os.environ["POD_NAMESPACE"]
    try:
        with open(SERVICE_ACCOUNT_NAMESPACE) as f:
            return f.read(256).strip() or "default"
    except OSError:
        return "default"


def default_identity() -> str:
    """POD_NAME (else the host name) and a random suffix, as kube-scheduler's: a restarted container must not
    take its dead predecessor's Lease as its own."""
    return f"{os.environ.get('POD_NAME') or socket.gethostname()}_{uuid.uuid4().hex[:8]}"


class _Stopped(Exception):
    """Raised into the library's loop to end it."""


class _TimedLeases(kubernetes.client.CoordinationV1Api):
    """The three calls the library makes, each bounded by the client's request timeout."""

    def read_namespaced_lease(self, name: str, namespace: str, **kwargs: Any) -> Any:
        kwargs.setdefault("_request_timeout", request_timeout(self.api_client))
        return super().read_namespaced_lease(name, namespace, **kwargs)

    def create_namespaced_lease(self, namespace: str, body: Any, **kwargs: Any) -> Any:
        kwargs.setdefault("_request_timeout", request_timeout(self.api_client))
        return super().create_namespaced_lease(namespace, body, **kwargs)

    def replace_namespaced_lease(self, name: str, namespace: str, body: Any, **kwargs: Any) -> Any:
        kwargs.setdefault("_request_timeout", request_timeout(self.api_client))
        return super().replace_namespaced_lease(name, namespace, body, **kwargs)


class _GuardedLock:
    """The library's lock, with writes refused once stopping and every outcome noted: the time of the last
    successful write is what `LeaderElector.leading` trusts."""

    def __init__(self, inner: LeaseLock, wrote: Callable[[], None]) -> None:
        self.inner = inner
        self.name, self.namespace, self.identity = inner.name, inner.namespace, inner.identity
        self.mutex = threading.Lock()
        self.stopping = False
        self._wrote = wrote

    def get(self, name: str, namespace: str) -> tuple[bool, Any]:
        if self.stopping:
            raise _Stopped
        try:
            return self.inner.get(name, namespace)
        except Exception as e:  # unreachable apiserver: a failed attempt (body None: retried, not created)
            return False, ApiException(status=0, reason=_short(e))

    def create(self, name: str, namespace: str, election_record: Any) -> bool:
        return self._write(lambda: self.inner.create(name, namespace, election_record))

    def update(self, name: str, namespace: str, updated_record: Any) -> bool:
        return self._write(lambda: self.inner.update(name, namespace, updated_record))

    def _write(self, write: Callable[[], bool]) -> bool:
        with self.mutex:
            if self.stopping:
                raise _Stopped
            try:
                done = write()
            except Exception as e:
                log.warning("kube.election.write_failed", lease=self.name, error=_short(e))
                return False
            if done:
                self._wrote()
            return done


class LeaderElector(Worker):
    """One candidate. `on_started` runs (in the campaign thread) once the Lease is won, `on_lost` once it could not
    be renewed within the deadline; neither runs after stop(). `wait_for` is checked before campaigning (e.g. a
    synced cache), so a replica that could not act yet never takes the Lease from one that can."""

    def __init__(self, api: kubernetes.client.ApiClient, settings: ElectionSettings, *,
                 on_started: Callable[[], None] = lambda: None, on_lost: Callable[[], None] = lambda: None,
                 wait_for: Callable[[], bool] = lambda: True, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__("leader-election", join_timeout_s=float(settings.retry_period_s + 1))
        self.settings = settings
        self.on_started = on_started
        self.on_lost = on_lost
        self.wait_for = wait_for
        self._clock = clock
        self._won = False
        self._aside = False
        self.release_on_stop = True
        self._last_write = float("-inf")
        inner = LeaseLock(settings.lease_name, settings.namespace, settings.identity)
        inner.api_instance = _TimedLeases(api)
        self.lock = _GuardedLock(inner, self._wrote)
        self.config = electionconfig.Config(
            self.lock, lease_duration=settings.lease_duration_s, renew_deadline=settings.renew_deadline_s,
            retry_period=settings.retry_period_s, onstarted_leading=self._started, onstopped_leading=self._lost)

    @property
    def leading(self) -> bool:
        return self._won and not self._aside and not self.lock.stopping and \
            self._clock() - self._last_write < self.settings.renew_deadline_s

    def step_aside(self) -> None:
        """Stop acting as leader now while still holding (and renewing) the Lease, so that work started under it
        ends before stop() releases it: no one else may act until then."""
        self._aside = True

    def holder(self) -> str | None:
        """Who holds the Lease, as this candidate last read it (None: not read yet, or released)."""
        ref = self.lock.inner.lease_reference
        return ref.spec.holder_identity if ref is not None and ref.spec is not None else None

    def _wrote(self) -> None:
        self._last_write = self._clock()

    def _started(self) -> None:
        self._won = True
        log.info("kube.election.leading", lease=f"{self.settings.namespace}/{self.settings.lease_name}",
                 identity=self.settings.identity)
        self.on_started()

    def _lost(self) -> None:
        if self.lock.stopping:
            return
        self._won = False
        log.error("kube.election.lost", lease=f"{self.settings.namespace}/{self.settings.lease_name}",
                  identity=self.settings.identity, renew_deadline_s=self.settings.renew_deadline_s)
        self.on_lost()

    def loop(self) -> None:
        while not self.wait_for():
            if self.pause(0.1):
                return
        log.info("kube.election.campaigning", lease=f"{self.settings.namespace}/{self.settings.lease_name}",
                 identity=self.settings.identity)
        try:
            leaderelection.LeaderElection(self.config).run()
        except _Stopped:
            return

    def interrupt(self) -> None:
        """Ends the campaign (the library's next read or write raises) and releases a held Lease."""
        with self.lock.mutex:
            if self.lock.stopping:
                return
            self.lock.stopping = True
            if self._won and self.release_on_stop:
                self._release()

    def _release(self) -> None:
        inner = self.lock.inner
        found, _ = inner.get(self.settings.lease_name, self.settings.namespace)  # the library keeps no fresh copy
        ref = inner.lease_reference if found else None
        if ref is None or ref.spec is None or ref.spec.holder_identity != self.settings.identity:
            return
        ref.spec.holder_identity = None
        ref.spec.lease_duration_seconds = 1
        try:
            inner.api_instance.replace_namespaced_lease(self.settings.lease_name, self.settings.namespace, ref)
            log.info("kube.election.released", lease=f"{self.settings.namespace}/{self.settings.lease_name}")
        except Exception as e:  # the standby then waits out the lease
            log.warning("kube.election.release_failed", lease=self.settings.lease_name, error=_short(e))


def _short(e: Exception) -> str:
    """One line: an ApiException's own text carries every response header and the body."""
    if isinstance(e, ApiException):
        return f"{type(e).__name__}: {e.status} {e.reason}"
    return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
