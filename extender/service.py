"""One extender instance: cache, reservations, placement, job plans, binder and metrics, fed by a cluster or an
inventory."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import kubernetes.client
import structlog

from extender.binder import Binder
from extender.config import ExtenderConfig
from extender.jobs.plans import JobPlans
from extender.leadership import Leadership
from extender.metrics import ExtenderMetrics
from extender.placement.engine import Placement
from extender.placement.explain import Explainer
from extender.requeue import Requeue
from extender.state.cache import NodeCache
from extender.state.cluster import ClusterSync
from extender.state.inventory import Inventory, load_inventory
from extender.state.pods import RecentPods
from extender.state.reservations import Reservations
from extender.state.slices import DraView
from gputopo.contract import Plan
from gputopo.workers import Worker

log = structlog.get_logger(__name__)

# Reservation ends that come with no cluster event kube-scheduler would retry a refused pod on (extender.requeue):
# a timeout, and a job's slots given up when it was planned again.
TIMED_ENDS = frozenset({"timeout", "replanned"})


class ReservationExpiry(Worker):
    """Ends reservations whose plans the node never confirmed, every `interval_s`, and forgets idle jobs."""

    def __init__(self, cache: NodeCache, jobs: JobPlans, interval_s: float) -> None:
        super().__init__("extender-expiry")
        self.cache = cache
        self.jobs = jobs
        self.interval_s = interval_s

    def loop(self) -> None:
        self.run_passes(self._expire, retry_s=self.interval_s, first_delay_s=self.interval_s,
                        failed=lambda: log.exception("extender.expiry.pass_failed"))

    def _expire(self) -> float:
        self.cache.expire_reservations()
        self.jobs.sweep()
        return self.interval_s


class Extender:
    """Build with `Extender.standalone(path)` or `Extender.cluster(api)`; start() before serving, stop() after."""

    def __init__(
        self,
        config: ExtenderConfig,
        *,
        api: kubernetes.client.ApiClient | None = None,
        inventory: Inventory | None = None,
        sync_options: dict[str, Any] | None = None,
        clock: Callable[[], float] = time.monotonic,
        expiry_interval_s: float | None = None,
        cache: NodeCache | None = None,
        metrics: ExtenderMetrics | None = None,
        on_lost_lease: Callable[[], None] | None = None,
    ) -> None:
        self.config = config
        self.metrics = metrics if metrics is not None else ExtenderMetrics()
        if cache is None:
            cache = NodeCache(config, Reservations(config.reservation_timeout_s, clock))
        self.cache = cache
        self.reservations = self.cache.reservations
        self.requeue = Requeue(api, config.keys, self.metrics.requeued) if api is not None else None
        self.cache.on_reservation_end = self._reservation_ended
        self.placement = Placement(self.cache)
        self.jobs = JobPlans(self.cache, self.metrics)
        self.recent = RecentPods()
        self.explainer = Explainer(lambda topo, size: self.placement.memo.facts(topo).best_empty(size))
        self.inventory = inventory
        # DRA nodes ranked from our driver's slices and the claims (cluster mode; extender.placement.dra)
        self.dra = DraView(config.dra_driver) if config.dra_driver and api is not None else None
        sync_options = {"metrics": self.metrics.watch, "dra": self.dra, **(sync_options or {})}
        self.sync = ClusterSync(api, self.cache, **sync_options) if api is not None else None
        self.binder = Binder(config, self.cache, self.placement, self.metrics, self.recent, api=api,
                             inventory=inventory, explainer=self.explainer, jobs=self.jobs)
        self.mode = "standalone" if inventory is not None else "cluster"
        self.leadership: Leadership | None = None
        if api is not None and self.sync is not None and config.leader_elect:
            self.leadership = Leadership(api, config, self.metrics, sync=self.sync,
                                         on_lost=on_lost_lease or (lambda: None), drain=self.binder.wait_idle)
            self.binder.may_bind = self.leadership.may_write
        self.expiry_interval_s = expiry_interval_s or max(0.05, min(5.0, config.reservation_timeout_s / 4))
        self._expiry = ReservationExpiry(self.cache, self.jobs, self.expiry_interval_s)
        if self.requeue is not None:
            self.jobs.on_idle = self.requeue.ended
            requeue = self.requeue
            self.cache.on_node_usable = lambda name: requeue.ended("node_usable")
        self.metrics.bind_gauges(
            reservations=lambda: float(self.reservations.count()),
            nodes=lambda: float(len(self.cache.nodes)),
            nodes_without_topology=lambda: float(sum(1 for e in list(self.cache.nodes.values()) if e.topo is None)),
            pods=lambda: float(len(self.cache.pods)),
        )

    @classmethod
    def standalone(cls, path: str | Path, config: ExtenderConfig | None = None, **kwargs: Any) -> Extender:
        """Nodes from a YAML inventory (raises InventoryError naming what is wrong)."""
        config = config or ExtenderConfig()
        entries = load_inventory(path, config.network_locality())
        cache = NodeCache(config, Reservations(config.reservation_timeout_s, kwargs.get("clock", time.monotonic)))
        return cls(config, inventory=Inventory(cache, entries, str(path)), cache=cache, **kwargs)

    @classmethod
    def cluster(cls, api: kubernetes.client.ApiClient, config: ExtenderConfig | None = None,
                **kwargs: Any) -> Extender:
        return cls(config or ExtenderConfig(), api=api, **kwargs)

    def start(self) -> Extender:
        if self.sync is not None:
            self.sync.start()
        if self.leadership is not None:
            self.leadership.start()  # campaigns once ready: a replica that cannot answer yet never takes the Lease
        self._expiry.start()
        if self.requeue is not None:
            self.requeue.start()
        log.info("extender.service.started", mode=self.mode, nodes=len(self.cache.nodes))
        return self

    def hand_over(self) -> None:
        """On the way out, while the server still answers: a leader steps down, lets its binds end and releases
        its Lease, so a standby leads before any connection is closed."""
        if self.leadership is not None:
            self.leadership.stop()

    def stop(self) -> None:
        if self.leadership is not None:
            self.leadership.stop()  # first: a standby takes over while this one winds down
        if self.sync is not None:
            self.sync.stop()
        self._expiry.stop()
        if self.requeue is not None:
            self.requeue.stop()
        log.info("extender.service.stopped", mode=self.mode)

    def _reservation_ended(self, why: str, count: int) -> None:
        self.metrics.reservations_ended.labels(why).inc(count)
        if self.requeue is not None and why in TIMED_ENDS:
            self.requeue.ended(why, count)

    def not_ready(self) -> str | None:
        """Why this replica cannot answer yet (None: it can). Until every watch has delivered its first list, the
        view lacks bound pods' plans, nodes or job owners: an answer from it could hand out GPUs a pod already
        holds. Under election a replica is ready once synced and able to reach its Lease, so that a disruption
        budget counts the standby too; whether it may answer is `leading`."""
        if self.sync is not None and (why := self.sync.not_synced()) is not None:
            return why
        if self.leadership is not None:
            return self.leadership.problem
        return None

    def ready(self) -> bool:
        return self.not_ready() is None

    def leading(self) -> bool:
        """May answer the verbs and bind: always without election, else only while holding the Lease."""
        return self.leadership is None or self.leadership.leading

    def plan_of(self, uid: str) -> Plan | None:
        rec = self.cache.pods.get(uid)
        return rec.plan if rec is not None else None
