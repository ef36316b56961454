"""Leader election on a coordination.k8s.io/v1 Lease, with the official client's `kubernetes.leaderelection`.

The library runs the campaign (create, acquire on expiry, renew every retry period, give up after the renew
deadline); this module adds what a server that must never act twice needs around it:
- `leading` is true only while the last successful write of the Lease is younger than the renew deadline, so a
  stalled renew thread stops the holder from acting before anyone else can take the Lease (the lease duration is
  longer than the deadline);
- every call has the client's request timeout (the library passes none, so a hung apiserver hung the campaign);
- an apiserver that cannot be reached is a failed attempt, retried, not the end of the campaign thread;
- `stop()` ends the campaign and, when this candidate holds the Lease, releases it (holder cleared, as client-go's
  ReleaseOnCancel does), so a standby takes over at once instead of waiting out the lease; no write of the library
  can follow the release;
- a follower watches the Lease and tries again the moment it is released, instead of at its next retry period;
- a Lease this account may not read or write (401, 403) is a `problem`, logged once as an error, not a lost race.
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
from gputopo.kube.fetching import ApiResource
from gputopo.kube.watching import SYNC, Watcher
from gputopo.settings import lease_timing_problem
from gputopo.workers import Worker

log = structlog.get_logger(__name__)

SERVICE_ACCOUNT_NAMESPACE = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"
LEASES = ApiResource("coordination.k8s.io", "v1", "leases", "Lease")


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
    """The three calls the library makes, each bounded by the client's request timeout, each outcome noted: the
    library swallows its errors, and a Lease this account may not read or write must not look like a lost race."""

    def __init__(self, api: kubernetes.client.ApiClient, noted: Callable[[str, ApiException | None], None]) -> None:
        super().__init__(api)
        self._noted = noted

    def _call(self, what: str, call: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        kwargs.setdefault("_request_timeout", request_timeout(self.api_client))
        try:
            out = call(*args, **kwargs)
        except ApiException as e:
            self._noted(what, e)
            raise
        self._noted(what, None)
        return out

    def read_namespaced_lease(self, name: str, namespace: str, **kwargs: Any) -> Any:
        return self._call("get", super().read_namespaced_lease, name, namespace, **kwargs)

    def create_namespaced_lease(self, namespace: str, body: Any, **kwargs: Any) -> Any:
        return self._call("create", super().create_namespaced_lease, namespace, body, **kwargs)

    def replace_namespaced_lease(self, name: str, namespace: str, body: Any, **kwargs: Any) -> Any:
        return self._call("update", super().replace_namespaced_lease, name, namespace, body, **kwargs)


class _Campaign(leaderelection.LeaderElection):
    """The library's campaign with waits that end early: a follower tries again as soon as `wake` is set (the Lease
    was released or deleted) instead of sleeping out its retry period, so a graceful handover takes one write, not
    up to a retry period; and a stopping candidate's waits end at once."""

    def __init__(self, config: electionconfig.Config, wake: threading.Event, stopping: threading.Event) -> None:
        super().__init__(config)
        self.wake = wake
        self.stopping = stopping

    def acquire(self) -> bool:
        while True:
            self.wake.clear()
            if self.try_acquire_or_renew():
                return True
            self.wake.wait(self.election_config.retry_period)

    def renew_loop(self, leading_failed: threading.Event | None = None) -> None:
        """The library's renew loop (try every retry period; give up once the renew deadline passes without a
        successful write), its sleeps interruptible."""
        retry_period = self.election_config.retry_period
        while not (leading_failed is not None and leading_failed.is_set()):
            deadline = time.monotonic() + self.election_config.renew_deadline
            renewed = False
            while time.monotonic() < deadline:
                renewed = self.try_acquire_or_renew()
                if renewed:
                    break
                self.stopping.wait(retry_period)
            if not renewed:
                return
            self.stopping.wait(retry_period)


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
        self.problem: str | None = None  # why the Lease cannot be used (403, 401), while that lasts
        self.answered = False  # the apiserver has answered a Lease call (read, create or write) at least once
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._seen_holder: str | None = None  # "" once the watch saw it released
        inner = LeaseLock(settings.lease_name, settings.namespace, settings.identity)
        inner.api_instance = _TimedLeases(api, self._noted)
        self.lock = _GuardedLock(inner, self._wrote)
        lease = f"{settings.namespace}/{settings.lease_name}"
        # The Lease watched, so that a follower tries at once when it is released; without list/watch on it (an
        # older Role) the watch stays absent and the follower polls every retry period, as before.
        self.watch = Watcher(api, LEASES, self._lease_changed, namespace=settings.namespace,
                             field_selector=f"metadata.name={settings.lease_name}", name=f"lease-{lease}",
                             absent_retry_s=60.0)
        self.config = electionconfig.Config(
            self.lock, lease_duration=settings.lease_duration_s, renew_deadline=settings.renew_deadline_s,
            retry_period=settings.retry_period_s, onstarted_leading=self._started, onstopped_leading=self._lost)

    @property
    def leading(self) -> bool:
        return not self._aside and self.holding

    @property
    def holding(self) -> bool:
        """Holds the Lease, stepped aside or not: what it started while leading may still be finished."""
        return self._won and not self.lock.stopping and \
            self._clock() - self._last_write < self.settings.renew_deadline_s

    def step_aside(self) -> None:
        """Stop acting as leader now while still holding (and renewing) the Lease, so that work started under it
        ends before stop() releases it: no one else may act until then."""
        self._aside = True

    def holder(self) -> str | None:
        """Who holds the Lease, as this candidate's watch last saw it, else as it last read it (None: not seen
        yet, or released)."""
        if self._seen_holder is not None:
            return self._seen_holder or None
        ref = self.lock.inner.lease_reference
        return ref.spec.holder_identity if ref is not None and ref.spec is not None else None

    def _wrote(self) -> None:
        self._last_write = self._clock()

    def successor(self, timeout: float, poll_s: float = 0.05) -> str | None:
        """After stop(): the candidate that took the Lease from this one, read until `timeout` (None: no one did).
        Read directly, not through the stopped campaign; only a stopping leader asks, once."""
        deadline = time.monotonic() + timeout
        while True:
            found, record = self.lock.inner.get(self.settings.lease_name, self.settings.namespace)
            holder = getattr(record, "holder_identity", None) if found else None
            if isinstance(holder, str) and holder and holder != self.settings.identity:
                return holder
            if time.monotonic() >= deadline:
                return None
            time.sleep(poll_s)

    def _noted(self, what: str, error: ApiException | None) -> None:
        """One error line when this account may not use the Lease, one info line when it may again."""
        self.answered = True
        lease = f"{self.settings.namespace}/{self.settings.lease_name}"
        if error is None or error.status not in (401, 403):
            if self.problem is not None and error is None:
                self.problem = None
                log.info("kube.election.lease_usable", lease=lease)
            return
        problem = (f"leader election cannot {what} the Lease {lease}: {error.status} {error.reason} (the "
                   "ServiceAccount needs get, update and create on leases in that namespace)")
        if problem != self.problem:
            log.error("kube.election.forbidden", lease=lease, verb=what, status=error.status,
                      hint="grant the account a Role with get, update, create, list and watch on this Lease")
        self.problem = problem

    def _lease_changed(self, event_type: str, obj: dict[str, Any]) -> None:
        if event_type == SYNC:
            items = obj.get("items") or []
            holder = _holder(items[0]) if items else ""
        else:
            holder = "" if event_type == "DELETED" else _holder(obj)
        self._seen_holder = holder
        if not holder:
            self._wake.set()

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
        self.watch.start()
        try:
            _Campaign(self.config, self._wake, self._stopping).run()
        except _Stopped:
            return
        finally:
            self.watch.stop()

    def interrupt(self) -> None:
        """Ends the campaign (the library's next read or write raises) and releases a held Lease."""
        with self.lock.mutex:
            if self.lock.stopping:
                return
            self.lock.stopping = True
            if self._won and self.release_on_stop:
                self._release()
        self._wake.set()  # a follower waiting for its next try ends now
        self._stopping.set()  # and so does a leader waiting to renew

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


def _holder(lease: dict[str, Any]) -> str:
    """The Lease's holder, "" when released."""
    spec = lease.get("spec") if isinstance(lease, dict) else None
    holder = spec.get("holderIdentity") if isinstance(spec, dict) else None
    return holder if isinstance(holder, str) else ""


def _short(e: Exception) -> str:
    """One line: an ApiException's own text carries every response header and the body."""
    if isinstance(e, ApiException):
        return f"{type(e).__name__}: {e.status} {e.reason}"
    return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
