"""This replica's part in leader election (`serve --leader-elect`): the campaign for the Lease, its Pod's role label,
and what losing the Lease means.

Reservations of in-flight plans live in the process that made them, so two replicas answering at once could hand
the same GPUs to two pods. Under election only the Lease holder answers the verbs; a standby keeps its watches
warm, so on taking over it already holds every bound pod's plan (the reservations a restart rebuilds) and needs no
list. It answers only once its view holds everything the previous leader wrote before it let go: on taking the
Lease it writes its role label on its own Pod and waits until its pod watch has delivered that write, so every
Binding made before the handover is in its view (without a Pod of its own it lists the pods again). kube-scheduler
reaches the holder through a Service that selects the role label `leader` on the Pod; the label follows the Lease,
never leads it: a replica answers only while `leading`, whatever its label says.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable

import anyio
import kubernetes.client
import structlog

from extender.config import ExtenderConfig
from extender.metrics import ExtenderMetrics
from extender.state.cluster import ClusterSync
from gputopo.kube import KubeArgumentError
from gputopo.kube.client import request_timeout
from gputopo.kube.election import ElectionSettings, LeaderElector, default_identity, default_namespace

log = structlog.get_logger(__name__)

LEADER = "leader"
STANDBY = "standby"
# How long a verb may be held while this replica takes over (catching up) or hands over (until its successor
# leads): well under kube-scheduler's extender timeout, longer than a handover takes on a loaded node.
HOLD_S = 3.0


class Leadership:
    def __init__(self, api: kubernetes.client.ApiClient, config: ExtenderConfig, metrics: ExtenderMetrics, *,
                 sync: ClusterSync, on_lost: Callable[[], None], drain: Callable[[float], bool]) -> None:
        """`drain(timeout)`: True once the binds started while leading have ended (a bind checks `leading` again
        right before its POST, so none is written after)."""
        self.api = api
        self.sync = sync
        self.settings = ElectionSettings(
            lease_name=config.leader_elect_lease_name,
            namespace=config.leader_elect_namespace or default_namespace(),
            identity=config.leader_elect_identity or default_identity(),
            lease_duration_s=config.leader_elect_lease_duration_s,
            renew_deadline_s=config.leader_elect_renew_deadline_s,
            retry_period_s=config.leader_elect_retry_period_s,
        )
        self.label = config.keys.extender_role
        self.pod = os.environ.get("POD_NAME") or None  # without it no label is written (a process outside a Pod)
        self.metrics = metrics
        self.on_lost = on_lost
        self.drain = drain
        self._caught_up = False  # the view holds every write made before this replica took the Lease
        self._caught_up_event = threading.Event()
        self.handing_over = False  # stepped down on the way out, the successor not yet leading
        self._handed_over = threading.Event()
        self._stopped = False
        self._stop_lock = threading.Lock()
        self.elector = LeaderElector(api, self.settings, on_started=self._started, on_lost=self._lost,
                                     wait_for=lambda: sync.synced)
        metrics.leader.set(0)

    @property
    def leading(self) -> bool:
        return self._caught_up and self.elector.leading

    def may_write(self) -> bool:
        """Whether a bind admitted while leading may still be written: until the Lease is released (a stopping
        leader drains them first) or could not be renewed. New verbs are refused as soon as it steps aside."""
        return self.elector.holding

    @property
    def problem(self) -> str | None:
        """Why this replica cannot take part in the election yet (None: it can): its account may not use the Lease,
        or the Lease was not read yet (a replica is not ready before it knows who leads, or that it may not ask)."""
        if self.elector.problem is not None:
            return self.elector.problem
        return None if self.elector.answered else "leader election has not read the Lease yet"

    def standby_reason(self) -> str:
        if self.elector.problem is not None:
            return f"gpu-extender replica {self.settings.identity} cannot lead: {self.elector.problem}"
        if self.elector.leading:
            return (f"gpu-extender replica {self.settings.identity} took the Lease and is reading what the previous "
                    "leader bound")
        holder = self.elector.holder()
        return (f"gpu-extender standby replica {self.settings.identity}: only the holder of the Lease "
                f"{self.settings.namespace}/{self.settings.lease_name} answers (held by {holder or 'no one yet'})")

    def start(self) -> None:
        self._set_role(STANDBY)
        self.elector.start()

    def stop(self) -> None:
        """Steps down: answers nothing more, lets the binds already started end while the Lease is still held and
        renewed, then releases it, so that a standby (watching the Lease) takes over at once and never plans on a
        cluster that lacks a bind of this one. Binds that do not end within the renew deadline are abandoned and
        the Lease is left to expire instead."""
        with self._stop_lock:
            if self._stopped:
                return
            self._stopped = True
        was_leading = self.elector.leading
        self.handing_over = was_leading
        self.elector.step_aside()
        self._caught_up = False
        self._caught_up_event.clear()
        self.metrics.leader.set(0)
        if was_leading and not self.drain(float(self.settings.renew_deadline_s)):
            log.warning("extender.leadership.drain_timeout", waited_s=self.settings.renew_deadline_s,
                        hint="binds still out may yet be written; the Lease is left to expire")
            self.elector.release_on_stop = False
        self.elector.stop()
        if was_leading:
            self._set_role(STANDBY)
            self._await_successor()
        self._handed_over.set()

    def _await_successor(self) -> None:
        """Until a successor leads and its Pod carries the role label the Service selects (bounded by HOLD_S), the
        verbs this replica is still asked are held (`settled`): kube-scheduler's scheduling cycle is serial, so it
        waits on one held answer instead of sending pod after pod to a replica that can only refuse, each refused
        pod then waiting out its back-off."""
        deadline = time.monotonic() + HOLD_S
        holder = self.elector.successor(HOLD_S)
        pod = (holder.rsplit("_", 1)[0] if "_" in holder else holder) if holder else None  # default_identity's form
        while pod is not None and time.monotonic() < deadline:
            try:
                found = kubernetes.client.CoreV1Api(self.api).read_namespaced_pod(
                    pod, self.settings.namespace, _request_timeout=request_timeout(self.api))
            except Exception:
                return  # not a Pod of ours to read (an identity set by flag, no RBAC): the Lease alone says enough
            if ((found.metadata.labels or {}) if found.metadata else {}).get(self.label) == LEADER:
                break
            time.sleep(0.05)
        log.info("extender.leadership.handed_over", successor=holder)

    async def settled(self) -> None:
        """Waits, bounded by HOLD_S, for a transition this replica is in to end before a verb is answered: a
        takeover still catching up (the verb is then answered), or a handover (the verb is then refused, once the
        successor leads; see `_await_successor`)."""
        if self.elector.leading and not self._caught_up:
            await anyio.to_thread.run_sync(self._caught_up_event.wait, HOLD_S)
        elif self.handing_over and not self._handed_over.is_set():
            await anyio.to_thread.run_sync(self._handed_over.wait, HOLD_S)

    def _started(self) -> None:
        """Runs in the campaign's thread once the Lease is won. Raising ends the leadership (the library stops
        renewing and `_lost` runs): a replica whose view cannot catch up must not hold the Lease."""
        started = time.monotonic()
        written = self._set_role(LEADER)
        deadline = float(self.settings.renew_deadline_s)
        caught_up = False
        if written is not None:
            try:
                caught_up = self.sync.pods.wait_delivered(written, deadline)
            except KubeArgumentError:
                caught_up = False
        if not caught_up:  # no Pod of its own, or a label write the watch did not show in time: list again
            caught_up = self.sync.pods.relist(deadline)
        if not caught_up:
            raise LeadershipError(f"took the Lease but the pod view did not catch up within {deadline:g} s")
        self._caught_up = True
        self._caught_up_event.set()
        self.metrics.leader.set(1)
        log.info("extender.leadership.caught_up", ms=round((time.monotonic() - started) * 1000, 1),
                 by="role label" if written is not None else "relist")

    def _lost(self) -> None:
        self._caught_up = False
        self._caught_up_event.clear()
        self.metrics.leader.set(0)
        self.on_lost()

    def _set_role(self, role: str) -> str | None:
        """Patches this replica's Pod label and returns the resourceVersion it was written at; a failure is
        logged, not raised (None): answering follows the Lease alone."""
        if self.pod is None:
            return None
        body = {"metadata": {"labels": {self.label: role}}}
        try:
            pod = kubernetes.client.CoreV1Api(self.api).patch_namespaced_pod(
                self.pod, self.settings.namespace, body, _request_timeout=request_timeout(self.api))
            log.info("extender.leadership.role", pod=self.pod, role=role)
        except Exception as e:
            log.warning("extender.leadership.label_failed", pod=self.pod, role=role,
                        error=f"{type(e).__name__}: {e}")
            return None
        meta = getattr(pod, "metadata", None)
        rv = getattr(meta, "resource_version", None)
        return rv if isinstance(rv, str) and rv else None


class LeadershipError(RuntimeError):
    """This replica won the Lease but cannot act on it."""
