"""This replica's part in leader election (`serve --leader-elect`): the campaign for the Lease, its Pod's role label,
and what losing the Lease means.

Reservations of in-flight plans live in the process that made them, so two replicas answering at once could hand
the same GPUs to two pods. Under election only the Lease holder answers the verbs; a standby keeps its watches
warm, so on taking over it already holds every bound pod's plan (the reservations a restart rebuilds) and needs no
list. kube-scheduler reaches the holder through a Service that selects the role label `leader` on the Pod; the label
follows the Lease, never leads it: a replica answers only while `leading`, whatever its label says.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import kubernetes.client
import structlog

from extender.config import ExtenderConfig
from extender.metrics import ExtenderMetrics
from gputopo.kube.client import request_timeout
from gputopo.kube.election import ElectionSettings, LeaderElector, default_identity, default_namespace

log = structlog.get_logger(__name__)

LEADER = "leader"
STANDBY = "standby"


class Leadership:
    def __init__(self, api: kubernetes.client.ApiClient, config: ExtenderConfig, metrics: ExtenderMetrics, *,
                 ready: Callable[[], bool], on_lost: Callable[[], None], drain: Callable[[float], bool],
                 abandon: Callable[[], None]) -> None:
        """`drain(timeout)`: True once the binds started while leading have ended; `abandon()`: drop the ones not
        written yet."""
        self.api = api
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
        self.abandon = abandon
        self.elector = LeaderElector(api, self.settings, on_started=self._started, on_lost=self._lost,
                                     wait_for=ready)
        metrics.leader.set(0)

    @property
    def leading(self) -> bool:
        return self.elector.leading

    def standby_reason(self) -> str:
        holder = self.elector.holder()
        return (f"gpu-extender standby replica {self.settings.identity}: only the holder of the Lease "
                f"{self.settings.namespace}/{self.settings.lease_name} answers (held by {holder or 'no one yet'})")

    def start(self) -> None:
        self._set_role(STANDBY)
        self.elector.start()

    def stop(self) -> None:
        """Steps down: answers nothing more, lets the binds already started end while the Lease is still held and
        renewed, then releases it, so that a standby takes over within its retry period and never plans on a
        cluster that lacks a bind of this one. Binds that do not end within the renew deadline are abandoned and
        the Lease is left to expire instead."""
        was_leading = self.elector.leading
        self.elector.step_aside()
        self.metrics.leader.set(0)
        if was_leading and not self.drain(float(self.settings.renew_deadline_s)):
            log.warning("extender.leadership.drain_timeout", waited_s=self.settings.renew_deadline_s,
                        hint="binds still out are dropped; the Lease is left to expire")
            self.abandon()
            self.elector.release_on_stop = False
        self.elector.stop()
        if was_leading:
            self._set_role(STANDBY)

    def _started(self) -> None:
        self.metrics.leader.set(1)
        self._set_role(LEADER)

    def _lost(self) -> None:
        self.metrics.leader.set(0)
        self.abandon()  # another replica may lead once the Lease expires: nothing queued here may be written then
        self.on_lost()

    def _set_role(self, role: str) -> None:
        """Patches this replica's Pod label; a failure is logged, not raised: answering follows the Lease alone."""
        if self.pod is None:
            return
        body = {"metadata": {"labels": {self.label: role}}}
        try:
            kubernetes.client.CoreV1Api(self.api).patch_namespaced_pod(
                self.pod, self.settings.namespace, body, _request_timeout=request_timeout(self.api))
            log.info("extender.leadership.role", pod=self.pod, role=role)
        except Exception as e:
            log.warning("extender.leadership.label_failed", pod=self.pod, role=role,
                        error=f"{type(e).__name__}: {e}")
