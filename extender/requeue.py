"""Pods the extender refused get retried as soon as a refusal that ends by time alone has ended.

kube-scheduler retries an unschedulable pod when a cluster event might make it schedulable. A pod refused by an
extender has no rejecting plugin, so any Node or Pod event requeues it. But some of our refusals end with no event
at all: a reservation that times out (a plan never confirmed, a job's slot whose pod never came), or a job of
unknown size whose hold ends when it has grown no more for the reservation timeout (extender.jobs.plans.sweep).
In a quiet cluster the refused pod then waited for kube-scheduler's unschedulable flush, 5 minutes; autoscalers
meanwhile saw a pod that fits an existing node and added nothing (docs/autoscaling.md). Likewise a node whose GPUs
the plugin just published: kube-scheduler may retry a pod on that Node event before this extender's watch has
delivered it, and the refusal ("publishes no GPU topology") then outlives every event (seen with a node an
autoscaler added).

So the pods refused everywhere since the last such end are touched when one comes: a merge patch of one annotation
(`<prefix>/requeued`, the time), an update kube-scheduler requeues the pod on. The set is bounded (the oldest are
forgotten first); a pod that is gone (404) is dropped; a failed patch is logged and the pod kept for the next end.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable

import kubernetes.client
import structlog
from prometheus_client import Counter

from gputopo.contract import Keys
from gputopo.kube import KubeApiError, KubeArgumentError
from gputopo.kube.patching import patch_pod_annotations
from gputopo.workers import Worker

log = structlog.get_logger(__name__)

MAX_WAITING = 2000
RETRY_S = 5.0
NOT_FOUND = 404


class Requeue(Worker):
    """refused() in filter; ended() when a hold ends by time; the worker touches the refused pods."""

    def __init__(self, api: kubernetes.client.ApiClient, keys: Keys, touched: Counter,
                 *, limit: int = MAX_WAITING, clock: Callable[[], float] = time.time) -> None:
        super().__init__("extender-requeue")
        self.api = api
        self.key = keys.requeued
        self.limit = limit
        self.clock = clock
        self._touched = touched
        self._lock = threading.Lock()
        self._waiting: OrderedDict[str, tuple[str, str]] = OrderedDict()  # uid -> (namespace, name)
        self._due = False

    def refused(self, uid: str, namespace: str, name: str) -> None:
        if not uid or not name:
            return
        with self._lock:
            self._waiting[uid] = (namespace, name)
            self._waiting.move_to_end(uid)
            while len(self._waiting) > self.limit:
                self._waiting.popitem(last=False)

    def placed(self, uid: str) -> None:
        with self._lock:
            self._waiting.pop(uid, None)

    def ended(self, why: str, count: int = 1) -> None:
        """A hold ended with no cluster event: touch the refused pods (in the worker, never in the caller)."""
        if count <= 0:
            return
        with self._lock:
            if not self._waiting:
                return
            self._due = True
        log.debug("extender.requeue.due", why=why, ended=count)
        self.wake()

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    def loop(self) -> None:
        self.run_passes(self._pass, retry_s=RETRY_S, failed=lambda: log.exception("extender.requeue.pass_failed"),
                        first_delay_s=3600.0)

    def _pass(self) -> float:
        with self._lock:
            if not self._due:
                return 3600.0  # woken by ended()
            self._due = False
            pods, self._waiting = list(self._waiting.items()), OrderedDict()
        stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(self.clock()))
        failed = 0
        for uid, (namespace, name) in pods:
            if self.stopping:
                break
            try:
                patch_pod_annotations(self.api, namespace, name, {self.key: stamp})
                self._touched.labels("touched").inc()
            except (KubeApiError, KubeArgumentError) as e:
                if getattr(e, "status", None) == NOT_FOUND:
                    self._touched.labels("gone").inc()
                    continue
                failed += 1
                self._touched.labels("failed").inc()
                self.refused(uid, namespace, name)
                log.warning("extender.requeue.patch_failed", pod=f"{namespace}/{name}", error=str(e))
        log.info("extender.requeue.touched", pods=len(pods) - failed, failed=failed)
        if failed:
            with self._lock:
                self._due = True
            return RETRY_S
        return 3600.0
